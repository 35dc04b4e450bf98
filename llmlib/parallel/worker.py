"""One tensor-parallel rank: its shard, its part of the KV pool, and the loop that serves the driver.

Every rank, the driver's own included, holds a :class:`Rank` and runs each command through
:meth:`Rank.handle`; the workers (ranks ``1 .. N-1``) get their commands in :func:`serve`, the
driver calls ``handle`` itself after sending. A step is the engine's own forward pass
(:meth:`llmlib.engine.runner.ModelRunner.forward_packed`) over this rank's model and pool, then
the logit gather to rank 0.

``python -m llmlib.parallel.worker`` is a worker: llmlib's launcher starts it with torchrun's
environment variables, and under ``torchrun`` every rank but 0 ends up here too.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import sys
import time
from dataclasses import astuple, dataclass, fields
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from llmlib.engine.runner import ModelRunner
from llmlib.parallel import plan as P
from llmlib.parallel.comm import CollectiveError, Comm, parallelize
from llmlib.parallel.group import (
    DistEnv,
    Groups,
    Spec,
    TensorParallelError,
    close_groups,
    connect,
    init_groups,
    report_error,
)
from llmlib.parallel.load import load_shard, weight_bytes
from llmlib.parallel.shard import vocab_range


@dataclass
class RankReport:
    """What one rank says about itself (:meth:`llmlib.LLM.tensor_parallel_report`)."""

    rank: int
    pid: int
    weight_bytes: int  # every parameter this rank holds
    shard_bytes: int  # what its shape table says it should hold
    replicated_bytes: int  # of which every rank holds the same (norms, routers)
    model_bytes: int  # the whole model's tensors at the same element size
    num_blocks: int  # its KV pool, in blocks (the same block ids on every rank)
    pool_bytes: int  # its part of the pool (its KV heads only)
    held_blocks: int  # blocks the sequences in flight hold, as this rank's mirror sees them
    live_sequences: int
    steps: int
    step_seconds: float  # from a step's plan arriving to its logits gathered
    allreduce_calls: int
    allreduce_seconds: float  # 0 where not timed (on a GPU unless TPOptions(timing=True))
    allreduce_bytes: int
    rss_bytes: int  # the process's resident memory now
    load_seconds: float

    @property
    def allreduce_share(self) -> float:
        """Fraction of this rank's step time spent inside all-reduces."""
        return self.allreduce_seconds / self.step_seconds if self.step_seconds else 0.0


def _rss() -> int:
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Rank:
    """One rank's model shard, KV pool and block-table mirror, and what it does per command."""

    def __init__(self, spec: Spec, env: DistEnv, groups: Groups, model: Any, cfg: Any) -> None:
        self.spec, self.env, self.groups, self.cfg = spec, env, groups, cfg
        self.comm = Comm(groups.compute, env.rank, env.world_size, timing=spec.timing)
        self.model = parallelize(model, self.comm, vocab_range(cfg, spec.tp, env.rank))
        self.comm.armed = False  # only the steps below run it
        self.runner: ModelRunner | None = None
        self.tables: P.BlockTables | None = None
        self.steps, self.step_seconds, self.load_seconds = 0, 0.0, 0.0

    @torch.inference_mode()
    def handle(self, cmd: int, released: list[int], payload: list[int]) -> Any:
        """Run one command; a step returns the gathered logits on rank 0 (None elsewhere)."""
        if self.tables is not None:
            self.tables.release(released)
        if cmd == P.STEP:
            if self.runner is None or self.tables is None:
                raise RuntimeError("a step before the KV pool was made")
            t0 = time.perf_counter()
            chunks, ids, select = self.tables.decode_step(payload)
            self.comm.armed = True
            try:
                local = self.runner.forward_packed(chunks, ids, select)
            finally:
                self.comm.armed = False
            out = self.comm.gather_logits(local, self.cfg.vocab_size)
            self.steps += 1
            self.step_seconds += time.perf_counter() - t0
            return out
        if cmd == P.POOL:
            num_blocks, block_size = payload
            self.runner = ModelRunner(self.model, num_blocks, block_size)
            self.tables = P.BlockTables(num_blocks)
            return None
        if cmd == P.COPY:  # a forked sequence's copy-on-write blocks, in this rank's pool
            if self.runner is None:
                raise RuntimeError("a block copy before the KV pool was made")
            self.runner.copy_blocks(list(zip(payload[0::2], payload[1::2])))
            return None
        if cmd == P.REPORT:
            return self._report()
        if cmd == P.RESET:
            self.steps, self.step_seconds = 0, 0.0
            self.comm.stats.__init__()
            return None
        if cmd in (P.PING, P.SHUTDOWN):
            return None
        raise ValueError(f"unknown command {cmd} from the driver (driver and worker out of step?)")

    def report(self) -> RankReport:
        w = weight_bytes(self.model, self.cfg, self.spec.tp)
        cache = self.runner.cache if self.runner is not None else None
        tables = self.tables
        s = self.comm.stats
        return RankReport(
            self.env.rank,
            os.getpid(),
            w.held,
            w.expected,
            w.replicated,
            w.full,
            cache.num_blocks if cache else 0,
            cache.nbytes if cache else 0,
            tables.held_blocks() if tables else 0,
            len(tables.tables) if tables else 0,
            self.steps,
            self.step_seconds,
            s.calls,
            s.seconds,
            s.bytes,
            _rss(),
            self.load_seconds,
        )

    def _report(self) -> list[RankReport] | None:
        """Every rank's :class:`RankReport`, gathered on rank 0 over the control group."""
        mine = torch.tensor([float(x) for x in astuple(self.report())], dtype=torch.float64)
        n = self.env.world_size
        parts = [torch.empty_like(mine) for _ in range(n)] if self.env.rank == 0 else None
        try:
            dist.gather(mine, parts, dst=0, group=self.groups.control)
        except Exception as e:
            raise CollectiveError(f"report gather failed on rank {self.env.rank}: {e}") from e
        if parts is None:
            return None
        kinds = [f.type for f in fields(RankReport)]
        return [
            RankReport(*(float(v) if k == "float" else int(v) for k, v in zip(kinds, p.tolist())))
            for p in parts
        ]


