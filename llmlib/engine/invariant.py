"""Batch-invariant steps: a token's logits bitwise the same whatever else shares its step.

Floating-point addition is not associative, so a sum computed in another order can differ in its
last bits; near a tie between two tokens that flips a greedy choice. In the default engine the
order of a token's sums depends on its company: the kernel library picks its matrix-product kernel
from the number of rows (the step's token count), and attention splits the keys into blocks whose
size depends on the chunk's length (``F.scaled_dot_product_attention``) or pads a decode group to
its longest member. So the same request run alone, in a batch, with its prompt chunked another
way, recomputed after a preemption, or started from cached prefix blocks can produce different
logits (chapter 7 measures by how much, :mod:`llmlib.invariance`).

``LLM(..., batch_invariant=True)`` fixes every reduction's order independently of the batch, the
recipe of He et al. ("Defeating Nondeterminism in LLM Inference", 2025) and vLLM's batch-invariant
mode:

* weight-matrix products are taken ``ROW_TILE`` rows at a time, zero-padded
  (:func:`llmlib.linear.fixed_row_tiles`): the kernel always sees the same shape, and row ``i``
  of a product depends only on row ``i`` of its input;
* RMSNorm, RoPE, SiLU and the residual adds are per row already;
* attention (:class:`InvariantStep`) cuts every sequence's queries into tiles of ``Q_TILE``
  positions aligned to absolute positions (position ``p`` is always row ``p % Q_TILE`` of its
  tile), and walks the keys from position 0 in tiles of ``K_TILE`` with an online softmax. A
  query's sums then depend only on its position and its sequence's keys: not on how its prompt
  was chunked, whether it is a prompt token or a decoded one (so a recompute after preemption
  rebuilds the same keys and values), nor on which other sequences share the step (tiles beyond
  a query's last key are fully masked, and a fully masked tile leaves the running sums exactly
  as they were: ``exp(-inf) = 0``, a correction of ``exp(0) = 1``).

The products run in whatever format the model was loaded in (bfloat16 in oneDNN's layout by
default on a CPU with AMX, float32 elsewhere): fixing the shape is what makes any deterministic
kernel invariant. Attention runs in float32. What it costs, ``llmlib bench batching
--batch-invariant`` measures against the default mode in the same run.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from llmlib.attention import AttentionFn, soft_cap
from llmlib.engine.paged_cache import PagedKVCache, PagedStep, SeqChunk, write_kv

#: rows per weight-matrix product (bfloat16 oneDNN and float32 MKL both change kernels with M)
ROW_TILE = 32
#: query positions per attention tile, and keys per key tile
Q_TILE = 8
K_TILE = 64


@dataclass
class _Tiles:
    """Where each query tile's rows come from and which keys it reads (built once per step)."""

    q_index: torch.Tensor  # [U * Q_TILE] flat token index of each row (padding: B * T)
    slots: torch.Tensor  # [U, J * K_TILE] pool slot of every key position of every tile
    visible: torch.Tensor  # [U, Q_TILE, J * K_TILE] key position <= the row's query position
    k_pos: torch.Tensor  # [J * K_TILE]
    q_pos: torch.Tensor  # [U, Q_TILE]
    n_ktiles: int


