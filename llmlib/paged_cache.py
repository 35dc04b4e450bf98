"""The paged KV cache: one pool of blocks per layer, read and written through block tables.

The pool of layer ``i`` is two tensors ``[num_blocks, kv_heads, block_size, head_dim]`` (keys and
values). A sequence's keys live in the blocks its block table names, in order; block ``b`` holds
the tokens at positions ``b * block_size ... (b + 1) * block_size - 1`` of that sequence.

The model never sees any of this. Each forward pass gets a :class:`PagedStep`, which implements the
one method every cache implements (see the model contract)::

    k_all, v_all, mask = cache.update(layer, k, v, positions)

It scatters the new keys/values into their slots, then gathers, for every row of the batch, the
blocks of the sequences in that row, and returns a mask saying which query may see which key.
Attention over the gathered keys is then exactly attention over a contiguous cache.

Two layouts of the batch are supported, because they suit different work:

* one sequence per row (decode: ``[B, 1]``), each row gathering its own blocks;
* several sequences packed into one row (prefill: ``[1, T1 + T2 + ...]``), the row gathering all
  their blocks, and the mask making it block-diagonal, so no compute is spent on padding.

Both are described the same way: for every new token, its slot and (sequence, position); for every
gathered key, its (sequence, position). The mask is ``same sequence and key position <= query
position``. It is built once per step and shared by all layers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq

import torch


class PagedKVCache:
    """The block pools of all layers (allocated once, at engine start)."""

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
    ) -> None:
        for name, v in (("n_layers", n_layers), ("num_blocks", num_blocks), ("n_kv_heads", n_kv_heads),
                        ("block_size", block_size), ("head_dim", head_dim)):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"PagedKVCache: {name} must be a positive integer, got {v!r}")
        self.n_layers, self.num_blocks, self.block_size = n_layers, num_blocks, block_size
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        self.device, self.dtype = torch.device(device), dtype
        shape = (num_blocks, n_kv_heads, block_size, head_dim)
        # torch.zeros on the CPU maps pages lazily: memory is committed only where blocks are written.
        self.k = [torch.zeros(shape, device=self.device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, device=self.device, dtype=dtype) for _ in range(n_layers)]

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes over all layers, keys and values."""
        return 2 * self.n_layers * self.n_kv_heads * self.block_size * self.head_dim * self.k[0].element_size()

    @property
    def nbytes(self) -> int:
        return self.bytes_per_block * self.num_blocks

    def step(self, rows: Seq[Seq["SeqChunk"]]) -> "PagedStep":
        """The cache view for one forward pass: ``rows[b]`` lists the sequence chunks in row ``b``."""
        return PagedStep.build(self, rows)


@dataclass
class SeqChunk:
    """Part of one sequence computed in this forward pass.

    ``start`` tokens of the sequence are already in the pool; this pass computes tokens
    ``start .. start + length - 1``. ``block_table`` must already cover ``start + length`` tokens.
    """

    block_table: Seq[int]
    start: int
    length: int


