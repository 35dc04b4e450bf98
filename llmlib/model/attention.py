"""Attention: every token mixes in the values of the earlier tokens whose keys match its query.

Three implementations of the same function, all taking ``q [B, H, T, hd]`` and ``k, v [B, Hkv, S, hd]``
(grouped-query attention: ``H`` query heads share ``Hkv`` key/value heads, any ratio ``H / Hkv``):

* :func:`naive_attention` — the textbook formula, building the full ``T x S`` score grid with an
  explicit causal mask. The reference the others are checked against, and the one that can hand
  back the attention probabilities for plotting.
* :func:`sdpa_attention` — PyTorch's fused ``F.scaled_dot_product_attention``; the production path.
* :func:`tiled_attention` — the FlashAttention idea (Dao et al.) written in plain PyTorch: walk the
  keys in tiles, keep a running maximum and a running softmax denominator per query ("online
  softmax"), and never hold more than one ``block_q x block_k`` tile of scores at a time.

Masks: ``mask=None`` means causal, aligned to the end (query ``i`` of ``T`` sits at position
``S - T + i`` among the ``S`` keys), and with ``window=W`` also *sliding*: each query sees only the
``W`` latest keys up to itself (Mistral, Gemma's local layers). Otherwise ``mask`` is a bool tensor
broadcastable to ``[B, 1, T, S]``, True where a query may attend, and is used as given: a cache that
hands back a mask has already applied any window. Two more options some families set: ``scale``
(the score scale, default ``1 / sqrt(head_dim)``) and ``softcap`` (scores squashed to
``cap * tanh(score / cap)`` before the softmax, Gemma 2).

:class:`AttentionSpec` is how one layer attends: which of the three functions, and the options its
family sets (scale, soft cap, sliding window), in one small frozen record. :class:`Attention` is the
layer: one fused projection to q, k, v; RoPE on q and k; attention, through the KV cache when there
is one (``cache.attend``, the contract :class:`KVCacheLike`); the output projection ``wo``. It is
one module, a little over the usual size, because chapter 5 builds it as one: the functions, the
contract a cache implements and the layer that calls both.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from llmlib.config import ModelConfig
from llmlib.model.norm import RMSNorm
from llmlib.model.rope import apply_rope

# ---- the three attention functions ---------------------------------------------------------


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Expand ``[B, Hkv, S, hd]`` to ``[B, Hkv * n_rep, S, hd]``: each KV head serves ``n_rep`` query heads."""
    if n_rep == 1:
        return x
    return x.repeat_interleave(n_rep, dim=1)


def causal_mask(
    T: int, S: int, device: torch.device | str | None = None, window: int | None = None
) -> torch.Tensor:
    """``[T, S]`` bool, True where query ``i`` (at position ``S - T + i``) may see key ``j``: ``j <= S - T + i``
    and, with a sliding ``window``, ``j > S - T + i - window`` (the query itself and ``window - 1`` before)."""
    ones = torch.ones(T, S, dtype=torch.bool, device=device)
    allowed = ones.tril(diagonal=S - T)
    return allowed if window is None else allowed & ones.triu(diagonal=S - T - window + 1)


