"""Quality, measured: perplexity over sliding windows, and how far a format moves the predictions.

Perplexity is ``exp`` of the mean negative log-likelihood the model gives each next token of a
text. A text longer than the context is scored in windows of ``context`` tokens that advance by
``stride``: each window scores only the tokens the previous window did not (its last
``stride``), with everything before them in the window as context. That is the standard method
(Hugging Face's perplexity guide), and :func:`perplexity` follows it token for token, so its
float32 figure can be checked against ``transformers`` on the same windows.

A smaller format changes the weights a little; :func:`compare` measures what that does to the
output at every scored position: the KL divergence of the format's next-token distribution from
the reference's, and the share of positions where both would pick the same greedy token.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch


def windows(n: int, context: int, stride: int) -> Iterator[tuple[int, int, int]]:
    """``(begin, end, first)`` per window over ``n`` tokens: the window is ``ids[begin:end]`` and it
    scores the tokens at ``first .. end - 1`` (each predicted from the ones before it)."""
    if context < 2 or not 1 <= stride <= context:
        raise ValueError(f"need context >= 2 and 1 <= stride <= context, got {context}, {stride}")
    prev_end = 0
    for begin in range(0, n, stride):
        end = min(begin + context, n)
        first = max(begin + 1, prev_end)  # the window's first token has nothing to predict it
        if end > first:
            yield begin, end, first
        prev_end = end
        if end == n:
            break


@dataclass
class Perplexity:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    tokens: int  # tokens scored
    windows: int


def over_windows(nll_of_window, n: int, context: int, stride: int) -> Perplexity:
    """Perplexity of ``n`` tokens over :func:`windows`, where ``nll_of_window(begin, end,
    first)`` returns a window's summed NLL: how an engine or a peer that is not a module (the
    batching engine's prompt log-probabilities, llama.cpp's logits) is scored the same way."""
    total, count, nwin = 0.0, 0, 0
    for begin, end, first in windows(n, context, stride):
        total += nll_of_window(begin, end, first)
        count += end - first
        nwin += 1
    if count == 0:
        raise ValueError("perplexity needs at least two tokens")
    return Perplexity(math.exp(total / count), total / count, count, nwin)


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids.view(1, -1).to(model.device))[0].float()


@torch.inference_mode()
def perplexity_details(
    model: torch.nn.Module, token_ids: Sequence[int], context: int = 512, stride: int = 256
) -> Perplexity:
    """:func:`perplexity` with its parts: mean NLL, tokens scored, windows run."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    context = min(context, model.config.max_seq_len)

    def nll(begin: int, end: int, first: int) -> float:
        logp = torch.log_softmax(_logits(model, ids[begin:end]), dim=-1)
        pos = torch.arange(first - begin, end - begin)  # targets inside the window
        return float(-logp[pos - 1].gather(1, ids[begin:end][pos].view(-1, 1)).sum())

    return over_windows(nll, len(ids), context, min(stride, context))


def perplexity(
    model: torch.nn.Module, token_ids: Sequence[int], context: int = 512, stride: int = 256
) -> float:
    """Perplexity of ``model`` on ``token_ids``, sliding windows of ``context`` tokens by ``stride``."""
    return perplexity_details(model, token_ids, context, stride).perplexity


@dataclass
class Comparison:
    kl: float  # mean KL(reference || model) of the next-token distributions, nats
    kl_max: float  # the largest at any position
    greedy_agreement: float  # share of positions where both argmaxes are equal
    tokens: int


@torch.inference_mode()
def compare(
    reference: torch.nn.Module,
    model: torch.nn.Module,
    token_ids: Sequence[int],
    context: int = 512,
    stride: int = 256,
) -> Comparison:
    """How ``model``'s next-token distributions differ from ``reference``'s on the same windows."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    context = min(context, model.config.max_seq_len)
    kl_sum, kl_max, agree, count = 0.0, 0.0, 0, 0
    for begin, end, first in windows(len(ids), context, min(stride, context)):
        sel = torch.arange(first - begin, end - begin) - 1  # the positions that predict a target
        p = torch.log_softmax(_logits(reference, ids[begin:end])[sel], dim=-1)
        q = torch.log_softmax(_logits(model, ids[begin:end])[sel], dim=-1)
        kl = (p.exp() * (p - q)).sum(-1)
        kl_sum += float(kl.sum())
        kl_max = max(kl_max, float(kl.max()))
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        count += len(sel)
    return Comparison(kl_sum / count, kl_max, agree / count, count)


def book_text_ids(tokenizer, n_tokens: int = 4096, offset_chars: int = 1_000_000) -> list[int]:
    """``n_tokens`` of held-out text: a stretch of the book's corpus (``data/austen.txt``) from an
    offset away from its start. Raises FileNotFoundError outside a checkout of the book."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "data" / "austen.txt"
    if not path.is_file():
        raise FileNotFoundError(f"the book's corpus is not at {path}; pass a text file instead")
    with open(path, "rb") as f:
        f.seek(offset_chars)
        f.readline()  # start at a line boundary
        text = f.read(n_tokens * 8).decode("utf-8", errors="ignore")
    return tokenizer.encode(text)[:n_tokens]
