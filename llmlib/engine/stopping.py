"""When a sequence is finished, decided as each token is appended, and what must hold before.

Checked here, in this order, each time the scheduler appends a token
(:meth:`llmlib.engine.scheduler.Scheduler.append_token`):

* ``"stop"``, an end token: the model's end-of-sequence token (unless ignored) or one of the
  request's ``stop_token_ids``; the text ends before it (unless ``include_stop_str_in_output``);
* ``"stop"``, a ``stop`` string completed in the text (after ``min_tokens``); text ends before it;
* ``"stop"``, a finished document: the request's grammar (structured output) is complete;
* ``"length"``: ``max_tokens`` reached, or the model's context is full.

The token feeds the sequence's text stream and grammar on the way, so nothing else looks at it
again. A request that only scores its prompt (``max_tokens=0``) ends by :func:`prompt_only`.

Before: a request must fit the context (:func:`check_length`, the one check, for the engine, the
Generator and the server), and a sequence may not sample what would end it before it may end
(:func:`constrain`). The batching engine and the Generator (chapter 8's loop) both use these.
"""

from __future__ import annotations

import torch

from llmlib.engine.sequence import Sequence
from llmlib.structured import allowed


class ContextLengthError(ValueError):
    """A request too long for the context; ``field`` (``"prompt"``, ``"max_tokens"``) tells a
    server which field to blame."""

    def __init__(self, field: str, prompt_len: int, max_tokens: int, context: int) -> None:
        self.field, self.prompt_len, self.max_tokens, self.context = (
            field,
            prompt_len,
            max_tokens,
            context,
        )
        super().__init__(self.describe())

    def describe(self, prompt: str = "prompt", max_tokens: str = "max_tokens") -> str:
        """The message, naming the request's fields as its caller calls them."""
        if self.field == "prompt":
            return (
                f"the {prompt} is {self.prompt_len} tokens, which leaves no room in the model's "
                f"context of {self.context} tokens"
            )
        return (
            f"{max_tokens} is {self.max_tokens}, but the {prompt} ({self.prompt_len} tokens) "
            f"leaves only {self.context - self.prompt_len} of the model's context of "
            f"{self.context} tokens"
        )


def check_length(prompt_len: int, max_tokens: int, context: int) -> None:
    """Raise :class:`ContextLengthError` unless a prompt of ``prompt_len`` tokens leaves room for
    at least one token and for ``max_tokens`` (0: the prompt is only scored) within ``context``."""
    if prompt_len >= context:
        raise ContextLengthError("prompt", prompt_len, max_tokens, context)
    if prompt_len + max_tokens > context:
        raise ContextLengthError("max_tokens", prompt_len, max_tokens, context)


def prompt_only(seq: Sequence) -> str | None:
    """``"length"`` once the prompt is done, for a sequence with ``max_tokens=0``; else None."""
    return "length" if seq.max_tokens == 0 else None


def take(seq: Sequence, tok: int, max_model_len: int) -> str | None:
    """Feed the just-appended ``tok`` to ``seq``'s text and grammar; say why it ends (``"stop"``,
    ``"length"``; the stop token or string in ``seq.stop_reason``), or None."""
    text, params = seq.text, seq.params
    grammar_done = False
    if seq.matcher is not None:
        seq.matcher.consume(tok)
        grammar_done = seq.matcher.done
    # an end token; or EOS under ignore_eos once the grammar's document is complete
    if seq.ends_on(tok) or (grammar_done and tok in seq.eos_token_ids):
        if tok in seq.stop_token_ids:
            seq.stop_reason = tok
            if text is not None and params.include_stop_str_in_output:
                text.add_token(tok, check_stop=False)
        if text is not None:
            text.close()  # the end token ends the text without being part of it
        return "stop"
    if text is not None:
        check = seq.num_output_tokens >= params.min_tokens
        if text.add_token(tok, check_stop=check):  # a stop string: the text ends before it
            seq.stop_reason = text.stop_str
            return "stop"
    if grammar_done:
        reason = "stop"  # a complete document (under ignore_eos)
    elif seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= max_model_len:
        reason = "length"
    else:
        return None
    if text is not None:
        text.close()
    return reason


def constrain(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Mask what a sequence may not sample: its end tokens before ``min_tokens``, and whatever
    its grammar forbids (structured output). A grammar that allows only end tokens wins."""
    banned = [i for i, s in enumerate(seqs) if s.num_output_tokens < (s.params.min_tokens or 0)]
    matched = [i for i, s in enumerate(seqs) if s.matcher is not None]
    if not banned and not matched:
        return logits
    logits = logits.clone()
    V = logits.shape[1]
    if matched:
        allow = allowed([seqs[i].matcher for i in matched], min(V, _vocab(seqs)), logits.device)
        keep = torch.zeros(len(matched), V, dtype=torch.bool, device=logits.device)
        keep[:, : allow.shape[1]] = allow
        logits[matched] = logits[matched].masked_fill(~keep, float("-inf"))
    for i in banned:
        s = seqs[i]
        ends = [
            t
            for t in (s.stop_token_ids | (s.eos_token_ids if not s.ignore_eos else set()))
            if t < V
        ]
        if ends:
            row = logits[i].clone()
            row[ends] = float("-inf")
            if torch.isfinite(row).any():
                logits[i] = row
    return logits


def _vocab(seqs: list[Sequence]) -> int:
    return min(s.matcher.vocab for s in seqs if s.matcher is not None)
