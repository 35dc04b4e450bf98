"""The fixed-shape decode step of one request (or a static batch): its cache and its graphs.

A step that a CUDA graph replays, or that ``torch.compile`` traces once for good, must touch
memory at fixed addresses with fixed shapes, whatever the request's length so far. That takes a
cache preallocated at its full size and written in place at the positions, so that no Python-side
length decides a shape: :class:`StaticKVCache`. Every step attends over all its slots under a
mask built from the positions tensor (or, on a CPU, through :mod:`llmlib.kernels.paged_attention`
over the slots written so far).

:class:`GraphedDecoder` is the decode step over it, replayed from CUDA graphs on a GPU
(:class:`llmlib.runtime.graphs.StepGraphs`, the same machinery the batching engine uses) and
called plainly elsewhere; :func:`compile_step` is the other route,
``torch.compile(mode="reduce-overhead")``, which captures graphs behind the compiler's back; and
:func:`greedy_decode` is the benchmarks' tight loop over them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from llmlib.config import ModelConfig
from llmlib.kernels.paged_attention import decode_attention, serves_pool, serves_spec
from llmlib.model.attention import AttentionSpec
from llmlib.runtime.graphs import StepGraphs


class StaticKVCache:
    """A preallocated KV cache that a CUDA graph can capture: fixed addresses, no host syncs.

    ``k`` and ``v`` are lists, one ``[max_batch, kv_heads, max_len, head_dim]`` tensor per layer
    (``torch.compile``'d CPU decoding uses it too). ``update`` writes the new keys and values at
    their positions (``index_copy_`` for one sequence, ``scatter_`` for several) and returns the whole row of
    slots with a mask that lets each query see the slots at or before its own position, so an
    unwritten slot is never attended to. It implements the model's cache contract,
    ``cache.update(layer, k, v, positions) -> (k_all, v_all, mask)``.

    It attends itself (:class:`llmlib.model.attention.KVCacheLike`): a one-token step on a CPU
    where :mod:`llmlib.kernels.paged_attention` serves runs that kernel over each sequence's written
    slots only (``kernel=False`` or any other step: the layer's attention under the mask). Each
    KV head's slots ``[max_len, head_dim]`` are one contiguous run, so the cache reads to the
    kernel as a pool of ``max_batch * kv_heads`` blocks of ``max_len`` tokens, one block per
    (sequence, KV head), with that head's query heads as its queries.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        max_batch: int,
        max_len: int,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        kernel: bool | None = None,
    ):
        if max_batch < 1 or max_len < 1:
            raise ValueError(
                f"StaticKVCache: max_batch ({max_batch}) and max_len ({max_len}) must be >= 1"
            )
        # one tensor per layer, not one [layers, ...] block: a compiled step then writes each
        # layer's new slots in place, where a write into a view of one big block is traced as a
        # copy of the whole block back into it (every layer's K and V, every step)
        shape = (max_batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.max_batch, self.max_len = max_batch, max_len
        self.device = torch.device(device)
        self._slots = torch.arange(max_len, device=device)
        #: one-token steps attend by llmlib.kernels.paged_attention (None: wherever it serves)
        self.kernel = serves_pool(self.k[0]) if kernel is None else bool(kernel)
        # block i of the kernel's pool: sequence i // kv_heads, KV head i % kv_heads
        self._table = torch.arange(max_batch * cfg.n_kv_heads, device=device).view(-1, 1)

    @classmethod
    def over(cls, k: list[torch.Tensor], v: list[torch.Tensor]) -> StaticKVCache:
        """A cache made of the given per-layer key and value tensors (a compiled step's inputs:
        :mod:`llmlib.runtime.aot`)."""
        cache = cls.__new__(cls)
        cache.k, cache.v = k, v
        cache.max_batch, _, cache.max_len, _ = k[0].shape
        cache.device = k[0].device
        cache._slots = torch.arange(cache.max_len, device=cache.device)
        cache.kernel = serves_pool(k[0])
        cache._table = torch.arange(cache.max_batch * k[0].shape[1], device=cache.device).view(
            -1, 1
        )
        return cache

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def update(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        *,
        window: int | None = None,
    ):
        k_all, v_all = self._write(layer, k, v, positions)
        slots, pos = self._slots[None, None, None, :], positions[:, None, :, None]
        mask = slots <= pos  # [B, 1, T, S]
        if window is not None:  # a sliding layer: only the latest `window` slots up to the query
            mask = mask & (slots > pos - window)
        return k_all, v_all, mask

    def _write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v [B, kv_heads, T, hd]`` at ``positions``; the first B rows of slots."""
        b, hkv, t, hd = k.shape
        k_all, v_all = self.k[layer], self.v[layer]
        if b < self.max_batch:  # views: writes land in the cache
            k_all, v_all = k_all[:b], v_all[:b]
        if b == 1:  # one sequence: its positions index the slots directly
            k_all.index_copy_(2, positions[0], k.to(k_all.dtype))
            v_all.index_copy_(2, positions[0], v.to(v_all.dtype))
        else:
            idx = positions[:, None, :, None].expand(b, hkv, t, hd)
            k_all.scatter_(2, idx, k.to(k_all.dtype))
            v_all.scatter_(2, idx, v.to(v_all.dtype))
        return k_all, v_all

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: AttentionSpec,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write the new keys and values, then attention for ``q [B, H, T, hd]`` -> ``[B, H, T, hd]``."""
        if positions is None:
            raise ValueError("StaticKVCache.attend needs the positions the keys are written at")
        if not (self.kernel and q.shape[2] == 1 and serves_spec(spec)):
            k_all, v_all, mask = self.update(layer, k, v, positions, window=spec.window)
            return spec(q, k_all, v_all, mask)
        k_all, v_all = self._write(layer, k, v, positions)
        b, hkv, n, hd = k_all.shape
        h = q.shape[1]
        # pool [b * hkv blocks, n slots, 1 head, hd]; each block sees its sequence's length
        lens = (positions[:, -1:] + 1).expand(b, hkv).contiguous().view(-1)
        out = decode_attention(
            q.reshape(b * hkv, h // hkv, hd),
            k_all.view(b * hkv, n, 1, hd),
            v_all.view(b * hkv, n, 1, hd),
            self._table[: b * hkv],
            lens,
            scale=spec.scale,
            softcap=spec.softcap,
            window=spec.window,
        )
        return out.view(b, h, 1, hd)


def _default_enabled(model: torch.nn.Module) -> bool:
    try:
        return next(model.parameters()).device.type == "cuda"
    except StopIteration:
        return False


class _DecodeInputs:
    """The fixed input buffers of one decode step of ``rows`` sequences."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(rows, 1, dtype=torch.long, device=device)


class GraphedDecoder:
    """One decode step, ``logits = dec(ids[B, 1], positions[B, 1])``, replayed from CUDA graphs
    (:class:`llmlib.runtime.graphs.StepGraphs`).

    ``batch_sizes`` are the sizes to capture (a batch of 3 runs in the graph for 4, its spare row
    fed token 0 at position 0 and thrown away). With ``enabled=False`` (the default off CUDA) it
    simply calls ``model(ids, positions, cache)``: the same results, without the launch savings.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cache: StaticKVCache,
        batch_sizes: Sequence[int] = (1, 2, 4, 8),
        enabled: bool | None = None,
        warmup: int = 3,
    ):
        self.model, self.cache = model, cache
        self.enabled = _default_enabled(model) if enabled is None else bool(enabled)
        self.batch_sizes = sorted({int(b) for b in batch_sizes})
        if (
            not self.batch_sizes
            or self.batch_sizes[0] < 1
            or self.batch_sizes[-1] > cache.max_batch
        ):
            raise ValueError(
                f"batch_sizes {list(batch_sizes)} must lie in 1..cache.max_batch ({cache.max_batch})"
            )
        self.steps = StepGraphs(
            lambda rows: _DecodeInputs(rows, cache.device),
            lambda s: self.model(s.ids, s.pos, self.cache),
            cache.device,
            self.enabled,
            warmup,
        )

    @property
    def graphs(self) -> dict[int, Any]:
        return {k: g for k, (_, g, _) in self.steps.entries.items() if g is not None}

    def capture(self) -> GraphedDecoder:
        """Record one graph per batch size (CUDA only; a no-op when disabled)."""
        if self.enabled:
            self.steps.capture(sorted(self.batch_sizes, reverse=True))
        return self

    def _size_for(self, b: int) -> int:
        for bs in self.batch_sizes:
            if bs >= b:
                return bs
        raise ValueError(
            f"batch of {b} is larger than the largest captured size {self.batch_sizes[-1]}"
        )

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 2 or ids.shape[1] != 1 or positions.shape != ids.shape:
            raise ValueError(
                f"decode step takes ids and positions of shape [B, 1]; got {tuple(ids.shape)} "
                f"and {tuple(positions.shape)}"
            )
        if not self.enabled or not self.graphs:
            return self.model(ids, positions, self.cache)
        b = ids.shape[0]

        def fill(s: _DecodeInputs) -> None:
            s.ids[:b].copy_(ids)
            s.pos[:b].copy_(positions)
            if s.ids.shape[0] > b:
                s.ids[b:].zero_()
                s.pos[b:].zero_()

        return self.steps.run(self._size_for(b), fill)[:b]


def compile_step(
    fn: Callable[..., Any], mode: str = "reduce-overhead", enabled: bool | None = None
) -> Callable[..., Any]:
    """``torch.compile`` a step function on CUDA (graphs captured by the compiler); identity on the CPU.

    Compiling on this book's CPU would cost minutes of compile time for a few percent, so the
    default is to pass ``fn`` through unchanged there.
    """
    if enabled is None:
        enabled = torch.cuda.is_available()
    return torch.compile(fn, mode=mode) if enabled else fn


@torch.inference_mode()
def greedy_decode(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    max_new_tokens: int,
    use_graphs: bool | None = None,
    batch_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Greedy generation of ``max_new_tokens`` for a batch of equal-length prompts ``[B, T]``.

    The tight loop of the batch-1 benchmarks: prefill once (eagerly), then one decode step per
    token, graph-replayed on CUDA. The next token never leaves the GPU inside the loop (no
    ``.item()``), so the CPU can run ahead of the GPU. Returns the new tokens ``[B, max_new_tokens]``.
    """
    if prompt.dim() != 2 or prompt.shape[1] < 1:
        raise ValueError(
            f"prompt must be a LongTensor [B, T] with T >= 1, got shape {tuple(prompt.shape)}"
        )
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    b, t = prompt.shape
    dev = prompt.device
    dtype = next(model.parameters()).dtype
    sizes = tuple(batch_sizes or (b,))
    cache = StaticKVCache(model.config, max(b, *sizes), t + max_new_tokens, device=dev, dtype=dtype)
    dec = GraphedDecoder(model, cache, sizes, enabled=use_graphs)
    dec.capture()  # before the prefill: the warm-up writes slot 0, which the prefill then overwrites
    positions = torch.arange(t, device=dev).expand(b, t)
    logits = model(prompt, positions, cache)
    nxt = logits[:, -1].argmax(-1, keepdim=True)
    out = torch.empty(b, max_new_tokens, dtype=torch.long, device=dev)
    out[:, :1] = nxt
    pos = torch.full((b, 1), t, dtype=torch.long, device=dev)
    for i in range(1, max_new_tokens):
        logits = dec(nxt, pos)
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        out[:, i : i + 1] = nxt
        pos += 1
    return out
