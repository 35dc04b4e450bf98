"""When a sequence is finished: one decision, made as each token is appended.

A sequence ends for one of a few reasons, and they are all checked here, in this order, each time
the scheduler appends a token (:meth:`llmlib.engine.scheduler.Scheduler.append_token`):

* ``"stop"``, an end token: the model's end-of-sequence token (unless the request ignores it) or
  one of the request's ``stop_token_ids``; the text ends before it (a stop token's own text is
  kept with ``include_stop_str_in_output``);
* ``"stop"``, a stop string: the token completes one of the request's ``stop`` strings in the
  text (once ``min_tokens`` are out); the text ends before it;
* ``"stop"``, a finished document: the request's grammar (structured output) is complete;
* ``"length"``: ``max_tokens`` reached, or the model's context is full.

The token goes through the sequence's text stream and grammar on the way (both are per-token
state that the decision reads), so nothing else in the engine has to look at it again. A request
that only scores its prompt (``max_tokens=0``) ends with it: :func:`prompt_only`.
"""

from __future__ import annotations

from llmlib.engine.sequence import Sequence


def prompt_only(seq: Sequence) -> str | None:
    """``"length"`` for a sequence that generates nothing (``max_tokens=0``), when its prompt is
    done; None otherwise."""
    return "length" if seq.max_tokens == 0 else None


def take(seq: Sequence, tok: int, max_model_len: int) -> str | None:
    """``tok`` was just appended to ``seq``: feed it to the sequence's text and grammar, and say
    why the sequence ends here (``"stop"`` or ``"length"``), or None if it goes on. The stop
    token or stop string that ended it is left in ``seq.stop_reason``."""
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
