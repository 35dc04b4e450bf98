"""One request's state in the engine beyond what the scheduler sees: its choices' text, their
log-probabilities, and what is reported back (:class:`~llmlib.engine.outputs.RequestOutput`).

A request has one :class:`Choice` per completion asked for (``SamplingParams.n``); each choice is
its own :class:`~llmlib.engine.sequence.Sequence` with its own random stream, text stream and
grammar position. Only the first choice's sequence is scheduled at first: when its prompt is done,
the others are forked from it (:meth:`llmlib.engine.block_manager.BlockManager.fork`).
"""

from __future__ import annotations

from collections.abc import Callable
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
    """One completion of a request: its sequence, random stream, text and log-probabilities."""

    def __init__(
        self,
        index: int,
        seq: Sequence,
        params: SamplingParams,
        generator: torch.Generator | None,
        tokenizer: Any,
    ) -> None:
        self.index, self.seq, self.params, self.generator = index, seq, params, generator
        self.text = TextStream(
            tokenizer.id_to_bytes if tokenizer is not None else None,
            params.stop,
            include_stop=params.include_stop_str_in_output,
        )
        self.tokens_emitted = 0
        self.tokens_seen = 0  # output tokens already turned into text
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.stop_reason: str | int | None = None

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

    def took_token(
        self, logprob: TokenLogprob | None, finish: Callable[[Sequence, str], None]
    ) -> None:
        """A choice's sequence got its next token (or finished scoring its prompt): record its
        log-probability, advance its grammar, turn it into text, end it on a stop string."""
        seq, params, choice = self.seq, self.params, self
        if seq.num_output_tokens == choice.tokens_seen:  # max_tokens=0: nothing was generated
            choice.text.close()
            return
        if seq.num_output_tokens > choice.tokens_seen + 1 and self._took_kept(finish):
            return  # speculative decoding kept several tokens, and a stop string ended them
        choice.tokens_seen = seq.num_output_tokens
        tok = seq.token_ids[-1]
        if choice.logprobs is not None and logprob is not None:
            choice.logprobs.append(logprob)
        grammar_done = False
        if seq.matcher is not None:
            seq.matcher.consume(tok)
            grammar_done = seq.matcher.done
        if grammar_done and not seq.is_finished:
            finish(seq, "stop")  # a complete document (under ignore_eos)
        if seq.finish_reason == "stop" and (seq.ends_on(tok) or tok in seq.eos_token_ids):
            if tok in seq.stop_token_ids:
                choice.stop_reason = tok
                if params.include_stop_str_in_output:
                    choice.text.add_token(tok, check_stop=False)
            choice.text.close()  # the end token ends the text without being part of it
            return
        check = seq.num_output_tokens >= params.min_tokens
        if choice.text.add_token(tok, check_stop=check):  # a stop string: the text ends before it
            choice.stop_reason = choice.text.stop_str
            if seq.is_finished:
                seq.finish_reason = "stop"  # the same token also reached max_tokens
            else:
                finish(seq, "stop")
        elif seq.is_finished:
            choice.text.close()

    def _took_kept(self, finish: Callable[[Sequence, str], None]) -> bool:
        """Speculative decoding appended several tokens: look for a stop string in all but the last
        (which :meth:`Choice.took_token` then takes as ever). A stop string ends the sequence there,
        and the tokens after it are dropped, as if they had never been decoded."""
        seq, first = self.seq, self.tokens_seen
        kept = seq.output_token_ids[first:-1]
        for j, tok in enumerate(kept):
            self.tokens_seen = first + j + 1
            if self.text.add_token(tok, check_stop=True):
                self.stop_reason = self.text.stop_str
                del seq.token_ids[seq.num_prompt_tokens + self.tokens_seen :]
                if seq.is_finished:
                    seq.finish_reason = "stop"
                else:
                    finish(seq, "stop")
                return True
        return False


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
