"""From sampled tokens to the text a user sees: one pipeline for every request, streamed or not.

The Generator (one request), the batching engine (many) and through it the server all turn
token ids back into text the same way, with :class:`TextStream`:

* **UTF-8 across tokens.** Byte-level BPE may split one character over several tokens (an emoji,
  a Chinese character), so bytes go through an incremental UTF-8 decoder that holds back an
  incomplete character until its last byte arrives (a dangling one becomes U+FFFD at the end).
* **Stop strings.** A stop string ends generation and is not part of the text. It may arrive
  split over tokens, so only the region the newest piece could complete is searched
  (:func:`find_stop`).
* **Held-back text.** While streaming, characters that could still turn out to be the start of a
  stop string are not handed out yet (:func:`held_back`); they are released when the next token
  proves them innocent, or at the end.

End-of-sequence tokens are decided by token id, not by text, so the caller handles them: it
closes the stream instead of adding the token.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence


def find_stop(text: str, stops: Sequence[str], new_from: int) -> int | None:
    """Earliest index where a stop string starts, looking only where the newest piece could complete one."""
    best = None
    for s in stops:
        i = text.find(s, max(0, new_from - len(s) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters could still be the start of a stop string (not safe to emit yet)."""
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return hold


class TextStream:
    """One request's text: add tokens as they are sampled, take the safe new text as it appears.

    ``id_to_bytes`` is the tokenizer's (``None`` for an engine serving token ids only: the text
    then stays empty). After a stop string is found (:meth:`add_token` returns True) or the
    stream is closed, no more tokens may be added and :meth:`delta` releases everything left.
    """

    def __init__(
        self,
        id_to_bytes: Callable[[int], bytes] | None,
        stop: Sequence[str] = (),
        include_stop: bool = False,
    ) -> None:
        self.id_to_bytes = id_to_bytes
        self.stop = list(stop)
        self.include_stop = include_stop  # keep the stop string that ended the text in it
        self.stop_str: str | None = None  # the stop string that ended the text, once one did
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""  # everything decoded so far, cut before a stop string once one is found
        self.emitted = 0  # characters of text already handed out by delta()
        self.stopped = False  # a stop string ended the text
        self.closed = False

    @property
    def done(self) -> bool:
        return self.stopped or self.closed

    def add_token(self, token_id: int, check_stop: bool = True) -> bool:
        """Decode one more token; True if its text completed a stop string (generation must end).

        ``check_stop=False`` adds the text without looking for stop strings (before a request's
        ``min_tokens``)."""
        if self.done:
            raise RuntimeError("TextStream: no tokens may follow a stop string or close()")
        if self.id_to_bytes is None:
            return False
        piece = self._decoder.decode(self.id_to_bytes(token_id))
        self.text += piece
        if self.stop and check_stop:
            hit = find_stop(self.text, self.stop, len(self.text) - len(piece))
            if hit is not None:
                self.stop_str = max((s for s in self.stop if self.text.startswith(s, hit)), key=len)
                end = hit + len(self.stop_str) if self.include_stop else hit
                self.text = self.text[:end]
                self.stopped = True
                return True
        return False

    def close(self) -> None:
        """No more tokens (EOS or a length limit): a dangling partial character becomes U+FFFD."""
        if not self.done:
            self.text += self._decoder.decode(b"", final=True)
        self.closed = True

    def delta(self) -> str:
        """Text not handed out yet that is safe to hand out (all of it once the stream is done)."""
        visible = len(self.text) if self.done else len(self.text) - held_back(self.text, self.stop)
        visible = max(visible, self.emitted)
        out = self.text[self.emitted : visible]
        self.emitted = visible
        return out
