"""Proposers: cheap guesses of the next k tokens, each behind one small interface.

* :class:`NgramProposer` — prompt lookup: find the latest earlier occurrence of the sequence's
  last n tokens and propose what followed it. No model at all; it pays off when the answer
  copies from its context (summaries, edits, code rewrites).
* :class:`EarlyExitProposer` — the target's own first L layers, final norm and LM head (LayerSkip's
  self-speculation). Its keys and values for layers ``0..L-1`` are the target's own, so it reads
  them from the target's cache through a view (:meth:`llmlib.model.kv_cache.KVCache.layer_view`)
  instead of keeping a second cache: no extra memory, no second prefill.
* :class:`DraftModelProposer` — any smaller model with the same vocabulary, with a cache of its own.

A proposer returns the tokens and, when it sampled them, the distributions it sampled from
(``None``: a deterministic proposal, which verification treats as one-hot).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from llmlib.model.kv_cache import KVCache

#: Draft sampling: one row of logits ``[V]`` -> (token, the distribution it came from or None).
Chooser = Callable[[torch.Tensor], tuple[int, torch.Tensor | None]]


@dataclass
class Proposal:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), V] the draft sampled from; None: one-hot


class Proposer(Protocol):
    """Proposes up to ``k`` tokens to follow ``seq`` (the prompt and every token decided so far;
    the target's cache holds all of them but the last)."""

    def start(self, target_cache: KVCache) -> None:
        """A new request begins; ``target_cache`` is the target's (prefilled with the prompt)."""

    def propose(self, seq: Sequence[int], k: int, choose: Chooser) -> Proposal: ...


class NgramProposer:
    """Prompt lookup (vLLM's ``prompt_lookup_min``/``max``): for n from ``max_n`` down to
    ``min_n``, look for the latest earlier place where the last n tokens occurred and propose the
    (up to) k tokens that followed it there. Deterministic, so its proposals are one-hot."""

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def start(self, target_cache: KVCache) -> None:
        pass

    def propose(self, seq: Sequence[int], k: int, choose: Chooser | None = None) -> Proposal:
        return Proposal(lookup(seq, k, self.min_n, self.max_n))


def lookup(seq: Sequence[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """The up-to-``k`` tokens that followed the latest earlier occurrence of ``seq``'s last n
    tokens, for the largest n in ``max_n..min_n`` that occurs; ``[]`` when none does."""
    L = len(seq)
    if k < 1 or L < min_n + 1:
        return []
    t = torch.as_tensor(list(seq), dtype=torch.long)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        # windows starting at 0..L-n-1: each has at least one token after it
        windows = t[: L - 1].unfold(0, n, 1) if L - 1 >= n else t[:0].view(0, n)
        hits = (windows == t[L - n :]).all(dim=1).nonzero()
        if len(hits):
            start = int(hits[-1]) + n
            return t[start : start + k].tolist()
    return []


class _ModelDraft:
    """Shared by the two model proposers: decode k tokens with ``forward`` on a cache."""

    cache: KVCache

    def _forward(self, ids: torch.Tensor, pos: int) -> torch.Tensor:
        raise NotImplementedError

    def _decode(self, first: torch.Tensor, pos: int, k: int, choose: Chooser) -> Proposal:
        """``first``: logits [V] for the token after position ``pos - 1``; then k - 1 more steps."""
        tokens, probs, logits = [], [], first
        for i in range(k):
            tok, q = choose(logits)
            tokens.append(tok)
            probs.append(q)
            if i == k - 1:
                break
            ids = torch.tensor([[tok]], device=logits.device)
            logits = self._forward(ids, pos + i)[0, -1]
        stacked = None if probs[0] is None else torch.stack(probs)
        return Proposal(tokens, stacked)


class EarlyExitProposer(_ModelDraft):
    """The target's own first ``exit_layer`` layers, final norm and LM head as the draft.

    The draft attends over the target's keys and values for its layers through a view of the
    target's cache: for the tokens already accepted they are exactly what the draft would compute
    itself. The view's ``length`` is reset to the target's before every proposal, so whatever the
    draft wrote for refused tokens is past the end and is overwritten before being read.
    """

    def __init__(self, model: torch.nn.Module, exit_layer: int) -> None:
        n = model.config.n_layers
        if not 1 <= exit_layer <= n:
            raise ValueError(f"exit_layer must be in 1..{n} (the model's layers), got {exit_layer}")
        self.model, self.exit_layer = model, exit_layer
        self._target: KVCache | None = None

    def start(self, target_cache: KVCache) -> None:
        self._target = target_cache
        self.cache = target_cache.layer_view(self.exit_layer)

    def _forward(self, ids: torch.Tensor, pos: int) -> torch.Tensor:
        positions = torch.arange(pos, pos + ids.shape[1], device=ids.device).unsqueeze(0)
        h = self.model.hidden(ids, positions, self.cache, n_layers=self.exit_layer)
        return self.model.logits(h[:, -1:])

    def propose(self, seq: Sequence[int], k: int, choose: Chooser) -> Proposal:
        if k < 1:
            return Proposal([])
        assert self._target is not None, "start() first"
        n = self._target.length  # tokens the target has stored: all of seq but the last
        self.cache.length = n
        ids = torch.tensor([[seq[-1]]], device=self._target.k.device)
        return self._decode(self._forward(ids, n)[0, -1], n + 1, k, choose)


class DraftModelProposer(_ModelDraft):
    """A separate (smaller) model with the same vocabulary, with a cache of its own.

    It remembers which tokens its cache holds; each proposal first feeds the ones it has not seen
    (the whole prompt the first time, then the last accepted token and the target's correction).
    """

    def __init__(self, model: torch.nn.Module, vocab_size: int | None = None) -> None:
        if vocab_size is not None and model.config.vocab_size != vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({model.config.vocab_size}) differs from the "
                f"target's ({vocab_size}): their token ids would not mean the same"
            )
        self.model = model
        p = next(model.parameters())
        self.device, self.dtype = p.device, getattr(model, "dtype", p.dtype)
        self.cache = None  # type: ignore[assignment]
        self._held: list[int] = []

    def start(self, target_cache: KVCache) -> None:
        if self.cache is None or self.cache.max_len < target_cache.max_len:
            self.cache = KVCache.from_config(
                self.model.config, 1, target_cache.max_len, self.device, self.dtype
            )
        self.cache.reset()
        self._held = []

    def _forward(self, ids: torch.Tensor, pos: int) -> torch.Tensor:
        positions = torch.arange(pos, pos + ids.shape[1], device=ids.device).unsqueeze(0)
        return self.model(ids, positions, self.cache, last_only=True)

    def propose(self, seq: Sequence[int], k: int, choose: Chooser) -> Proposal:
        if k < 1:
            return Proposal([])
        c = 0  # tokens of seq the draft's cache already holds (at least one is fed anew)
        limit = min(len(self._held), len(seq) - 1)
        while c < limit and self._held[c] == seq[c]:
            c += 1
        self.cache.truncate(c)
        ids = torch.tensor([list(seq[c:])], device=self.device)
        first = self._forward(ids, c)[0, -1]
        out = self._decode(first, len(seq), k, choose)
        self._held = list(seq) + out.tokens[:-1]
        return out


def make_proposer(spec, model: torch.nn.Module) -> Proposer:
    """The proposer a :class:`~llmlib.speculative.config.SpeculativeConfig` asks for."""
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "early_exit":
        return EarlyExitProposer(model, spec.exit_layer)
    draft = spec.draft_model
    if not isinstance(draft, torch.nn.Module):
        from llmlib.checkpoints import load_model

        p = next(model.parameters())
        draft = load_model(draft, device=p.device, dtype=getattr(model, "dtype", p.dtype))
    return DraftModelProposer(draft, model.config.vocab_size)
