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
class RequestOutput:
    """One request's state as the engine reports it (after a step, or at the end).

    ``text`` and ``token_ids`` are cumulative (``cumulative`` is True); ``delta_text`` and
    ``delta_token_ids`` are what this step added, for streaming. ``finish_reason`` is None while
    the request runs, then ``"stop"`` (EOS or a stop string), ``"length"`` or ``"abort"``.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    metrics: RequestMetrics
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    cumulative: bool = True

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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

    @property
    def block_usage(self) -> float:
        """Fraction of the pool held by sequences right now."""
        return self.used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def waste(self) -> float:
        """Allocated-but-unused share of the KV memory in use, averaged over steps."""
        return 1.0 - self.slots_used / self.slots_allocated if self.slots_allocated else 0.0
