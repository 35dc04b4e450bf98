"""Speculative decoding in the batching engine: prompt lookup proposes, the step verifies.

Before each step, every running sequence that is decoding gets up to k proposed tokens from
prompt lookup (:func:`llmlib.speculative.proposers.lookup`, no model needed). The scheduler
gives it slots for them (:meth:`~llmlib.engine.block_manager.BlockManager.append_slots` with a
lookahead), the runner scores the pending token and the proposals in the same forward pass as
the other sequences' work and keeps the ones the model agrees with
(:meth:`~llmlib.engine.runner.ModelRunner._verify`), and the scheduler returns the blocks that
only refused proposals held (:meth:`~llmlib.engine.block_manager.BlockManager.trim`).

Sequences whose next token depends on more than the model's distribution decode plainly:
penalties and logit bias (they depend on every earlier token), log-probabilities, structured
output, and ``min_tokens`` not yet reached.
"""

from __future__ import annotations

from collections.abc import Iterable

from llmlib.engine.sequence import Sequence
from llmlib.speculative.config import SpeculativeConfig
from llmlib.speculative.proposers import lookup


class EngineSpeculator:
    """Prompt-lookup proposals for the running sequences of a batching engine."""

    def __init__(self, spec: SpeculativeConfig) -> None:
        if spec.method != "ngram":
            raise ValueError(
                f"LLM speculates with method='ngram' only for now, got {spec.method!r} "
                f"(llmlib.Generator runs early_exit and draft)"
            )
        self.spec = spec

    def propose(self, running: Iterable[Sequence], max_model_len: int) -> None:
        """Set ``draft_tokens`` on every running sequence (empty where it decodes plainly)."""
        s = self.spec
        for seq in running:
            seq.draft_tokens = []
            p = seq.params
            if (
                seq.num_computed_tokens != seq.num_tokens - 1
                or seq.num_output_tokens == 0
                or seq.forks
                or seq.matcher is not None
                or p is None
                or p.penalized
                or p.logprobs is not None
                or seq.num_output_tokens < p.min_tokens
            ):
                continue
            k = min(
                s.num_speculative_tokens,
                seq.max_tokens - seq.num_output_tokens - 1,
                max_model_len - seq.num_tokens - 1,
            )
            if k > 0:
                seq.draft_tokens = lookup(
                    seq.token_ids, k, s.prompt_lookup_min, s.prompt_lookup_max
                )


def engine_speculator(spec: SpeculativeConfig | None, sharded: bool) -> EngineSpeculator | None:
    if spec is None:
        return None
    if not isinstance(spec, SpeculativeConfig):
        raise TypeError(
            f"speculative_config must be a SpeculativeConfig, got {type(spec).__name__}"
        )
    if sharded:
        raise ValueError("LLM: speculative decoding with tensor_parallel_size > 1 is not supported")
    return EngineSpeculator(spec)
