"""The model: embed, a stack of blocks, a final norm, the LM head.

``Transformer(cfg)(ids)`` maps token ids ``[B, T]`` to logits ``[B, T, vocab]``. Its state-dict
names are the contract every loader produces (:func:`llmlib.shapes.param_shapes`), with Q and K in the
Hugging Face "split-half" RoPE layout. The KV cache plugs in through the ``cache`` argument: each
attention layer calls ``cache.update(layer, k_new, v_new, positions)`` and attends over what comes
back (the contract is :class:`llmlib.attention.KVCacheLike`). Without a cache the forward pass is
plain causal.
"""

from __future__ import annotations

import torch
from torch import nn

from llmlib.attention import ATTENTION_BACKENDS, AttendingCache, KVCacheLike
from llmlib.block import Block, RMSNorm
from llmlib.config import ModelConfig
from llmlib.device import choose
from llmlib.embedding import TokenEmbedding, unembed
from llmlib.rope import RotaryTables


class Transformer(nn.Module):
    """A Llama-family decoder (dense SwiGLU or Mixtral-style experts), tied or untied LM head."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str | None = None):
        """``device="meta"`` builds the shapes without memory or random init (the loaders do this,
        then hand in the checkpoint's tensors)."""
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"Transformer expects a ModelConfig, got {type(cfg).__name__}")
        self.config = cfg
        self.embed = TokenEmbedding(cfg.vocab_size, cfg.d_model, device)
        # cos/sin for every position, computed once (on CPU)
        self.rope = RotaryTables.from_config(cfg)
        if device is not None and torch.device(device).type != "meta":
            self.rope.to(device)
        self.layers = nn.ModuleList(Block(cfg, i, device) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, device)
        self.lm_head = (
            None
            if cfg.tie_embeddings
            else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, device=device)
        )
        self.register_state_dict_post_hook(_contiguous_state)

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCacheLike | AttendingCache | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """ids [B, T] -> logits [B, T, vocab] (``[B, 1, vocab]`` with ``last_only``, which skips the
        LM head for all but the last position: a prefill only needs the next token's scores).

        ``positions`` [B, T] default to ``0..T-1`` in every row; with a KV cache the caller passes the
        absolute positions of the new tokens.
        """
        h = self.hidden(ids, positions, cache)
        return self.logits(h[:, -1:] if last_only else h)

    def hidden(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCacheLike | AttendingCache | None = None,
    ) -> torch.Tensor:
        """The residual stream after the last block, ``[B, T, d_model]``: everything but the head.

        A caller that needs only some positions' scores (the batching engine samples at the end of
        each packed sequence) picks those rows and hands them to :meth:`logits`.
        """
        if ids.dim() != 2:
            raise ValueError(f"ids must be [batch, seq_len], got shape {tuple(ids.shape)}")
        B, T = ids.shape
        if positions is None:
            positions = torch.arange(T, device=ids.device).expand(B, T)
        x = self.embed(ids)
        cos, sin = self.rope(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, positions, cache)
        return x

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden states ``[..., d_model]`` -> scores ``[..., vocab]``."""
        return unembed(self.norm(h), self.lm_head_weight)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def set_attention_backend(self, name: str) -> Transformer:
        """Switch every layer to ``"sdpa"`` (default), ``"naive"`` or ``"tiled"`` attention."""
        if name not in ATTENTION_BACKENDS:
            raise ValueError(
                f"unknown attention backend {name!r}; one of {sorted(ATTENTION_BACKENDS)}"
            )
        for layer in self.layers:
            layer.attn.backend = name
        return self

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype


def _contiguous_state(
    module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict
) -> None:
    # On the CPU the loader re-stores the weight matrices for faster decoding: some column-major,
    # all inside one shared buffer (llmlib.linear.use_matvec_layout); and the fused q/k/v and
    # gate/up matrices are split on the way out, as views. Hand out contiguous tensors that own
    # their memory instead, so a state dict saves with safetensors as it is (which refuses both
    # non-contiguous and memory-sharing tensors). keep_vars=True still gets the Parameters.
    for key, t in state_dict.items():
        if not isinstance(t, torch.Tensor) or isinstance(t, nn.Parameter):
            continue
        owns = (
            t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        )
        if not (t.is_contiguous() and owns):
            state_dict[key] = t.contiguous() if not t.is_contiguous() else t.clone()


def random_model(
    cfg: ModelConfig,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    std: float = 0.02,
) -> Transformer:
    """A model of ``cfg``'s shape with random weights, built directly on ``device`` in ``dtype``.

    For benchmarks: speed does not depend on what the weights are, and building on a meta device
    first skips a slow CPU initialisation of tensors that would be overwritten anyway.
    """
    place = choose(device, dtype)
    device, dtype = place.device, place.dtype
    model = Transformer(cfg, device="meta").to(dtype=dtype).to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=g)
    model.rope.reset(device)
    return model.eval()
