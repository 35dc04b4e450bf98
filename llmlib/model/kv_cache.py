"""The static KV cache: keys and values of every past token, kept so decode never recomputes them.

Attention at position t needs the keys and values of positions 0..t. Without a cache, generating
token t+1 reruns the whole prefix through the model: the work for n tokens grows as n². With a cache,
prefill writes the prompt's keys and values once, and each decode step runs one new token through
the model, appends its key and value, and attends over everything stored: the work per token grows
only linearly with the length (the attention part) and the weights are read once per token.

The price is memory. This cache is preallocated at its full size,
``[layers, batch, kv_heads, max_len, head_dim]`` for keys and the same for values, so its size in bytes
is exactly chapter 1's formula ``2 · layers · kv_heads · head_dim · tokens · bytes_per_element``.
Preallocating means no tensor grows during generation (no copies, no fragmentation); chapter 10
replaces it by a paged cache that hands out memory in blocks as sequences grow.

A sliding-window layer (Mistral, Gemma's local layers) is only a different mask here: keys more
than ``window - 1`` positions behind a query are hidden. They are still stored (the cache keeps
every token of every layer, so its size is still the formula); only the mask changes.
"""

from __future__ import annotations

import torch

from llmlib.config import ModelConfig
from llmlib.model.attention import KVCacheLike
from llmlib.shapes import kv_cache_bytes

__all__ = ["KVCache", "kv_cache_bytes"]  # the formula is chapter 1's, shown in chapter 8


class KVCache(KVCacheLike):
    """A preallocated key/value store for ``batch`` sequences of up to ``max_len`` tokens.

    All rows advance together (the one-request generator and static batching); the cache keeps the
    number of tokens stored, ``length``, on the host, so writing and slicing never wait on the device.
    Each forward pass through the model calls ``attend`` once per layer (the contract's default,
    :class:`~llmlib.model.attention.KVCacheLike`), which stores the new keys and values
    (:meth:`update`) and attends over everything stored; after the last layer the new tokens
    count as stored.
    """

    def __init__(
        self,
        n_layers: int,
        batch: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        for name, v in (
            ("n_layers", n_layers),
            ("batch", batch),
            ("n_kv_heads", n_kv_heads),
            ("max_len", max_len),
            ("head_dim", head_dim),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"KVCache.{name} must be a positive int, got {v!r}")
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
        # torch.empty, not zeros: nothing past `length` is ever read, so there is nothing to clear
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.n_layers, self.batch, self.max_len = n_layers, batch, max_len
        self.length = 0  # tokens stored, the same for every row
        # masks are the same for every layer of one forward pass (per window): build once, reuse
        self._masks: dict[int | None, torch.Tensor | None] = {}
        self._all_true = torch.ones(1, 1, 1, max_len, dtype=torch.bool, device=device)

    @classmethod
    def from_config(
        cls,
        cfg: ModelConfig,
        batch: int = 1,
        max_len: int | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> KVCache:
        return cls(
            cfg.n_layers,
            batch,
            cfg.n_kv_heads,
            max_len or cfg.max_seq_len,
            cfg.head_dim,
            device,
            dtype,
        )

    @property
    def nbytes(self) -> int:
        """Bytes held by the key and value tensors (the whole preallocation)."""
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    @property
    def bytes_per_token(self) -> int:
        """Bytes one more token of one sequence costs: the formula with tokens = 1."""
        _, _, h, _, d = self.k.shape
        return int(kv_cache_bytes(self.n_layers, h, d, 1, self.k.element_size()))

    def reset(self) -> None:
        """Forget everything stored (the memory stays allocated for the next request)."""
        self.length = 0
        self._masks = {}

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` tokens (e.g. to reuse a shared prompt prefix)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length = length

    def layer_view(self, n_layers: int) -> KVCache:
        """A cache over this one's first ``n_layers`` layers: the same memory, its own ``length``.

        Speculative decoding's early-exit draft runs the target's own first layers, so the keys
        and values it computes for the tokens already accepted are the target's own: the draft
        reads them here instead of keeping a copy. What the draft writes past the target's
        ``length`` the target's verification pass overwrites before anything reads it.
        """
        if not 1 <= n_layers <= self.n_layers:
            raise ValueError(f"a view of 1..{self.n_layers} layers, got {n_layers}")
        view = object.__new__(KVCache)
        view.k, view.v = self.k[:n_layers], self.v[:n_layers]
        view.n_layers, view.batch, view.max_len = n_layers, self.batch, self.max_len
        view.length = self.length
        view._masks = {}
        view._all_true = self._all_true
        return view

    def update(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor | None = None,
        *,
        window: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Store the new keys/values ``k``, ``v`` [B, Hkv, T, hd] of ``layer``; return all of them.

        The new tokens go at positions ``length .. length+T-1`` (the caller's ``positions`` are
        expected to be exactly those; the cache trusts its own count so it never syncs on a
        device tensor). Returns ``(k_all, v_all, mask)``: views [B, Hkv, S, hd] of the first
        S = length+T slots (no copy), and a bool mask broadcastable to [B, 1, T, S] (True = may
        attend), or None when the cache was empty, meaning plain causal attention over S == T.
        With a sliding ``window`` the mask also hides keys ``window`` or more positions back.
        """
        B, _, T, _ = k.shape
        start, end = self.length, self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(
                f"KV cache is full: {start} tokens stored + {T} new > max_len {self.max_len}"
            )
        if B != self.batch:
            raise ValueError(f"KV cache holds {self.batch} rows, got keys for {B}")
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        if layer == 0:
            self._masks = {}
        if window not in self._masks:
            self._masks[window] = self._make_mask(start, T, k.device, window)
        k_all = self.k[layer, :, :, :end]
        v_all = self.v[layer, :, :, :end]
        mask = self._masks[window]
        if layer == self.n_layers - 1:
            self.length = end  # the last layer has written: the tokens are stored
        return k_all, v_all, mask

    def _make_mask(
        self, start: int, T: int, device: torch.device, window: int | None = None
    ) -> torch.Tensor | None:
        if start == 0:
            return None  # prefill into an empty cache: ordinary causal attention over S == T
        if window is not None and start + T > window:  # some key is out of some query's reach
            q_pos = torch.arange(start, start + T, device=device).unsqueeze(1)
            k_pos = torch.arange(start + T, device=device).unsqueeze(0)
            return ((k_pos <= q_pos) & (k_pos > q_pos - window)).view(1, 1, T, start + T)
        if T == 1:
            # One new token may see every stored key: an all-True mask, a view of a preallocated
            # row (no allocation per step). Passing a mask rather than None also keeps PyTorch's
            # CPU SDPA off its flash kernel, whose threading costs milliseconds for one query.
            return self._all_true[..., : start + 1]
        # a chunk of T tokens after `start` stored ones: query i sees keys 0..start+i
        q_pos = torch.arange(start, start + T, device=device).unsqueeze(1)
        k_pos = torch.arange(start + T, device=device).unsqueeze(0)
        return (k_pos <= q_pos).view(1, 1, T, start + T)
