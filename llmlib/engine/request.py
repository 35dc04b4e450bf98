"""One request's state in the engine beyond what the scheduler sees: its choices' text, their
log-probabilities, and what is reported back (:class:`~llmlib.engine.outputs.RequestOutput`).

A request has one :class:`Choice` per completion asked for (``SamplingParams.n``); each choice is
its own :class:`~llmlib.engine.sequence.Sequence` with its own random stream, text stream and
grammar position. Only the first choice's sequence is scheduled at first: when its prompt is done,
the others are forked from it (:meth:`llmlib.engine.block_manager.BlockManager.fork`).
"""

from __future__ import annotations

from typing import Any

import torch

from llmlib.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from llmlib.engine.sequence import Sequence
from llmlib.sampling import SamplingParams
from llmlib.text import TextStream


def choice_generator(params: SamplingParams, index: int, device: Any) -> torch.Generator | None:
    """Choice ``index``'s random stream: seed ``seed + index`` (None when unseeded)."""
    if params.seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed((params.seed + index) % 2**64)
    return g


class Choice:
    """One completion of a request: its sequence (which holds its text stream), random stream
    and log-probabilities."""

    def __init__(
        self,
        index: int,
        seq: Sequence,
        params: SamplingParams,
        generator: torch.Generator | None,
        tokenizer: Any,
    ) -> None:
        self.index, self.seq, self.params, self.generator = index, seq, params, generator
        seq.text = TextStream(
            tokenizer.id_to_bytes if tokenizer is not None else None,
            params.stop,
            include_stop=params.include_stop_str_in_output,
        )
        self.tokens_emitted = 0
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None

    @property
    def text(self) -> TextStream:
        return self.seq.text

    @property
    def stop_reason(self) -> str | int | None:
        return self.seq.stop_reason

    def output(self) -> CompletionOutput:
        """The choice so far, with what the last step added as its deltas (taken once)."""
        s = self.seq
        delta_text = self.text.delta()
        out_ids = s.output_token_ids
        delta_ids = out_ids[self.tokens_emitted :]
        delta_lp = None
        if self.logprobs is not None:
            delta_lp = self.logprobs[self.tokens_emitted : len(out_ids)]
        self.tokens_emitted = len(out_ids)
        return CompletionOutput(
            index=self.index,
            text=self.text.text[: self.text.emitted],
            token_ids=list(out_ids),
            finish_reason=s.finish_reason,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            delta_text=delta_text,
            delta_token_ids=delta_ids,
            delta_logprobs=delta_lp,
            stop_reason=self.stop_reason,
        )

    def took_token(self, logprob: TokenLogprob | None) -> None:
        """A choice's sequence got its next token(s): record the log-probability sampled with it.
        (Its text, grammar and end were already settled as the token was appended:
        :mod:`llmlib.engine.stopping`.)"""
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)


class EngineRequest:
    """A request: its prompt, params, choices, and prompt log-probabilities."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams,
        choices: list[Choice],
    ) -> None:
        self.request_id, self.prompt, self.params, self.choices = (
            request_id,
            prompt,
            params,
            choices,
        )
        n = choices[0].seq.num_prompt_tokens
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] * n if params.prompt_logprobs is not None else None
        )

    @property
    def finished(self) -> bool:
        return all(c.seq.is_finished for c in self.choices)

    def output(self) -> RequestOutput:
        first = self.choices[0].seq
        seqs = [c.seq for c in self.choices]
        done = [s.finished_time for s in seqs if s.finished_time is not None]
        m = RequestMetrics(
            arrival_time=first.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=first.first_token_time,
            finished_time=max(done) if len(done) == len(seqs) else None,
            num_prompt_tokens=first.num_prompt_tokens,
            num_cached_tokens=first.prompt_cached_tokens,
            num_generated_tokens=sum(s.num_output_tokens for s in seqs),
            num_preemptions=sum(s.num_preemptions for s in seqs),
        )
        return RequestOutput(
            self.request_id,
            self.prompt,
            list(first.prompt_token_ids),
            [c.output() for c in self.choices],
            m,
            None if self.prompt_logprobs is None else list(self.prompt_logprobs),
        )