def soft_cap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(scores / cap)``: close to the identity for small scores, never beyond ``cap``."""
    return torch.tanh(scores / cap) * cap


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(
            f"expected q [B,H,T,hd] and k, v [B,Hkv,S,hd]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"{q.shape[1]} query heads is not a multiple of {k.shape[1]} key/value heads"
        )
    return q.shape[1] // k.shape[1]


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    return_probs: bool = False,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(hd) + mask) v, with the whole ``[B, H, T, S]`` grid in memory.

    ``scale`` defaults to ``1 / sqrt(head_dim)``; the book passes ``scale=1.0`` to show what goes
    wrong without it. With ``return_probs`` also returns the attention probabilities.
    """
    n_rep = _check_shapes(q, k, v)
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    T, S = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # [B, H, T, S]: the grid the other two avoid
    if softcap is not None:
        scores = soft_cap(scores, softcap)
    allowed = causal_mask(T, S, q.device, window) if mask is None else mask
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = probs @ v
    return (out, probs) if return_probs else out


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The production path: PyTorch's fused kernel, GQA handled inside it (no copies of k and v).

    The fused kernel cannot soft-cap scores; with ``softcap`` this is :func:`naive_attention`.
    """
    if softcap is not None:
        return naive_attention(q, k, v, mask, scale, window=window, softcap=softcap)
    T, S = q.shape[-2], k.shape[-2]
    gqa = q.shape[1] != k.shape[1]
    if mask is None:
        if window is not None and window < S:  # some key lies beyond some query's reach
            mask = causal_mask(T, S, q.device, window)
        elif T == S or T == 1:  # square causal grid; or one query that may see every key
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=T > 1, enable_gqa=gqa, scale=scale
            )
        else:  # SDPA's is_causal aligns to the top-left; we need bottom-right
            mask = causal_mask(T, S, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=scale)


def tiled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    block_q: int = 64,
    block_k: int = 64,
    *,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Flash-style attention in PyTorch: exact softmax attention without the ``T x S`` grid.

    For each tile of queries, keys and values stream past in tiles. Per query we keep the largest
    score seen so far ``m``, the softmax denominator ``l`` relative to ``m``, and the unnormalised
    output ``acc``. When a new tile raises the maximum, the old ``l`` and ``acc`` are rescaled by
    ``exp(m_old - m_new)``, which makes the result identical to a softmax over all keys at once.
    Peak extra memory is one ``block_q x block_k`` score tile per head instead of ``T x S``.
    Causal tiles that lie entirely above the diagonal are skipped, not computed and masked; with a
    sliding ``window`` so are the tiles entirely before it, so the work per query is bounded by
    the window instead of growing with the sequence.
    """
    n_rep = _check_shapes(q, k, v)
    B, H, T, hd = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    if mask is not None or (window is not None and window >= S):
        window = None  # a given mask already says it all; a window longer than S changes nothing
    # Group the query heads by the KV head they share: [B, Hkv, n_rep, T, hd]; k/v broadcast over n_rep.
    qg = q.view(B, Hkv, n_rep, T, hd)
    kg, vg = k.unsqueeze(2), v.unsqueeze(2)
    if mask is not None:
        mask = mask.expand(B, 1, T, S).unsqueeze(2)  # [B, 1, 1, T, S], a view: no copy
    offset = S - T  # causal alignment: query i sits at key position offset + i
    out = torch.empty_like(qg)
    for q0 in range(0, T, block_q):
        q1 = min(q0 + block_q, T)
        qt = qg[..., q0:q1, :] * scale
        m = torch.full((*qt.shape[:-1], 1), float("-inf"), dtype=torch.float32, device=q.device)
        l = torch.zeros_like(m)  # noqa: E741 - the FlashAttention paper's name for the denominator
        acc = torch.zeros(qt.shape, dtype=torch.float32, device=q.device)
        # keys past the last query's position never count
        k_end = S if mask is not None else min(S, offset + q1)
        # keys before the window of the tile's first query never count either
        k_start = 0 if window is None else max(0, offset + q0 - window + 1)
        for k0 in range(k_start, k_end, block_k):
            k1 = min(k0 + block_k, k_end)
            s = (qt @ kg[..., k0:k1, :].transpose(-2, -1)).float()  # one [bq, bk] tile per head
            if softcap is not None:
                s = soft_cap(s, softcap)
            if mask is not None:
                s = s.masked_fill(~mask[..., q0:q1, k0:k1], float("-inf"))
            elif k1 > offset + q0 or (window is not None and k0 <= offset + q1 - 1 - window):
                # this tile crosses the diagonal, or the window's far edge
                qpos = torch.arange(q0, q1, device=q.device)[:, None] + offset
                kpos = torch.arange(k0, k1, device=q.device)[None, :]
                hidden = kpos > qpos
                if window is not None:
                    hidden |= kpos <= qpos - window
                s = s.masked_fill(hidden, float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            # rows with nothing visible yet
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - m_safe)
            correction = torch.exp(m - m_safe)
            l = l * correction + p.sum(dim=-1, keepdim=True)  # noqa: E741
            acc = acc * correction + p.to(v.dtype) @ vg[..., k0:k1, :]
            m = m_new
        out[..., q0:q1, :] = (acc / l).to(q.dtype)
    return out.view(B, H, T, hd)


ATTENTION_BACKENDS: dict[str, Callable[..., torch.Tensor]] = {
    "sdpa": sdpa_attention,
    "naive": naive_attention,
    "tiled": tiled_attention,
}