def _startup_timeout() -> float:
    from llmlib.kernels.flags import flags

    return flags().tp_startup_timeout


def build_rank(spec: Spec, env: DistEnv, store: Any, local: bool) -> Rank:
    """Load this rank's shard, tell the store, join the groups: a :class:`Rank` ready for work."""
    if spec.tp != env.world_size:
        raise TensorParallelError(
            f"the driver asks for tensor_parallel_size={spec.tp} but {env.world_size} ranks started"
        )
    device = "cpu"
    if spec.device == "cuda":
        if env.local_rank >= torch.cuda.device_count():
            raise TensorParallelError(
                f"rank {env.rank}: LOCAL_RANK {env.local_rank} but this machine has "
                f"{torch.cuda.device_count()} GPU(s)"
            )
        torch.cuda.set_device(env.local_rank)
        device = f"cuda:{env.local_rank}"
    t0 = time.perf_counter()
    model, cfg = load_shard(spec.path, spec.tp, env.rank, device, spec.dtype)
    load_s = time.perf_counter() - t0
    store.set(f"loaded/{env.rank}", str(os.getpid()))
    # the driver says when every rank has loaded: only then do the groups' timeouts start
    store.wait(["init"], timedelta(seconds=_startup_timeout()))
    groups = init_groups(
        store,
        env.rank,
        env.world_size,
        spec.device,
        spec.timeout_s,
        spec.control_timeout_s,
        local,
        env.local_rank,
    )
    rank = Rank(spec, env, groups, model, cfg)
    rank.load_seconds = load_s
    return rank


def receive(groups: Groups) -> tuple[int, list[int], list[int]]:
    """The driver's next command: ``(command, released seq ids, payload)``."""
    header = torch.empty(3, dtype=torch.int64)
    try:
        dist.broadcast(header, src=0, group=groups.control)
        cmd, n_rel, n_pay = header.tolist()
        body = torch.empty(n_rel + n_pay, dtype=torch.int64)
        if n_rel + n_pay:
            dist.broadcast(body, src=0, group=groups.control)
    except Exception as e:
        raise CollectiveError(f"no command from the driver: {e}") from e
    values = body.tolist()
    return cmd, values[:n_rel], values[n_rel:]


def serve(rank: Rank) -> None:
    """Run the driver's commands until it says shut down."""
    while True:
        cmd, released, payload = receive(rank.groups)
        rank.handle(cmd, released, payload)
        if cmd == P.SHUTDOWN:
            return


def main(argv: list[str] | None = None) -> int:
    """A worker's life: join the store, read the spec, load, serve; report any failure."""
    env = DistEnv.from_env()
    if env is None:
        print(
            "llmlib.parallel.worker: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are not set; "
            "workers are started by llmlib (LLM(..., tensor_parallel_size=N)) or by torchrun",
            file=sys.stderr,
        )
        return 2
    store = None
    try:
        from llmlib.kernels.flags import flags

        local = flags().tp_local
        store = connect(env, _startup_timeout())
        store.set(f"hello/{env.rank}", f"{os.getpid()}@{socket.gethostname()}")
        store.wait(["spec"], timedelta(seconds=_startup_timeout()))
        spec = Spec.from_json(store.get("spec"))
        serve(build_rank(spec, env, store, local))
        return 0
    except BaseException as e:
        if store is not None:
            report_error(store, env.rank, e, isinstance(e, CollectiveError))
        if not isinstance(e, CollectiveError):
            import traceback

            traceback.print_exc()
        else:
            print(f"llmlib tp rank {env.rank}: {e}", file=sys.stderr)
        return 1
    finally:
        close_groups()


if __name__ == "__main__":
    sys.exit(main())
