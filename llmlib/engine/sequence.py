"""One request as the scheduler and the block manager see it: its tokens, blocks and progress.

The block manager needs only a narrow view of a sequence (:class:`SequenceView`: its tokens, its
block table and how many of its tokens are in the cache); the scheduler the whole
:class:`Sequence`; the model runner a :class:`ScheduledChunk` per scheduled sequence and step.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from llmlib.sampling import SamplingParams
from llmlib.text import TextStream


class SequenceView(Protocol):
    """What :class:`~llmlib.engine.block_manager.BlockManager` reads and writes on a sequence."""

    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int  # tokens whose keys/values are in the pool
    num_cached_tokens: int  # of those, how many the prefix cache supplied

    @property
    def num_prompt_tokens(self) -> int: ...  # read where generated blocks are hashed apart


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request as the scheduler sees it: tokens, blocks, progress and timings."""

    seq_id: int
    prompt_token_ids: list[int]
    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    params: SamplingParams = field(default_factory=SamplingParams)  # the request's own
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose keys/values are in the cache
    num_cached_tokens: int = 0  # of those, how many came from the prefix cache at admission
    finish_reason: str | None = None
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    prompt_cached_tokens: int = 0  # prefix-cache hits on the first admission (for metrics)
    stop_token_ids: frozenset[int] = frozenset()  # end it like EOS, even under ignore_eos
    use_prefix_cache: bool = True  # False when every prompt position's logits are wanted
    # n > 1: the other choices, made when the prompt is done by forking its KV blocks
    forks: list[Sequence] = field(default_factory=list)
    matcher: Any = None  # structured output: the grammar position (llmlib.structured.Matcher)
    # speculative decoding: tokens proposed to follow token_ids, verified in the next step
    draft_tokens: list[int] = field(default_factory=list)
    text: TextStream | None = None  # its text so far (stop strings are found there)
    stop_reason: int | str | None = None  # the stop token or stop string that ended it

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("Sequence: prompt_token_ids must not be empty")
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def ends_on(self, token: int) -> bool:
        """Does sampling ``token`` end this sequence (EOS, unless ignored; or a stop token)?"""
        return (not self.ignore_eos and token in self.eos_token_ids) or token in self.stop_token_ids


@dataclass
class ScheduledChunk:
    """Compute tokens ``start .. start + length - 1`` of ``seq`` in this step."""

    seq: Sequence
    start: int
    length: int
    draft: list[int] = field(default_factory=list)  # proposed tokens scored after the chunk
    draft_probs: Any = None  # [k, V]: the draft model's distributions (None: one-hot drafts)

    @property
    def samples(self) -> bool:
        """Does this chunk reach the sequence's last token (so a next token is sampled)?"""
        return self.start + self.length == self.seq.num_tokens
