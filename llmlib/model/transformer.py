"""The model: embed, a stack of blocks, a final norm, the LM head.

``Transformer(cfg)(ids)`` maps token ids ``[B, T]`` to logits ``[B, T, vocab]``. Its state-dict
names are the contract every loader produces (:func:`llmlib.shapes.param_shapes`), with Q and K in the
Hugging Face "split-half" RoPE layout. The KV cache plugs in through the ``cache`` argument: each
attention layer calls ``cache.attend(layer, q, k, v, spec, positions)`` (the contract is
:class:`llmlib.model.attention.KVCacheLike`). Without a cache the forward pass is plain causal.
"""

from __future__ import annotations

import torch
from torch import nn

from llmlib.config import ModelConfig
from llmlib.device import choose
from llmlib.model.attention import KVCacheLike
from llmlib.model.block import RMSNorm, make_block
from llmlib.model.embedding import TokenEmbedding
from llmlib.model.rope import RotaryTables


class Transformer(nn.Module):
    """A Llama-family decoder (dense SwiGLU or Mixtral-style experts), tied or untied LM head.

    The other families (:mod:`llmlib.families`) are switches on the same pieces: Gemma's scaled
    embeddings and soft-capped logits here, per-layer windows and RoPE bases (Gemma 3's local
    layers rotate with tables of their own, ``rope_local``), and what the blocks do differently.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device | str | None = None):
        """``device="meta"`` builds the shapes without memory or random init (the loaders do this,
        then hand in the checkpoint's tensors)."""
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"Transformer expects a ModelConfig, got {type(cfg).__name__}")
        self.config = cfg
        scale = cfg.d_model**0.5 if cfg.scale_embeddings else None
        self.embed = TokenEmbedding(cfg.vocab_size, cfg.d_model, device, scale)
        # cos/sin for every position, computed once (on CPU)
        self.rope = RotaryTables.from_config(cfg)
        local = [i for i in range(cfg.n_layers) if cfg.local_rope(i)]
        self.rope_local = RotaryTables.from_config(cfg, local=True) if local else None
        self._local_layers = frozenset(local)
        if device is not None and torch.device(device).type != "meta":
            self.reset_rotary(device)
        self.layers = nn.ModuleList(make_block(cfg, i, device) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, device, cfg.norm_offset)
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
        cache: KVCacheLike | None = None,
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
        cache: KVCacheLike | None = None,
        n_layers: int | None = None,
    ) -> torch.Tensor:
        """The residual stream after the last block, ``[B, T, d_model]``: everything but the head.

        A caller that needs only some positions' scores (the batching engine samples at the end of
        each packed sequence) picks those rows and hands them to :meth:`logits`. ``n_layers`` stops
        after the first blocks (speculative decoding's early-exit draft).
        """
        if ids.dim() != 2:
            raise ValueError(f"ids must be [batch, seq_len], got shape {tuple(ids.shape)}")
        B, T = ids.shape
        if positions is None:
            positions = torch.arange(T, device=ids.device).expand(B, T)
        x = self.embed(ids)
        cos, sin = self.rope(positions, x.dtype)
        layers = self.layers if n_layers is None else self.layers[:n_layers]
        if self.rope_local is None:
            for layer in layers:
                x = layer(x, cos, sin, positions, cache)
            return x
        local = self.rope_local(positions, x.dtype)
        for i, layer in enumerate(layers):
            c, s = local if i in self._local_layers else (cos, sin)
            x = layer(x, c, s, positions, cache)
        return x

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden states ``[..., d_model]`` -> scores ``[..., vocab]``
        (soft-capped to ``cap * tanh(logit / cap)`` where the family caps them, Gemma 2)."""
        h = self.norm(h)
        out = self.embed.unembed(h) if self.lm_head is None else self.lm_head(h)
        cap = self.config.final_softcap
        return out if cap is None else torch.tanh(out / cap) * cap

    def reset_rotary(self, device: torch.device | str | None = None) -> None:
        """Recompute every cos/sin table on ``device`` (after a build on the meta device)."""
        for tables in (self.rope, self.rope_local):
            if tables is not None:
                tables.reset(device)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def set_attention_backend(self, name: str) -> Transformer:
        """Switch every layer to ``"sdpa"`` (default), ``"naive"`` or ``"tiled"`` attention."""
        for layer in self.layers:
            layer.attn.spec = layer.attn.spec.using(name)
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
    # On the CPU the weight matrices may be re-stored for faster decoding (some column-major, all
    # inside one shared buffer: llmlib.kernels.prepare), and the fused q/k/v and gate/up matrices
    # are split on the way out, as views. Hand out contiguous tensors that own
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
                p.fill_(1.0 - cfg.norm_offset)  # a gain of one
            else:
                p.normal_(0.0, std, generator=g)
    model.reset_rotary(device)
    return model.eval()
