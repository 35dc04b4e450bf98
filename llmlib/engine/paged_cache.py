"""The paged KV cache: one pool of blocks per layer, read and written through block tables.

The pool of layer ``i`` is two tensors ``[num_blocks, block_size, kv_heads, head_dim]`` (keys and
values), token-major like vLLM's, block ``b`` of a block table holding positions from
``b * block_size``. On the CPU, gathering a row's blocks is then one ``index_select`` already
``[tokens, heads, head_dim]``, and attention's ``[heads, tokens, head_dim]`` a view of it:
head-major needed a second copy, a tenth of the engine's time.

The model never sees this: each pass gets a :class:`PagedStep` of its scheduled chunks, which
keeps the cache contract (:class:`llmlib.model.attention.KVCacheLike`) two ways:

* ``out = step.attend(layer, q, k, v, spec)``, what the model calls: a prefill chunk over its own
  keys (causal), decode chunks in batched calls (on a CPU one kernel reading each sequence's blocks
  in place, :mod:`llmlib.kernels.paged_attention`), so prefill and decode tokens share one row;
* ``k_all, v_all, mask = step.update(layer, k, v, positions)``, the contract's plain half: scatter
  the new keys and values, gather each row's blocks, and mask which query sees which key (its own
  sequence, at or before its position: block-diagonal when sequences share a row).

A sliding-window layer (Mistral, Gemma's local layers) has ``spec.window = W`` (``update``'s
``window``): masks and kernel hide keys ``W`` or more positions back; every block stays allocated.

``kv_cache_dtype="int8"`` holds each (token, head) row as codes and a scale
(:mod:`llmlib.engine.kv_rows`), rounded when written and read by the kernel as stored.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from llmlib.engine.kv_rows import (
    SCALE_BYTES,
    kv_bytes_per_value,
    quantize_rows,
    read_blocks,
)
from llmlib.kernels.paged_attention import decode_attention, serves_pool, serves_spec
from llmlib.model.attention import AttentionSpec
from llmlib.shapes import kv_cache_bytes


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed pool. On the CPU from ``calloc`` (NumPy's zeros): fresh pages that the system
    zeroes when first touched, so only the blocks written commit memory and a start does not
    wait for a gigabyte of writes (``torch.zeros`` writes every byte)."""
    if device.type != "cpu":
        return torch.zeros(shape, device=device, dtype=dtype)
    numel = 1
    for d in shape:
        numel *= d
    raw = np.zeros(numel * dtype.itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


class PagedKVCache:
    """The block pools of all layers (allocated once, at engine start). ``dtype`` is what
    attention computes in; ``kv_cache_dtype`` how the pool holds it (:data:`KV_CACHE_DTYPES`)."""

    def __init__(
        self,
        n_layers: int,
        num_blocks: int,
        n_kv_heads: int,
        block_size: int,
        head_dim: int,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        kv_cache_dtype: str = "auto",
    ) -> None:
        kv_bytes_per_value(kv_cache_dtype, dtype, head_dim)  # checks the name
        for name, v in (
            ("n_layers", n_layers),
            ("num_blocks", num_blocks),
            ("n_kv_heads", n_kv_heads),
            ("block_size", block_size),
            ("head_dim", head_dim),
        ):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"PagedKVCache: {name} must be a positive integer, got {v!r}")
        self.n_layers, self.num_blocks, self.block_size = n_layers, num_blocks, block_size
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        self.device, self.dtype = torch.device(device), dtype
        self.kv_cache_dtype = kv_cache_dtype
        coded = kv_cache_dtype == "int8"
        shape = (num_blocks, block_size, n_kv_heads, head_dim + (SCALE_BYTES if coded else 0))
        held = torch.int8 if coded else dtype
        self.k = [_zeros(shape, held, self.device) for _ in range(n_layers)]
        self.v = [_zeros(shape, held, self.device) for _ in range(n_layers)]
        self.kernel = serves_pool(self.k[0])  # decode by llmlib.kernels.paged_attention

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes over all layers, keys and values."""
        return int(
            kv_cache_bytes(
                self.n_layers,
                self.n_kv_heads,
                self.head_dim,
                self.block_size,
                kv_bytes_per_value(self.kv_cache_dtype, self.dtype, self.head_dim),
            )
        )

    @property
    def nbytes(self) -> int:
        return self.bytes_per_block * self.num_blocks

    def copy_blocks(self, pairs: Seq[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every layer (copy-on-write of a forked sequence)."""
        if not pairs:
            return
        src = torch.tensor([a for a, _ in pairs], device=self.device)
        dst = torch.tensor([b for _, b in pairs], device=self.device)
        for pool in (*self.k, *self.v):
            pool.index_copy_(0, dst, pool.index_select(0, src))

    def step(self, rows: Seq[Seq[SeqChunk]]) -> PagedStep:
        """The cache view for one forward pass: ``rows[b]`` lists the chunks in row ``b``."""
        return PagedStep(self, rows)


