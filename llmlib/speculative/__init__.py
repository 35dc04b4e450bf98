"""Speculative decoding (Going further 2): propose several tokens cheaply, verify them in one pass.

:class:`SpeculativeConfig` says what proposes (:mod:`.proposers`: prompt lookup, the model's own
first layers, a draft model); :mod:`.verify` decides which proposals the model keeps so the output
is exactly its own; :mod:`.decode` is the loop :class:`llmlib.Generator` runs with them.
"""

from __future__ import annotations

from llmlib.speculative.config import SPEC_HELP, SpeculativeConfig
from llmlib.speculative.decode import SpecStats, Speculator
from llmlib.speculative.proposers import (
    DraftModelProposer,
    EarlyExitProposer,
    NgramProposer,
    Proposal,
    Proposer,
    lookup,
)
from llmlib.speculative.verify import accept_greedy, accept_sampled, distributions

__all__ = [
    "SPEC_HELP",
    "DraftModelProposer",
    "EarlyExitProposer",
    "NgramProposer",
    "Proposal",
    "Proposer",
    "SpecStats",
    "SpeculativeConfig",
    "Speculator",
    "accept_greedy",
    "accept_sampled",
    "distributions",
    "lookup",
]
