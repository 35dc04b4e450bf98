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

from llmlib.families import FULL, SLIDING, hf_config_fields


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling for long contexts.

    ``rope_type="llama3"``: Llama-3's recipe (slow pairs stretched by ``factor``, fast pairs kept,
    a blend between; all four numbers matter). ``rope_type="linear"``: every frequency divided by
    ``factor`` (Gemma 3's global layers); the other three numbers are unused.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"


#: Activations of the gated FFN: SwiGLU's SiLU, and GeGLU's tanh-approximated GELU (Gemma).
ACTIVATIONS = ("silu", "gelu_tanh")


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
    # ---- what other families change; the defaults are Llama's (llmlib.families reads them) ----
    family: str = "llama"  # the config.json model_type this was read from
    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2)
    out_bias: bool = False  # a bias on the output projection too (attention_bias=true)
    qk_norm: bool = False  # RMSNorm over each head's queries and keys, before RoPE (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # RMSNorm multiplies by (offset + weight): 1.0 in Gemma
    post_norms: bool = False  # a second RMSNorm on each sub-layer's output (Gemma 2 and 3)
    activation: str = "silu"  # the FFN gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)
    scale_embeddings: bool = False  # embedding rows times sqrt(d_model) (Gemma)
    attn_scale: float | None = None  # score scale; None: 1/sqrt(head_dim) (Gemma: from the config)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # the same on the logits (Gemma 2)
    sliding_window: int | None = None  # keys a query may see in a sliding layer, itself included
    layer_types: tuple[str, ...] = ()  # per layer FULL or SLIDING; () = all alike (see window)
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (Gemma 3)
    expert_ffn_dim: int = 0  # width of each expert; 0: ffn_dim (Mixtral); Qwen3-MoE sets it
    norm_topk_prob: bool = True  # renormalise the top-k router weights to sum to one
    dense_layers: tuple[int, ...] = ()  # layers of a MoE model with a dense FFN (Qwen3-MoE)

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
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.layer_types:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.n_layers:
                raise ValueError(
                    f"layer_types lists {len(self.layer_types)} layers, the model has {self.n_layers}"
                )
            bad = sorted(set(self.layer_types) - {FULL, SLIDING})
            if bad:
                raise ValueError(f"unsupported layer type {bad[0]!r} (only {FULL!r}, {SLIDING!r})")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(
                f"sliding_window must be a positive integer, got {self.sliding_window}"
            )
        if SLIDING in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types has sliding layers but sliding_window is not set")
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers))
        if any(not 0 <= i < self.n_layers for i in self.dense_layers):
            raise ValueError(f"dense_layers {self.dense_layers} lie outside 0..{self.n_layers - 1}")

    @property
    def gqa_group(self) -> int:
        """How many query heads share one key/value head."""
        return self.n_heads // self.n_kv_heads

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: it attends over the whole past).

        With ``layer_types`` empty, every layer is alike: all sliding if ``sliding_window`` is set
        (Mistral), else all full (Llama).
        """
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[layer] != SLIDING:
            return None
        return self.sliding_window

    def local_rope(self, layer: int) -> bool:
        """Whether ``layer`` rotates with the local RoPE base (Gemma 3's sliding layers)."""
        return self.rope_local_theta is not None and self.window(layer) is not None

    def is_moe(self, layer: int) -> bool:
        """Whether ``layer``'s FFN is a mixture of experts."""
        return bool(self.n_experts) and layer not in self.dense_layers

    @property
    def expert_dim(self) -> int:
        """Hidden width of one expert (Mixtral: ``ffn_dim``; Qwen3-MoE: its own, narrower)."""
        return self.expert_ffn_dim or self.ffn_dim

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ---- Hugging Face config.json ---------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str | None = None) -> ModelConfig:
        """Read a Hugging Face ``config.json`` of any family in :data:`llmlib.families.FAMILIES`.

        The family's own reader (:func:`llmlib.families.hf_config_fields`) maps its fields onto
        this dataclass; anything it does not implement is a ``ValueError`` naming the field.
        """
        fields = hf_config_fields(d)
        rs = fields.pop("rope_scaling")
        return cls(
            name=name or d.get("_name_or_path") or fields["family"],
            rope_scaling=None if rs is None else RopeScaling(**rs),
            **fields,
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
