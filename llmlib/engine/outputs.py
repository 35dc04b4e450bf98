"""What the engine reports: one request's output and timings, and the engine's counters."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Timings (``time.perf_counter`` seconds) and counts of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_generated_tokens: int = 0
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return (
            None
            if self.first_scheduled_time is None
            else self.first_scheduled_time - self.arrival_time
        )


@dataclass
class TokenLogprob:
    """One position's log-probabilities: the token there, its log-probability and rank (1 = the
    most likely), and the ``k`` most likely tokens with theirs, best first. They are the
    log-softmax of the model's raw logits (before penalties, temperature and filters)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class CompletionOutput:
    """One choice of a request (``n`` of them when ``SamplingParams.n > 1``, index 0 otherwise).

    ``text``, ``token_ids`` and ``logprobs`` are cumulative; the ``delta_*`` fields are what the
    last step added, for streaming. ``finish_reason`` is None while the choice runs, then
    ``"stop"`` (EOS, a stop token or string, a complete structured output), ``"length"`` or
    ``"abort"``; ``stop_reason`` is the stop string or stop token that ended it, if one did.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token, when SamplingParams.logprobs
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request's state as the engine reports it (after a step, or at the end).

    ``outputs`` holds every choice (``outputs[i].index == i``); ``text``, ``token_ids``,
    ``finish_reason`` and the deltas read the first one, which is all there is when ``n`` is 1.
    ``prompt_logprobs`` (when asked for) has one entry per prompt token, None for the first.
    ``finished`` once every choice has finished.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cumulative: bool = True

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def delta_text(self) -> str:
        return self.outputs[0].delta_text

    @property
    def delta_token_ids(self) -> list[int]:
        return self.outputs[0].delta_token_ids

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs


@dataclass
class EngineStats:
    """What the engine did so far (reset with :meth:`LLM.reset_stats`)."""

    steps: int = 0
    forward_passes: int = 0
    prefill_tokens: int = 0  # tokens computed in prefill chunks (prompts and recomputes)
    decode_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache saved from being computed
    prefix_hit_blocks: int = 0
    preemptions: int = 0
    num_blocks: int = 0
    block_size: int = 0
    used_blocks: int = 0  # right now
    peak_used_blocks: int = 0
    slots_allocated: int = 0  # summed over steps: slots in blocks held by running sequences
    slots_used: int = 0  # summed over steps: of those, slots holding a token
    spec_proposed: int = 0  # speculative decoding: tokens proposed, and of those kept
    spec_accepted: int = 0

    @property
    def block_usage(self) -> float:
        """Fraction of the pool held by sequences right now."""
        return self.used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def waste(self) -> float:
        """Allocated-but-unused share of the KV memory in use, averaged over steps."""
        return 1.0 - self.slots_used / self.slots_allocated if self.slots_allocated else 0.0
