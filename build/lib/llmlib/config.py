"""Model configurations: the handful of numbers that fix a decoder-only transformer's shape.

Every figure the book quotes (bytes per layer, KV cache per token, the decode floor) is computed
from one of these dataclasses, never typed in. The presets are the published shapes of real
models; `ModelConfig.from_hf_dict` reads a Hugging Face `config.json`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3's frequency scaling for long contexts (``rope_scaling.rope_type == "llama3"``)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (optionally with a Mixtral-style mixture of experts)."""

    name: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    head_dim: int = 0  # 0 means d_model // n_heads
    max_seq_len: int = 8192
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    n_experts: int = 0  # 0: a dense SwiGLU FFN; >0: a mixture of experts
    n_experts_per_token: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        for f in (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "ffn_dim",
            "head_dim",
        ):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelConfig.{f} must be a positive integer, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads}) "
                "for grouped-query attention"
            )
        if self.n_experts and not (0 < self.n_experts_per_token <= self.n_experts):
            raise ValueError("n_experts_per_token must be in 1..n_experts for a mixture of experts")

    @property
    def gqa_group(self) -> int:
        """How many query heads share one key/value head."""
        return self.n_heads // self.n_kv_heads

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ---- Hugging Face config.json ---------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str | None = None) -> ModelConfig:
        """Read a Hugging Face ``config.json`` of a Llama or Mixtral model.

        transformers 5.x writes ``rope_parameters`` (with ``rope_theta`` inside); checkpoints on
        the hub still carry ``rope_theta`` and ``rope_scaling`` at the top level. Both are read.
        """
        arch = (d.get("model_type") or "").lower()
        if arch not in ("llama", "mixtral", "mistral"):
            raise ValueError(
                f"unsupported model_type {d.get('model_type')!r} in config.json (llama, mistral or mixtral)"
            )
        rope = dict(d.get("rope_parameters") or {})
        scaling = d.get("rope_scaling") or (
            rope if rope.get("rope_type", rope.get("type")) == "llama3" else None
        )
        theta = d.get("rope_theta", rope.get("rope_theta", 10_000.0))
        rs = None
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "llama3":
                rs = RopeScaling(
                    factor=float(scaling["factor"]),
                    low_freq_factor=float(scaling["low_freq_factor"]),
                    high_freq_factor=float(scaling["high_freq_factor"]),
                    original_max_position_embeddings=int(
                        scaling["original_max_position_embeddings"]
                    ),
                )
            elif kind not in (None, "default"):
                raise ValueError(f"unsupported rope_scaling type {kind!r} (only 'llama3')")
        eos = d.get("eos_token_id")
        eos_ids = (
            tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        )
        n_heads = int(d["num_attention_heads"])
        return cls(
            name=name or d.get("_name_or_path") or arch,
            vocab_size=int(d["vocab_size"]),
            d_model=int(d["hidden_size"]),
            n_layers=int(d["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(d.get("num_key_value_heads") or n_heads),
            ffn_dim=int(d["intermediate_size"]),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // n_heads),
            max_seq_len=int(d.get("max_position_embeddings", 8192)),
            rope_theta=float(theta),
            rope_scaling=rs,
            norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            tie_embeddings=bool(d.get("tie_word_embeddings", False)),
            n_experts=int(d.get("num_local_experts", 0) or 0),
            n_experts_per_token=int(d.get("num_experts_per_tok", 0) or 0),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        return cls.from_hf_dict(json.loads(Path(path).read_text()), name=Path(path).parent.name)


_L3_SCALING_8B = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
_L3_SCALING_1B = RopeScaling(
    factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)

# Published shapes (the models' own config.json files on the Hugging Face hub).
PRESETS: dict[str, ModelConfig] = {
    "llama-3-70b": ModelConfig(
        name="llama-3-70b",
        vocab_size=128_256,
        d_model=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim=28_672,
        max_seq_len=8192,
        rope_theta=500_000.0,
        norm_eps=1e-5,
        bos_token_id=128_000,
        eos_token_ids=(128_001, 128_009),
    ),
    # Llama 3.1 70B: the same shape as Llama 3 70B, with a 128K context through rope scaling.
    "llama-3.1-70b": ModelConfig(
        name="llama-3.1-70b",
        vocab_size=128_256,
        d_model=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim=28_672,
        max_seq_len=131_072,
        rope_theta=500_000.0,
        rope_scaling=_L3_SCALING_8B,
        norm_eps=1e-5,
        bos_token_id=128_000,
        eos_token_ids=(128_001, 128_008, 128_009),
    ),
    "llama-3.1-8b": ModelConfig(
        name="llama-3.1-8b",
        vocab_size=128_256,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14_336,
        max_seq_len=131_072,
        rope_theta=500_000.0,
        rope_scaling=_L3_SCALING_8B,
        norm_eps=1e-5,
        bos_token_id=128_000,
        eos_token_ids=(128_001, 128_008, 128_009),
    ),
    "llama-3.2-1b": ModelConfig(
        name="llama-3.2-1b",
        vocab_size=128_256,
        d_model=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=8192,
        head_dim=64,
        max_seq_len=131_072,
        rope_theta=500_000.0,
        rope_scaling=_L3_SCALING_1B,
        norm_eps=1e-5,
        tie_embeddings=True,
        bos_token_id=128_000,
        eos_token_ids=(128_001, 128_008, 128_009),
    ),
    "smollm2-135m": ModelConfig(
        name="smollm2-135m",
        vocab_size=49_152,
        d_model=576,
        n_layers=30,
        n_heads=9,
        n_kv_heads=3,
        ffn_dim=1536,
        head_dim=64,
        max_seq_len=8192,
        rope_theta=100_000.0,
        norm_eps=1e-5,
        tie_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
    "mixtral-8x7b": ModelConfig(
        name="mixtral-8x7b",
        vocab_size=32_000,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14_336,
        max_seq_len=32_768,
        rope_theta=1_000_000.0,
        norm_eps=1e-5,
        n_experts=8,
        n_experts_per_token=2,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
}


def get_config(name_or_config: str | ModelConfig) -> ModelConfig:
    """A preset by name (``llama-3-70b``, ``smollm2-135m``, ...) or a config passed through."""
    if isinstance(name_or_config, ModelConfig):
        return name_or_config
    key = str(name_or_config).lower()
    if key not in PRESETS:
        raise KeyError(
            f"unknown model preset {name_or_config!r}; known: {', '.join(sorted(PRESETS))}"
        )
    return PRESETS[key]