@dataclass
class SeqChunk:
    """Part of one sequence computed in this pass: tokens ``start .. start + length - 1`` (the
    first ``start`` are in the pool). ``block_table`` must cover ``start + length`` tokens."""

    block_table: Seq[int]
    start: int
    length: int
    num_prompt_tokens: int | None = None  # the compiled invariant groups route by it


class PrefillChunk(NamedTuple):
    """A multi-token chunk: queries at ``row``, columns ``col ..``, causal over ``end`` keys."""

    row: int
    col: int
    length: int
    blocks: torch.Tensor  # the block ids holding keys 0 .. end - 1, on the pool's device
    end: int


class DecodeToken(NamedTuple):
    """A single-token chunk as planned on the host: its query's place, position and blocks."""

    row: int
    col: int
    position: int
    blocks: list[int]


class DecodeGroup(NamedTuple):
    """Single-token chunks that share one batched attention call over ``n_blocks`` blocks each."""

    rows: torch.Tensor  # [n] row of each query
    cols: torch.Tensor  # [n] column of each query
    table: torch.Tensor  # [n * n_blocks] block ids, row-major; padding repeats a harmless block
    n_blocks: int
    mask: torch.Tensor  # [n, 1, 1, n_blocks * block_size]: key position <= the query's position
    lens: torch.Tensor | None = None  # [n] keys each query sees (position + 1), for the kernel


@dataclass
class StepLayout:
    """Where one pass's new tokens go in the pool and what each attends over: worked out on the
    host and moved to the device once per step; the layers only index with it. Built by
    :class:`PagedStep`; :class:`llmlib.engine.fixed_step.FixedStep` holds one at fixed addresses."""

    positions: torch.Tensor  # [B, T]
    write_slots: torch.Tensor  # [n] pool slot (block * block_size + offset) of every real new token
    write_index: torch.Tensor | None  # [n] its flat index in the [B * T] batch; None: no padding
    prefills: list[PrefillChunk]
    decodes: list[DecodeGroup]


