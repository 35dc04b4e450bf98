"""The integer kernels' tile layouts (:mod:`llmlib.kernels.integer`): codes in, tiles out, and
rows back out of tiles (the lookup of a tied table).

Tiles hold 64 output channels. Inside a tile, for every four input columns, the 64 channels'
four codes lie side by side: one 64-byte load holds four consecutive codes of 16 channels, what
a byte dot product (VNNI's ``vpdpbusd``, AVX2's ``vpmaddubsw``) takes against four activation
bytes. 8-bit codes are stored plus 128, 4-bit ones two columns' groups to a byte, 6-bit ones as
two nibble planes and one plane of top bits (:func:`pack_int6`).
"""

from __future__ import annotations

import torch

from llmlib.quantize import GroupCodes

TILE = 64  # output channels per tile


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 codes ``[N, K]`` -> tiles ``[N/64, K*64]`` uint8 (codes + 128)."""
    return pack_uint8((q.to(torch.int16) + 128).to(torch.uint8))


def pack_uint8(u: torch.Tensor) -> torch.Tensor:
    """Codes already stored plus 128 (uint8 ``[N, K]``, as 8-bit :class:`GroupCodes` hold them)
    -> :func:`pack_int8`'s tiles."""
    n, k = u.shape
    u = u.to(torch.uint8)
    return u.view(n // TILE, TILE, k // 4, 4).permute(0, 2, 1, 3).reshape(n // TILE, k * TILE)


def unpack_int8(w: torch.Tensor, k: int, ids: torch.Tensor) -> torch.Tensor:
    """int8 codes ``[*ids, K]`` of rows ``ids`` from :func:`pack_int8`'s tiles."""
    t = w.view(-1, k // 4, TILE, 4)
    flat = ids.reshape(-1)
    rows = t[flat // TILE, :, flat % TILE, :].reshape(-1, k)  # len() would fix the row count
    return (rows.to(torch.int16) - 128).to(torch.int8).view(*ids.shape, k)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """4-bit codes ``[N, K]`` (0..15) -> tiles ``[N/64, K*32]``: per 8 columns, 4 x 64 bytes, the
    low nibble holding columns 0-3 and the high nibble columns 4-7 of 16 channels."""
    n, k = q.shape
    t = q.to(torch.uint8).view(n // TILE, 4, 16, k // 8, 2, 4)  # tile, j, c, pair, half, i
    lo, hi = t[:, :, :, :, 0], t[:, :, :, :, 1]
    byte = lo | (hi << 4)  # [tile, j, c, pair, i]
    return byte.permute(0, 3, 1, 2, 4).reshape(n // TILE, k * TILE // 2)


def unpack_int4(w: torch.Tensor, k: int, ids: torch.Tensor) -> torch.Tensor:
    """4-bit codes ``[*ids, K]`` of rows ``ids`` from :func:`pack_int4`'s tiles."""
    t = w.view(-1, k // 8, 4, 16, 4)  # tile, pair, j, c, i
    flat = ids.reshape(-1)
    b = t[flat // TILE, :, (flat % TILE) // 16, flat % 16, :]  # [rows, pair, i]
    q = torch.stack([b & 0x0F, b >> 4], dim=2)  # [rows, pair, half, i]
    return q.reshape(*ids.shape, k)


def eight_bit(codes: GroupCodes) -> GroupCodes:
    """6-bit codes as 8-bit ones, the same weights: ``c - 32 == (c + 96) - 128``."""
    if codes.bits != 6:
        return codes
    q = codes.q + 96
    return GroupCodes(q, codes.scale, codes.zero, codes.group_size, 8, codes.unit, codes.steps)


def pack_int6(c: torch.Tensor) -> torch.Tensor:
    """6-bit codes ``[N, K]`` (0..63) -> tiles ``[N/64, K*48]``: per 16 columns, the low nibbles
    of column quads 0-1 and 2-3 (each 4 x 64 bytes: low nibble quad 0 or 2, high nibble quad 1 or
    3, 16 channels x 4 codes per 64 bytes) and then the top two bits of all four quads (4 x 64
    bytes, quad ``g`` in bits ``2g``)."""
    n, k = c.shape
    t = c.to(torch.uint8).view(n // TILE, 4, 16, k // 16, 4, 4)  # tile, j, ch, s, quad, i
    t = t.permute(0, 3, 4, 1, 2, 5)  # tile, s, quad, j, ch, i
    lo, top = t & 0x0F, t >> 4
    nibbles = lo[:, :, 0::2] | (lo[:, :, 1::2] << 4)  # tile, s, pair, j, ch, i
    tops = top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)
    per_s = torch.cat(
        [nibbles.reshape(n // TILE, k // 16, 512), tops.reshape(n // TILE, k // 16, 256)], 2
    )
    return per_s.reshape(n // TILE, k * TILE * 6 // 8)


def unpack_int6(w: torch.Tensor, k: int, ids: torch.Tensor) -> torch.Tensor:
    """6-bit codes ``[*ids, K]`` of rows ``ids`` from :func:`pack_int6`'s tiles."""
    t = w.view(-1, k // 16, 768)
    flat = ids.reshape(-1)
    tiles, j, ch = flat // TILE, (flat % TILE) // 16, flat % 16
    nib = t[:, :, :512].view(-1, k // 16, 2, 4, 16, 4)[tiles, :, :, j, ch]  # rows, s, pair, i
    top = t[:, :, 512:].view(-1, k // 16, 4, 16, 4)[tiles, :, j, ch]  # rows, s, i
    lo = torch.stack([nib & 0x0F, nib >> 4], dim=3).flatten(2, 3)  # rows, s, quad, i
    hi = torch.stack([(top >> (2 * g)) & 3 for g in range(4)], dim=2)  # rows, s, quad, i
    return (lo | (hi << 4)).reshape(*ids.shape, k)


def tile_constants(c: torch.Tensor) -> torch.Tensor:
    """Per-group constants ``[N, K/g]`` -> ``[N/64, K/g * 64]``, a tile's groups together."""
    n, groups = c.shape
    return c.view(n // TILE, TILE, groups).transpose(1, 2).reshape(n // TILE, groups * TILE)
