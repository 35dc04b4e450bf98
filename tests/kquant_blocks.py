"""K-quant encoders for the tests, written from llama.cpp's block layouts (``ggml-common.h``).

The ``gguf`` package decodes every K-quant but encodes none, so the tests make their own blocks
from real float weights. These are the plain min/max encoders (llama.cpp searches for better
scales; the layout, which is what is tested, is the same). ``encode(x, kind)`` takes float32
rows ``[..., 256 k]`` and returns the GGUF bytes ``[..., bytes per row]``; the tests check that
``gguf.quants.dequantize`` of those bytes comes back within a quantization step of ``x``, which
pins the layout down independently of llmlib's reader.
"""

from __future__ import annotations

import numpy as np

QK = 256


def _pack(v: np.ndarray, bits: int, run: int) -> np.ndarray:
    """``[n, m]`` values of ``bits`` bits -> ``[n, m * bits / 8]`` bytes: each run of ``run``
    bytes holds values ``0 .. run-1`` in its bytes' lowest bits, the next ``run`` above, ..."""
    n = v.shape[0]
    per = 8 // bits
    v = v.astype(np.uint8).reshape(n, -1, per, run)
    out = np.zeros((n, v.shape[1], run), np.uint8)
    for i in range(per):
        out |= v[:, :, i, :] << np.uint8(bits * i)
    return out.reshape(n, -1)


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``[n]`` -> (float16 bytes ``[n, 2]``, the float16 values as float32 ``[n, 1]``)."""
    h = x.astype(np.float16)
    return h.reshape(-1, 1).view(np.uint8), h.astype(np.float32).reshape(-1, 1)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(
        a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32), where=b != 0
    )


def _asymmetric(x: np.ndarray, sub: int, levels: int, sbits: int):
    """Sub-blocks of ``sub``: ``x ~ d*s*q - dmin*m``, ``q`` in 0..levels, ``s``/``m`` of
    ``sbits`` bits. Returns (q, s, m, d bytes, dmin bytes, the values they stand for)."""
    n = x.shape[0]
    g = x.reshape(n, -1, sub)
    lo = np.minimum(g.min(axis=2), 0)
    scale, mn = (g.max(axis=2) - lo) / levels, -lo
    top = (1 << sbits) - 1
    d_b, d = _f16(scale.max(axis=1) / top)
    m_b, dm = _f16(mn.max(axis=1) / top)
    s = np.clip(np.round(_div(scale, d)), 0, top)
    m = np.clip(np.round(_div(mn, dm)), 0, top)
    q = np.clip(np.round(_div(g + (dm * m)[..., None], (d * s)[..., None])), 0, levels)
    values = (d * s)[..., None] * q - (dm * m)[..., None]
    return q.reshape(n, -1), s, m, d_b, m_b, values.reshape(n, -1)


def _symmetric(x: np.ndarray, sub: int, qmax: int, smax: int):
    """Sub-blocks of ``sub``: ``x ~ d*s*q``, ``q`` in -qmax-1..qmax, ``s`` in -smax-1..smax.
    Returns (q, s, d bytes, the values they stand for)."""
    n = x.shape[0]
    g = x.reshape(n, -1, sub)
    scale = np.abs(g).max(axis=2) / qmax
    d_b, d = _f16(scale.max(axis=1) / smax)
    s = np.clip(np.round(_div(scale, d)), -smax - 1, smax)
    q = np.clip(np.round(_div(g, (d * s)[..., None])), -qmax - 1, qmax)
    return q.reshape(n, -1), s, d_b, ((d * s)[..., None] * q).reshape(n, -1)


def _scales_k4(s: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and minimums -> Q4_K/Q5_K's 12 bytes."""
    s, m = s.astype(np.uint8), m.astype(np.uint8)
    lo = (s[:, :4] & 63) | (s[:, 4:] >> 4) << 6
    mid = (m[:, :4] & 63) | (m[:, 4:] >> 4) << 6
    hi = (s[:, 4:] & 15) | (m[:, 4:] & 15) << 4
    return np.concatenate([lo, mid, hi], axis=1)


def _q2_k(x):
    q, s, m, d, dmin, values = _asymmetric(x, 16, 3, 4)
    sm = s.astype(np.uint8) | m.astype(np.uint8) << 4
    return [sm, _pack(q, 2, 32), d, dmin], values


def _q3_k(x):
    q, s, d, values = _symmetric(x, 16, 3, 31)
    q, s = (q + 4).astype(np.uint8), (s + 32).astype(np.uint8)
    scales = np.concatenate([_pack(s & 15, 4, 8), _pack(s >> 4, 2, 4)], axis=1)
    return [_pack(q >> 2, 1, 32), _pack(q & 3, 2, 32), scales, d], values


def _q4_k(x):
    q, s, m, d, dmin, values = _asymmetric(x, 32, 15, 6)
    return [d, dmin, _scales_k4(s, m), _pack(q, 4, 32)], values


def _q5_k(x):
    q, s, m, d, dmin, values = _asymmetric(x, 32, 31, 6)
    q = q.astype(np.uint8)
    return [d, dmin, _scales_k4(s, m), _pack(q >> 4, 1, 32), _pack(q & 15, 4, 32)], values


def _q6_k(x):
    q, s, d, values = _symmetric(x, 16, 31, 127)
    q = (q + 32).astype(np.uint8)
    fields = [_pack(q & 15, 4, 64), _pack(q >> 4, 2, 32), s.astype(np.int8).view(np.uint8), d]
    return fields, values


ENCODERS = {"Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def encode_with_values(x: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``[..., 256 k]`` -> (the bytes of ``kind`` blocks ``[..., bytes per row]``, the
    float32 values those bytes stand for, computed here from the encoder's own integers)."""
    x = np.asarray(x, np.float32)
    fields, values = ENCODERS[kind](x.reshape(-1, QK))
    out = np.concatenate([np.asarray(p, np.uint8) for p in fields], axis=1)
    return out.reshape(*x.shape[:-1], -1), values.astype(np.float32).reshape(x.shape)


def encode(x: np.ndarray, kind: str) -> np.ndarray:
    """float32 ``[..., 256 k]`` -> the bytes of ``kind`` blocks, ``[..., bytes per row]``."""
    return encode_with_values(x, kind)[0]