@dataclass(frozen=True)
class AttentionSpec:
    """How one layer attends: the function (``backend``) and the options its family sets.

    ``scale`` (default ``1 / sqrt(head_dim)``), ``softcap`` (Gemma 2) and ``window`` (the keys a
    query sees, itself included: Mistral, Gemma's local layers) are None where the family does not
    set them. Calling the spec runs the function: ``spec(q, k, v, mask)``. A cache or a kernel
    reads the fields it needs (a kernel serves ``backend == "sdpa"``), so nothing ever unwraps a
    function to find out what it was asked to do.
    """

    backend: str = "sdpa"
    scale: float | None = None
    softcap: float | None = None
    window: int | None = None

    def __post_init__(self) -> None:
        if self.backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"unknown attention backend {self.backend!r}; one of {sorted(ATTENTION_BACKENDS)}"
            )

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        fn = ATTENTION_BACKENDS[self.backend]
        return fn(q, k, v, mask, scale=self.scale, window=self.window, softcap=self.softcap)

    def using(self, backend: str) -> AttentionSpec:
        """The same options with another function."""
        return replace(self, backend=backend)


# ---- the contract between the layer and a KV cache ------------------------------------------


class KVCacheLike(Protocol):
    """What an attention layer asks of a KV cache (the static one, the paged one, a test double).

    ``attend`` stores the new keys and values ``[B, Hkv, T, hd]`` of ``layer`` (RoPE already
    applied to the keys) at ``positions`` ``[B, T]`` and returns attention of the new queries
    ``q [B, H, T, hd]`` over every key the cache holds for them, computed as ``spec`` says:
    ``[B, H, T, hd]``.

    A cache that subclasses this contract only has to store: ``update`` writes the new keys and
    values and hands back every key and value the new queries may see, ``[B, Hkv, S, hd]``, with
    a bool mask broadcastable to ``[B, 1, T, S]`` (True = may attend; None: plain causal over
    ``S == T`` keys), and the default ``attend`` runs ``spec`` over them. A cache that knows more
    attends itself: the batching engine's paged step goes sequence by sequence, and on a CPU a
    cache may run a kernel that reads its keys where they lie, whenever ``spec`` is one the
    kernel computes.

    A sliding-window layer (``spec.window = W``) calls ``update(..., window=W)``: the mask must
    then also hide keys ``W`` or more positions behind each query. A cache without ``window``
    fails loudly on such a model instead of attending too far.
    """

    def update(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor | None = None,
        *,
        window: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: AttentionSpec,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        win = {} if spec.window is None else {"window": spec.window}
        k_all, v_all, mask = self.update(layer, k, v, positions, **win)
        return spec(q, k_all, v_all, mask)


# ---- fused projections that still load and save under the contract's names ------------------


def register_fused_linear(module: nn.Module, fused: str, parts: list[tuple[str, int]]) -> None:
    """Let ``module.<fused>.weight`` (one matmul) appear in state dicts as separate ``<part>.weight``.

    Multiplying by one stacked matrix is one kernel launch instead of two or three, which matters
    for decoding a small model on a CPU where per-call overhead is a real share of a token's time.
    On load, the separate tensors (the names every checkpoint and ``llmlib.model`` documents) are
    concatenated; on save, the fused tensor is split back. ``parts`` is ``[(name, n_rows), ...]``.
    Biases (``<part>.bias``, Qwen2's q, k, v) are fused and split the same way.
    """
    names = [n for n, _ in parts]
    sizes = [r for _, r in parts]

    def on_load(mod, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        for kind in ("weight", "bias"):
            keys = [f"{prefix}{n}.{kind}" for n in names]
            if all(key in state_dict for key in keys):
                for key, rows in zip(keys, sizes):
                    if (shape := tuple(state_dict[key].shape))[0] != rows:
                        raise ValueError(f"tensor {key} has shape {shape}, expected {rows} rows")
                state_dict[f"{prefix}{fused}.{kind}"] = torch.cat(
                    [state_dict.pop(key) for key in keys], dim=0
                )

    def on_save(mod, state_dict, prefix, local_metadata):
        for kind in ("weight", "bias"):
            key = f"{prefix}{fused}.{kind}"
            if key in state_dict:
                for n, w in zip(names, state_dict.pop(key).split(sizes, dim=0)):
                    state_dict[f"{prefix}{n}.{kind}"] = w

    module.register_load_state_dict_pre_hook(on_load)
    module.register_state_dict_post_hook(on_save)


# ---- the layer ----------------------------------------------------------------------------


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE and a pluggable KV cache.

    State-dict names: ``wq``, ``wk``, ``wv``, ``wo`` (``.weight``, and ``.bias`` where the family
    has them), ``q_norm``/``k_norm`` (per-head RMSNorm gains, Qwen3 and Gemma 3). Internally q, k
    and v come out of one fused matrix ``wqkv`` (see :func:`register_fused_linear`). How the layer
    attends (function, scale, soft cap, sliding window) is its :attr:`spec`.

    With a ``cache`` (:class:`KVCacheLike`), the layer hands the cache its new q, k and v and
    gets attention back: a static cache, a paged cache or a test double all plug in here, and
    the layer never knows which.
    """

    def __init__(
        self, cfg: ModelConfig, layer_idx: int = 0, device: torch.device | str | None = None
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q_rows, kv_rows = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.wqkv = nn.Linear(cfg.d_model, q_rows + 2 * kv_rows, bias=cfg.qkv_bias, device=device)
        self.wo = nn.Linear(q_rows, cfg.d_model, bias=cfg.out_bias, device=device)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:  # one gain per channel of a head, shared by every head
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, device, cfg.norm_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, device, cfg.norm_offset)
        self.spec = AttentionSpec(
            scale=cfg.attn_scale, softcap=cfg.attn_softcap, window=cfg.window(layer_idx)
        )
        register_fused_linear(self, "wqkv", [("wq", q_rows), ("wk", kv_rows), ("wv", kv_rows)])

    @property
    def window(self) -> int | None:
        """The keys a query sees, itself included (None: every earlier one)."""
        return self.spec.window

    def project_qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """x [B, T, D] -> q [B, H, T, hd], k and v [B, Hkv, T, hd], with RoPE applied to q and k.

        ``cos``/``sin`` are [B, 1, T, hd] as :class:`llmlib.model.rope.RotaryTables` gathers them.
        """
        B, T, _ = x.shape
        H, Hkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        # One matmul gives every head's q, k and v side by side: [B, T, H + 2 Hkv, hd]. RoPE then runs
        # once over the q and k heads together (the same rotation for every head of a token), so a
        # decode step pays for one set of elementwise ops instead of two; the transposes are views.
        qkv = self.wqkv(x).view(B, T, H + 2 * Hkv, hd)
        qk = qkv[:, :, : H + Hkv]
        if self.q_norm is not None:  # Qwen3, Gemma 3: each head's q and k normalised first
            qk = torch.cat([self.q_norm(qk[:, :, :H]), self.k_norm(qk[:, :, H:])], dim=2)
        qk = apply_rope(qk, cos.transpose(1, 2), sin.transpose(1, 2))
        q = qk[:, :, :H].transpose(1, 2)
        k = qk[:, :, H:].transpose(1, 2)
        v = qkv[:, :, H + Hkv :].transpose(1, 2)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCacheLike | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.project_qkv(x, cos, sin)
        if cache is None:  # plain causal attention over these T tokens (within the window)
            out = self.spec(q, k, v)
        else:
            out = cache.attend(self.layer_idx, q, k, v, self.spec, positions)
        return self.wo(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


# ---- looking inside: attention probabilities of a real model ----------------------------------


@torch.no_grad()
def attention_maps(
    model: nn.Module, ids: torch.Tensor, layers: list[int] | None = None
) -> dict[int, torch.Tensor]:
    """Attention probabilities ``[B, H, T, T]`` of the chosen layers for a cache-free forward pass.

    The production path (SDPA) never exposes its probabilities, so a forward pre-hook catches each
    chosen layer's input, recomputes its q and k with the layer's own weights, and asks
    :func:`naive_attention` for the grid. The model's outputs are unchanged.
    """
    layers = list(range(len(model.layers))) if layers is None else layers
    maps: dict[int, torch.Tensor] = {}

    def hook_for(i: int):
        def hook(attn: Attention, args: tuple) -> None:
            x, cos, sin = args[:3]
            q, k, v = attn.project_qkv(x, cos, sin)
            s = attn.spec
            maps[i] = naive_attention(
                q.float(),
                k.float(),
                v.float(),
                return_probs=True,
                scale=s.scale,
                window=s.window,
                softcap=s.softcap,
            )[1]

        return hook

    handles = [model.layers[i].attn.register_forward_pre_hook(hook_for(i)) for i in layers]
    try:
        model(ids)
    finally:
        for h in handles:
            h.remove()
    return maps
