"""Engine outputs as OpenAI's response bodies and stream chunks, log-probabilities included.

Two log-probability formats, as OpenAI defines them:

* completions (``logprobs: k``): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``,
  parallel lists with one entry per token; ``top_logprobs`` maps each of the k most likely
  tokens' text to its log-probability, with the chosen token added (vLLM's convention). With
  ``echo`` the prompt's tokens come first, the very first with ``null`` (nothing predicts it).
* chat (``logprobs: true, top_logprobs: k``): ``{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [...]}]}``.
"""

from __future__ import annotations

import time
from typing import Any

from llmlib.engine import CompletionOutput, RequestOutput, TokenLogprob
from llmlib.serve.client import EngineClient
from llmlib.serve.prepare import Prepared

FINISH = {"stop": "stop", "length": "length", "abort": "stop"}


def completion_logprobs(
    client: EngineClient,
    ids: list[int],
    entries: list[TokenLogprob | None],
    offset: int = 0,
) -> dict[str, list]:
    """The completions format for tokens ``ids`` (``entries[i]`` None where there is none)."""
    tokens, values, tops, offsets = [], [], [], []
    for tid, e in zip(ids, entries):
        s = client.token_str(tid)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if e is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(e.logprob)
        top = {client.token_str(t): v for t, v in e.top}
        top.setdefault(s, e.logprob)
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(client: EngineClient, entries: list[TokenLogprob]) -> dict[str, list]:
    def one(t: int, v: float) -> dict[str, Any]:
        return {"token": client.token_str(t), "logprob": v, "bytes": client.token_bytes(t)}

    return {
        "content": [
            {**one(e.token_id, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]}
            for e in entries
        ]
    }


def usage(prep: Prepared, finals: list[RequestOutput]) -> dict[str, Any]:
    prompt = sum(len(p) for p in prep.prompts)
    done = sum(len(o.token_ids) for r in finals for o in r.outputs)
    cached = sum(r.metrics.num_cached_tokens for r in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": done,
        "total_tokens": prompt + done,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _echo(client: EngineClient, prep: Prepared, p: int, out: RequestOutput) -> tuple[str, Any]:
    """The prompt's text and, when asked, its logprobs (completions ``echo``)."""
    text = prep.texts[p]
    if prep.logprobs is None:
        return text, None
    entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    return text, completion_logprobs(client, out.prompt_token_ids, entries)


def _merge(a: dict | None, b: dict | None) -> dict | None:
    if a is None or b is None:
        return a or b
    return {k: a[k] + b[k] for k in a}


def completion_body(
    client: EngineClient, rid: str, model: str, prep: Prepared, finals: list[RequestOutput]
) -> dict[str, Any]:
    """The whole response of a request that is not streamed."""
    choices = []
    n = prep.params.n
    for p, out in enumerate(finals):
        for o in out.outputs:
            if prep.chat:
                c: dict[str, Any] = {
                    "index": p * n + o.index,
                    "message": {"role": "assistant", "content": o.text},
                    "logprobs": chat_logprobs(client, o.logprobs or [])
                    if prep.logprobs is not None
                    else None,
                }
            else:
                text, lp = "", None
                if prep.echo:
                    text, lp = _echo(client, prep, p, out)
                gen_lp = None
                if prep.logprobs is not None:
                    gen_lp = completion_logprobs(client, o.token_ids, o.logprobs or [], len(text))
                c = {
                    "index": p * n + o.index,
                    "text": text + o.text,
                    "logprobs": _merge(lp, gen_lp),
                }
            c["finish_reason"] = FINISH.get(o.finish_reason or "stop", o.finish_reason)
            c["stop_reason"] = o.stop_reason
            choices.append(c)
    return {
        "id": rid,
        "object": "chat.completion" if prep.chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(prep, finals),
    }


class ChunkWriter:
    """Stream chunks for one request: per choice, the text and logprobs each step added."""

    def __init__(self, client: EngineClient, rid: str, model: str, prep: Prepared):
        self.client, self.rid, self.model, self.prep = client, rid, model, prep
        self.offsets: dict[int, int] = {}  # completions: text_offset of each choice's next token
        self.echoed: set[int] = set()
        self.object = "chat.completion.chunk" if prep.chat else "text_completion"
        self.created = int(time.time())

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        base = {"id": self.rid, "object": self.object, "created": self.created, "model": self.model}
        return {**base, "choices": choices, **extra}

    def first(self) -> list[dict[str, Any]]:
        """Chat: a chunk per choice opening the assistant's turn."""
        if not self.prep.chat:
            return []
        total = len(self.prep.prompts) * self.prep.params.n
        return [
            self.chunk(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
            for i in range(total)
        ]

    def step(self, p: int, out: RequestOutput, finished: set[int]) -> list[dict[str, Any]]:
        """Chunks for what output ``out`` of prompt ``p`` added; ``finished`` collects the
        indices that have sent their finish reason."""
        chunks = []
        n = self.prep.params.n
        for o in out.outputs:
            idx = p * n + o.index
            if idx in finished:
                continue
            new = bool(o.delta_text or o.delta_token_ids)
            echo = not self.prep.chat and self.prep.echo and idx not in self.echoed
            if new or echo:
                chunks.append(self.chunk([self._piece(p, idx, out, o, echo)]))
            if o.finished:
                finished.add(idx)
                reason = FINISH.get(o.finish_reason or "stop", o.finish_reason)
                delta: dict[str, Any] = {"delta": {}} if self.prep.chat else {"text": ""}
                chunks.append(
                    self.chunk(
                        [
                            {
                                "index": idx,
                                **delta,
                                "logprobs": None,
                                "finish_reason": reason,
                                "stop_reason": o.stop_reason,
                            }
                        ]
                    )
                )
        return chunks

    def _piece(self, p: int, idx: int, out: RequestOutput, o: CompletionOutput, echo: bool) -> dict:
        lp = None
        if self.prep.chat:
            if self.prep.logprobs is not None:
                lp = chat_logprobs(self.client, o.delta_logprobs or [])
            return {
                "index": idx,
                "delta": {"content": o.delta_text},
                "logprobs": lp,
                "finish_reason": None,
            }
        text = ""
        if echo:
            self.echoed.add(idx)
            text, lp = _echo(self.client, self.prep, p, out)
        if self.prep.logprobs is not None:
            off = len(text) if echo else self.offsets.get(idx, 0)
            gen = completion_logprobs(self.client, o.delta_token_ids, o.delta_logprobs or [], off)
            self.offsets[idx] = off + sum(len(t) for t in gen["tokens"])
            lp = _merge(lp, gen)
        return {"index": idx, "text": text + o.delta_text, "logprobs": lp, "finish_reason": None}