def write_kv(
    cache: PagedKVCache, layout: StepLayout, layer: int, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Scatter the new keys/values ``[B, Hkv, T, hd]`` of ``layer`` into their pool slots."""
    B, H, T, D = k.shape
    # [B*T, Hkv, hd]; a view for the model's q/k/v split
    k_new = k.transpose(1, 2).reshape(B * T, H, D)
    v_new = v.transpose(1, 2).reshape(B * T, H, D)
    if layout.write_index is not None:  # drop padding columns
        k_new, v_new = k_new[layout.write_index], v_new[layout.write_index]
    kp, vp = cache.k[layer], cache.v[layer]
    if kp.dtype == torch.int8:  # rounded once, here
        k_new, v_new = quantize_rows(k_new), quantize_rows(v_new)
    flat = (-1, H, kp.shape[-1])
    kp.view(flat).index_copy_(0, layout.write_slots, k_new.to(kp.dtype))
    vp.view(flat).index_copy_(0, layout.write_slots, v_new.to(vp.dtype))


def paged_attend(
    cache: PagedKVCache,
    layout: StepLayout,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: AttentionSpec,
) -> torch.Tensor:
    """Write the new keys/values, then attend every query ``q [B, H, T, hd]`` over its own
    sequence's keys; returns ``[B, H, T, hd]`` (padding columns: zeros). ``spec(q, k, v, mask)``
    is the layer's attention (``mask=None``: causal, aligned to the end, within ``spec.window``)."""
    write_kv(cache, layout, layer, k, v)
    B, H, T, D = q.shape
    Hkv, bs = cache.n_kv_heads, cache.block_size
    kp, vp = cache.k[layer], cache.v[layer]
    out = q.new_zeros(B, T, H, D)  # token-major, so the caller's transpose back is a view
    for c in layout.prefills:
        kc = read_blocks(kp, c.blocks, q.dtype).view(-1, Hkv, D)[: c.end].permute(1, 0, 2)[None]
        vc = read_blocks(vp, c.blocks, q.dtype).view(-1, Hkv, D)[: c.end].permute(1, 0, 2)[None]
        o = spec(q[c.row : c.row + 1, :, c.col : c.col + c.length], kc, vc)  # [1, H, n, D]
        out[c.row, c.col : c.col + c.length] = o[0].transpose(0, 1)
    fast = cache.kernel and serves_spec(spec)
    window = spec.window
    for g in layout.decodes:
        n = g.rows.shape[0]  # (not len(): a symbolic size must stay one)
        if fast and g.lens is not None:  # straight out of the pool, one pass
            qd, table = q[g.rows, :, g.cols], g.table.view(n, -1)  # qd [n, H, D]; [n, blocks]
            o = decode_attention(
                qd, kp, vp, table, g.lens, scale=spec.scale, softcap=spec.softcap, window=window
            )
            out[g.rows, g.cols] = o
            continue
        # the query heads sharing a KV head ride as its "queries" [n, Hkv, H / Hkv, D] under one
        # mask: plain multi-head attention, which no backend has to expand for GQA
        qd = q[g.rows, :, g.cols].view(n, Hkv, H // Hkv, D)
        kd = read_blocks(kp, g.table, q.dtype).view(n, g.n_blocks * bs, Hkv, D).transpose(1, 2)
        vd = read_blocks(vp, g.table, q.dtype).view(n, g.n_blocks * bs, Hkv, D).transpose(1, 2)
        mask = g.mask
        if window is not None:  # keys at or before the query, and within its window
            q_pos = layout.positions[g.rows, g.cols].view(n, 1, 1, 1)
            k_pos = torch.arange(g.n_blocks * bs, device=q.device)
            mask = mask & (k_pos > q_pos - window)
        out[g.rows, g.cols] = spec(qd, kd, vd, mask).reshape(n, H, D)
    return out.transpose(1, 2)


class PagedStep:
    """One pass's cache over the paged pool (a :class:`~llmlib.model.attention.KVCacheLike`),
    planned on the host when built (a few hundred integers) into a :class:`StepLayout`."""

    def __init__(self, cache: PagedKVCache, rows: Seq[Seq[SeqChunk]]) -> None:
        if not rows or any(not r for r in rows):
            raise ValueError("PagedStep: every row needs at least one sequence chunk")
        self.cache, self.rows = cache, [list(r) for r in rows]
        bs, dev = cache.block_size, cache.device
        B = len(rows)
        T = max(sum(c.length for c in r) for r in rows)
        self.shape = (B, T)
        positions = torch.zeros((B, T), dtype=torch.long)
        slots: list[torch.Tensor] = []  # pool slot of every new token
        index: list[torch.Tensor] = []  # its flat index in the [B * T] batch (padding has none)
        prefills: list[PrefillChunk] = []
        decodes: list[DecodeToken] = []
        for b, row in enumerate(rows):
            t0 = 0  # next query column in this row
            for c in row:
                if c.start < 0 or c.length <= 0:
                    raise ValueError(f"PagedStep: chunk start must be >= 0 and length > 0, got {c}")
                end = c.start + c.length
                need = -(-end // bs)
                if len(c.block_table) < need:
                    raise ValueError(
                        f"PagedStep: block table of {len(c.block_table)} blocks cannot hold {end} tokens"
                    )
                blocks = [int(x) for x in c.block_table[:need]]
                pos = torch.arange(c.start, end)
                positions[b, t0 : t0 + c.length] = pos
                # position p: block p // bs, slot p % bs
                slots.append(torch.as_tensor(blocks)[pos // bs] * bs + pos % bs)
                index.append(b * T + t0 + torch.arange(c.length))
                if c.length == 1:
                    decodes.append(DecodeToken(b, t0, c.start, blocks))
                else:
                    prefills.append(
                        PrefillChunk(b, t0, c.length, torch.as_tensor(blocks, device=dev), end)
                    )
                t0 += c.length
        write_slots = torch.cat(slots).to(dev)
        write_index = None if len(write_slots) == B * T else torch.cat(index).to(dev)
        # batched calls read padding up to a group's longest member for nothing: group similar
        # lengths (the kernel reads only each row's own blocks: one call)
        groups = []
        for group in _group_by_length(decodes, bs, 10**9 if cache.kernel else 16):
            nb = max(len(d.blocks) for d in group)
            table = torch.zeros((len(group), nb), dtype=torch.long)  # padding: block 0, masked
            for i, d in enumerate(group):
                table[i, : len(d.blocks)] = torch.as_tensor(d.blocks)
            q_pos = torch.tensor([d.position for d in group])
            mask = torch.arange(nb * bs)[None, :] <= q_pos[:, None]  # key at or before query
            groups.append(
                DecodeGroup(
                    torch.tensor([d.row for d in group], device=dev),
                    torch.tensor([d.col for d in group], device=dev),
                    table.view(-1).to(dev),
                    nb,
                    mask[:, None, None, :].to(dev),
                    (q_pos + 1).to(dev),
                )
            )
        self.layout = StepLayout(positions.to(dev), write_slots, write_index, prefills, groups)
        self._dense: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def positions(self) -> torch.Tensor:
        return self.layout.positions

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: AttentionSpec,
        positions: torch.Tensor | None = None,  # unused: the step's layout holds them
    ) -> torch.Tensor:
        """The fast path, sequence by sequence: :func:`paged_attend`."""
        return paged_attend(self.cache, self.layout, layer, q, k, v, spec)

    # ---- the contract: hand back keys, values and a mask ----------------------------------------
    def update(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor | None = None,
        *,
        window: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write the new keys/values ``[B, Hkv, T, hd]`` (the slots were fixed at build: no
        ``positions``); return every row's blocks ``[B, Hkv, S, hd]`` and mask ``[B, 1, T, S]``."""
        write_kv(self.cache, self.layout, layer, k, v)
        gather, mask = self._dense_view(window)
        B, nb = gather.shape
        bs, H, D = self.cache.block_size, self.cache.n_kv_heads, self.cache.head_dim
        kp, vp = self.cache.k[layer], self.cache.v[layer]
        # [B * nb, bs, H, D] -> [B, nb * bs, H, D] (a view) -> [B, H, S, D] (a view)
        dt = k.dtype
        k_all = read_blocks(kp, gather.view(-1), dt).view(B, nb * bs, H, D).transpose(1, 2)
        v_all = read_blocks(vp, gather.view(-1), dt).view(B, nb * bs, H, D).transpose(1, 2)
        return k_all, v_all, mask

    def _dense_view(self, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """For :meth:`update`: each row's blocks ``[B, nb]`` and the mask, once per window."""
        if window not in self._dense:
            bs = self.cache.block_size
            B, T = self.shape
            nb = max(sum(-(-(c.start + c.length) // bs) for c in r) for r in self.rows)
            S = nb * bs
            q_seq = torch.full((B, T), -1, dtype=torch.long)  # each query's chunk in its row
            k_seq = torch.full((B, S), -2, dtype=torch.long)  # -2 never equals a query's id: masked
            k_pos = torch.zeros((B, S), dtype=torch.long)
            gather = torch.zeros((B, nb), dtype=torch.long)  # padding repeats block 0
            for b, row in enumerate(self.rows):
                t0 = g0 = 0
                for j, c in enumerate(row):
                    end = c.start + c.length
                    need = -(-end // bs)
                    q_seq[b, t0 : t0 + c.length] = j
                    gather[b, g0 : g0 + need] = torch.as_tensor(
                        [int(x) for x in c.block_table[:need]]
                    )
                    k_seq[b, g0 * bs : g0 * bs + end] = j
                    k_pos[b, g0 * bs : g0 * bs + end] = torch.arange(end)
                    t0 += c.length
                    g0 += need
            q_pos = self.positions.cpu()
            mask = (q_seq[:, :, None] == k_seq[:, None, :]) & (
                k_pos[:, None, :] <= q_pos[:, :, None]
            )
            if window is not None:
                mask &= k_pos[:, None, :] > q_pos[:, :, None] - window
            # a padding query would see no key, and softmax over nothing is NaN: let it see key 0
            mask[:, :, 0] |= q_seq < 0
            self._dense[window] = (
                gather.to(self.cache.device),
                mask[:, None].to(self.cache.device),
            )
        return self._dense[window]


def _group_by_length(
    chunks: list[DecodeToken], block_size: int, call_cost_blocks: int = 16
) -> list[list[DecodeToken]]:
    """Split single-token chunks into batched attention calls. A group reads ``len(group) *
    (longest block count)`` blocks, a call costs about ``call_cost_blocks`` more; sorted by
    length, the best split is a dynamic programme (``best[j]``: the ``j`` shortest chunks)."""
    if not chunks:
        return []
    order = sorted(chunks, key=lambda c: len(c.blocks))
    lens = [len(c.blocks) for c in order]
    n = len(order)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # the last group is order[i:j]; its longest member is order[j - 1]
            cost = best[i] + (j - i) * lens[j - 1] + call_cost_blocks
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j] : j])
        j = cut[j]
    return groups[::-1]
