"""The two collectives a tensor-parallel forward pass makes, and where they hook into the model.

The model code does not change: :func:`parallelize` takes one rank's model (built from
:func:`llmlib.parallel.shard.shard_config`'s shapes) and

* hooks an all-reduce onto the output of every layer's attention and FFN (each ends in a
  row-parallel product, ``wo`` and ``w_down``: its output is a partial sum over this rank's heads
  or FFN columns, and the sum over ranks is the layer's output);
* swaps the embedding for :class:`VocabParallelEmbedding`, which looks up the token ids in its
  vocabulary range, zeros the rest, and all-reduces.

The LM head's output stays split by vocabulary; :meth:`Comm.gather_logits` puts the pieces
together on rank 0, where the engine samples.

:class:`Comm` counts every all-reduce (calls, bytes, seconds), which is how Going further 4 measures
the share of a step spent communicating. On a GPU the seconds are only counted with
``timing=True``, which synchronises the device around each call (and so slows it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from llmlib.model.embedding import TokenEmbedding


class CollectiveError(RuntimeError):
    """A collective failed: a peer left, or did not answer within the group's timeout."""


@dataclass
class CommStats:
    calls: int = 0
    seconds: float = 0.0
    bytes: int = 0


class Comm:
    """One rank's view of its tensor-parallel group: ``rank`` of ``size``, and the collectives."""

    def __init__(self, group: Any, rank: int, size: int, *, timing: bool | None = None) -> None:
        self.group, self.rank, self.size = group, rank, size
        self.timing = timing
        self.stats = CommStats()
        # Off outside the engine's steps: rank 0's shard run on its own (``llm.model(ids)``)
        # would wait in its first all-reduce for ranks that are not running it.
        self.armed = True

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it."""
        if self.size == 1:
            return x
        if not self.armed:
            raise RuntimeError(
                "this is one rank's shard of a tensor-parallel model: it runs only inside the "
                "engine's steps (LLM.generate / LLM.step), where every rank runs it together"
            )
        cuda = x.is_cuda
        timed = self.timing if self.timing is not None else not cuda
        if timed and cuda:
            torch.cuda.synchronize(x.device)
        t0 = time.perf_counter()
        try:
            dist.all_reduce(x, group=self.group)
        except Exception as e:  # gloo/NCCL errors: a dead peer, a timeout
            raise CollectiveError(f"all-reduce failed on rank {self.rank}: {e}") from e
        if timed:
            if cuda:
                torch.cuda.synchronize(x.device)
            self.stats.seconds += time.perf_counter() - t0
        self.stats.calls += 1
        self.stats.bytes += x.numel() * x.element_size()
        return x

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Each rank's ``[n, V/N]`` logits -> ``[n, V]`` on rank 0 (None on the others)."""
        if self.size == 1:
            return local[..., :vocab_size]
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        try:
            # the group's own call (what dist.gather makes), so a group made without the
            # default one (the tests' threads) works too
            self.group.gather([parts] if parts else [], [local], opts).wait()
        except Exception as e:
            raise CollectiveError(f"logit gather failed on rank {self.rank}: {e}") from e
        return torch.cat(parts, dim=-1)[..., :vocab_size] if parts else None


class VocabParallelEmbedding(TokenEmbedding):
    """The embedding table's rows ``[start, stop)`` (padded to the same count on every rank):
    ids outside the range look up nothing here, and the all-reduce fills them in from the rank
    that holds them."""

    def __init__(self, table: TokenEmbedding, start: int, stop: int, comm: Comm) -> None:
        nn.Module.__init__(self)
        self.scale = table.scale
        self.table = [table]  # its lookup and LM head, kept out of the module tree
        self.weight = table.weight  # the same matrix: a tied LM head keeps reading it
        self.start, self.stop, self.comm = start, stop, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.stop)
        x = self.table[0](torch.where(mine, ids - self.start, 0))
        return self.comm.all_reduce(x.masked_fill(~mine.unsqueeze(-1), 0))

    def unembed(self, h: torch.Tensor) -> torch.Tensor:
        return self.table[0].unembed(h)


def _reduce_output(comm: Comm, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    return comm.all_reduce(out)


def parallelize(model: nn.Module, comm: Comm, vocab: tuple[int, int]) -> nn.Module:
    """Make one rank's model compute its share: all-reduces after attention and the FFN of every
    layer, and the vocabulary-parallel embedding over token ids ``vocab = (start, stop)``."""
    if getattr(model, "tp_comm", None) is not None:
        raise ValueError("this model is already parallelized")
    for layer in model.layers:
        layer.attn.register_forward_hook(lambda m, a, o: _reduce_output(comm, m, a, o))
        layer.ffn.register_forward_hook(lambda m, a, o: _reduce_output(comm, m, a, o))
    model.embed = VocabParallelEmbedding(model.embed, *vocab, comm)
    model.tp_comm = comm
    return model