class InvariantStep(PagedStep):
    """A :class:`~llmlib.engine.paged_cache.PagedStep` whose attention is batch-invariant."""

    def __init__(
        self,
        cache: PagedKVCache,
        rows: Seq[Seq[SeqChunk]],
        q_tile: int = Q_TILE,
        k_tile: int = K_TILE,
    ) -> None:
        super().__init__(cache, rows)
        self.q_tile, self.k_tile = q_tile, k_tile
        self.tiles = self._plan()

    def _plan(self) -> _Tiles:
        bs, qt, kt = self.cache.block_size, self.q_tile, self.k_tile
        B, T = self.shape
        q_index, q_pos, last, tables = [], [], [], []
        for b, row in enumerate(self.rows):
            t0 = 0
            for c in row:
                end = c.start + c.length
                blocks = [int(x) for x in c.block_table[: -(-end // bs)]]
                for u in range(c.start // qt, (end - 1) // qt + 1):
                    pos = torch.arange(u * qt, (u + 1) * qt)
                    real = (pos >= c.start) & (pos < end)
                    top = int(pos[real].max())  # the tile's last real query
                    q_index.append(torch.where(real, b * T + t0 + pos - c.start, B * T))
                    # padding rows look at the same keys as the last real one: finite, unread
                    q_pos.append(torch.where(real, pos, top))
                    last.append(top)
                    tables.append(blocks)
                t0 += c.length
        U = len(last)
        last_t = torch.tensor(last)
        J = int(last_t.max()) // kt + 1
        k_pos = torch.arange(J * kt)
        nb = max(len(t) for t in tables)
        table = torch.zeros((U, nb), dtype=torch.long)
        for i, t in enumerate(tables):
            table[i, : len(t)] = torch.as_tensor(t)
        # keys beyond a tile's last query read position 0 (a real key) and are masked
        kidx = torch.where(k_pos[None, :] <= last_t[:, None], k_pos[None, :], 0)
        slots = table.gather(1, kidx // bs) * bs + kidx % bs
        q_pos_t = torch.stack(q_pos)
        visible = k_pos[None, None, :] <= q_pos_t[:, :, None]
        dev = self.cache.device
        return _Tiles(
            torch.cat(q_index).to(dev),
            slots.to(dev),
            visible.to(dev),
            k_pos.to(dev),
            q_pos_t.to(dev),
            J,
        )

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention: AttentionFn,
        *,
        window: int | None = None,
    ) -> torch.Tensor:
        """Write the new keys and values, then tiled attention for every query ``[B, H, T, hd]``.

        ``attention`` is only read for its options (a family's ``scale`` and ``softcap``); the
        computation is this method's own, so that its order is fixed here.
        """
        write_kv(self.cache, self.layout, layer, k, v)
        opts = getattr(attention, "keywords", {}) or {}
        B, H, T, D = q.shape
        Hkv, qt, kt = self.cache.n_kv_heads, self.q_tile, self.k_tile
        rep = H // Hkv
        tl = self.tiles
        U = tl.q_pos.shape[0]
        R = rep * qt
        scale = opts.get("scale") or D**-0.5
        softcap = opts.get("softcap")
        flat = q.transpose(1, 2).reshape(B * T, H, D)
        flat = torch.cat([flat, flat.new_zeros(1, H, D)])  # the padding row
        # [U, qt, Hkv, rep, D] -> [U, Hkv, rep * qt, D]: the query heads sharing a KV head
        Q = flat[tl.q_index].view(U, qt, Hkv, rep, D).permute(0, 2, 3, 1, 4)
        Q = Q.reshape(U, Hkv, R, D).float()
        vis = tl.visible
        if window is not None:
            vis = vis & (tl.k_pos[None, None, :] > tl.q_pos[:, :, None] - window)
        # [U, 1, rep * qt, S]: the same mask for every head of a KV group
        vis = vis[:, None].expand(U, rep, qt, -1).reshape(U, 1, R, -1)
        kpool = self.cache.k[layer].view(-1, Hkv, D)
        vpool = self.cache.v[layer].view(-1, Hkv, D)
        dev = q.device
        m = torch.full((U, Hkv, R, 1), float("-inf"), device=dev)
        l = torch.zeros((U, Hkv, R, 1), device=dev)  # noqa: E741 - the softmax denominator
        acc = torch.zeros((U, Hkv, R, D), device=dev)
        for j in range(tl.n_ktiles):
            sl = tl.slots[:, j * kt : (j + 1) * kt].reshape(-1)
            kj = kpool.index_select(0, sl).view(U, kt, Hkv, D).permute(0, 2, 3, 1).float()
            vj = vpool.index_select(0, sl).view(U, kt, Hkv, D).transpose(1, 2).float()
            s = torch.matmul(Q, kj.contiguous()) * scale  # [U, Hkv, R, kt]
            if softcap is not None:
                s = soft_cap(s, softcap)
            s = s.masked_fill(~vis[..., j * kt : (j + 1) * kt], float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            p = torch.exp(s - m_new)
            corr = torch.exp(m - m_new)
            l = l * corr + p.sum(dim=-1, keepdim=True)  # noqa: E741
            acc = acc * corr + torch.matmul(p, vj.contiguous())
            m = m_new
        o = (acc / l).view(U, Hkv, rep, qt, D).permute(0, 3, 1, 2, 4).reshape(U * qt, H, D)
        out = q.new_zeros(B * T + 1, H, D)
        out[tl.q_index] = o.to(q.dtype)  # padding rows all land in the extra row
        return out[: B * T].view(B, T, H, D).transpose(1, 2)