class PagedStep:
    """Implements the model's cache contract for one forward pass over the paged pool."""

    def __init__(
        self,
        cache: PagedKVCache,
        write_blocks: torch.Tensor,  # [N] block of every new (non-padding) token, row-major over [B, T]
        write_offsets: torch.Tensor,  # [N] offset inside that block
        write_index: torch.Tensor,  # [N] flat index into [B*T] of those tokens
        gather_blocks: torch.Tensor,  # [B, nb] blocks each row reads (padding repeats block 0)
        mask: torch.Tensor,  # [B, 1, T, nb * block_size] True = may attend
        positions: torch.Tensor,  # [B, T] the position of every new token (pads: 0)
    ) -> None:
        self.cache = cache
        self.write_blocks, self.write_offsets, self.write_index = write_blocks, write_offsets, write_index
        self.gather_blocks, self.mask, self.positions = gather_blocks, mask, positions

    @classmethod
    def build(cls, cache: PagedKVCache, rows: Seq[Seq[SeqChunk]]) -> "PagedStep":
        if not rows or any(not r for r in rows):
            raise ValueError("PagedStep: every row needs at least one sequence chunk")
        bs = cache.block_size
        B = len(rows)
        T = max(sum(c.length for c in r) for r in rows)
        nb = max(sum(-(-(c.start + c.length) // bs) for c in r) for r in rows)
        S = nb * bs
        # Built with Python lists on the host, then moved once: these are a few hundred ints.
        q_seq = torch.full((B, T), -1, dtype=torch.long)  # which chunk (in its row) each query is
        q_pos = torch.zeros((B, T), dtype=torch.long)
        k_seq = torch.full((B, S), -2, dtype=torch.long)  # -2 never equals a query's id: masked
        k_pos = torch.zeros((B, S), dtype=torch.long)
        gather = torch.zeros((B, nb), dtype=torch.long)
        w_blocks: list[torch.Tensor] = []
        w_offsets: list[torch.Tensor] = []
        w_index: list[torch.Tensor] = []
        for b, row in enumerate(rows):
            t0 = 0  # next query column in this row
            g0 = 0  # next gathered block in this row
            for j, c in enumerate(row):
                if c.start < 0 or c.length <= 0:
                    raise ValueError(f"PagedStep: chunk start must be >= 0 and length > 0, got {c}")
                end = c.start + c.length
                need = -(-end // bs)
                if len(c.block_table) < need:
                    raise ValueError(f"PagedStep: block table of {len(c.block_table)} blocks cannot hold {end} tokens")
                table = torch.as_tensor(list(c.block_table[:need]), dtype=torch.long)
                pos = torch.arange(c.start, end)
                q_seq[b, t0:t0 + c.length] = j
                q_pos[b, t0:t0 + c.length] = pos
                w_blocks.append(table[pos // bs])  # token at position p lives in block p // bs ...
                w_offsets.append(pos % bs)  # ... at slot p % bs
                w_index.append(b * T + t0 + torch.arange(c.length))
                gather[b, g0:g0 + need] = table
                k_seq[b, g0 * bs:g0 * bs + end] = j
                k_pos[b, g0 * bs:g0 * bs + end] = torch.arange(end)
                t0 += c.length
                g0 += need
        mask = (q_seq[:, :, None] == k_seq[:, None, :]) & (k_pos[:, None, :] <= q_pos[:, :, None])
        # A padding query (shorter row) would see no key at all, and softmax over nothing is NaN;
        # let it see key 0. Its output is never read.
        mask[:, :, 0] |= q_seq < 0
        dev = cache.device
        return cls(
            cache,
            torch.cat(w_blocks).to(dev),
            torch.cat(w_offsets).to(dev),
            torch.cat(w_index).to(dev),
            gather.to(dev),
            mask[:, None].to(dev),
            q_pos.to(dev),
        )

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write the new keys/values ``[B, Hkv, T, hd]`` into their slots; return what to attend over.

        ``positions`` is accepted for the contract; the slots were fixed when the step was built
        (from the same positions), so it is not needed here.
        """
        kp, vp = self.cache.k[layer], self.cache.v[layer]
        B, H, T, D = k.shape
        # [B, H, T, D] -> [B*T, H, D], keep the real tokens, scatter into (block, :, offset, :).
        k_new = k.transpose(1, 2).reshape(B * T, H, D)[self.write_index]
        v_new = v.transpose(1, 2).reshape(B * T, H, D)[self.write_index]
        kp[self.write_blocks, :, self.write_offsets] = k_new.to(kp.dtype)
        vp[self.write_blocks, :, self.write_offsets] = v_new.to(vp.dtype)
        # Gather whole blocks: [B, nb, H, bs, D] -> [B, H, nb * bs, D].
        nb = self.gather_blocks.shape[1]
        bs = self.cache.block_size
        k_all = kp[self.gather_blocks].permute(0, 2, 1, 3, 4).reshape(B, H, nb * bs, D)
        v_all = vp[self.gather_blocks].permute(0, 2, 1, 3, 4).reshape(B, H, nb * bs, D)
        return k_all, v_all, self.mask
