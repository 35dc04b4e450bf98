"""The driver: rank 0 of a tensor-parallel group, in the caller's process, beside the scheduler.

:func:`start` brings up ``N`` ranks: rank 0 here (it keeps the engine's scheduler, block
manager and sampling, and computes its own shard like any rank), ranks ``1 .. N-1`` as worker
processes it starts on this machine, or, under ``torchrun``, the ranks torchrun started. The
engine then runs through :class:`TPModelRunner`, a :class:`~llmlib.engine.runner.ModelRunner`
whose forward pass is: broadcast the step plan (:mod:`llmlib.parallel.plan`), run rank 0's
shard, gather the logits.

Failure is always an exception, never a hang:

* a split the model cannot take is refused before any process starts
  (:func:`llmlib.parallel.shard.check_engine_tp`), and so is a port already taken;
* every wait has a timeout: start-up (``startup_timeout_s``), each step's collectives
  (``timeout_s``), a worker's wait for the next command (the driver sends a heartbeat when idle);
* when a rank dies or fails, the driver says which and why (its error, left in the store, or
  its exit code or signal and last output), shuts the other ranks down, and raises
  :class:`~llmlib.parallel.group.TensorParallelError`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import weakref
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from llmlib.engine.run_mode import Steps
from llmlib.engine.runner import ModelRunner
from llmlib.parallel import plan as P
from llmlib.parallel.comm import CollectiveError
from llmlib.parallel.group import (
    DistEnv,
    LocalWorker,
    Spec,
    TensorParallelError,
    close_groups,
    connect,
    driver_store,
    exit_reason,
    listen,
    read_errors,
    report_error,
)
from llmlib.parallel.shard import check_engine_tp
from llmlib.parallel.worker import Rank, RankReport


@dataclass
class TPOptions:
    """How the group starts and how long anything may wait (seconds)."""

    host: str = "127.0.0.1"  # where the driver's store listens (one machine: loopback only)
    port: int = 0  # 0: any free port
    timeout_s: float = 120.0  # the longest one collective of a step may wait for the others
    startup_timeout_s: float = 600.0  # the longest the ranks may take to load their shards
    heartbeat_s: float = 5.0  # an idle driver pings its workers this often
    timing: bool | None = None  # time every all-reduce (default: on a CPU only)
    worker_env: dict[str, str] = field(default_factory=dict)  # extra environment for workers

    @property
    def control_timeout_s(self) -> float:
        return max(30.0, 6 * self.heartbeat_s)


class Driver:
    """Rank 0 and its link to the others: :meth:`send` a command to every rank, run it here."""

    def __init__(self, tp: int, spec: Spec, options: TPOptions, store: Any) -> None:
        self.tp, self.spec, self.options, self.store = tp, spec, options, store
        self.workers: dict[int, LocalWorker] = {}
        self.rank: Rank | None = None
        self.encoder = P.PlanEncoder()
        self._lock = threading.Lock()
        self._failure: TensorParallelError | None = None
        self._closed = False
        self._last_sent = time.monotonic()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    # ---- what the engine uses --------------------------------------------------------------------
    @property
    def model(self) -> Any:
        assert self.rank is not None
        return self.rank.model

    @property
    def config(self) -> Any:
        assert self.rank is not None
        return self.rank.cfg

    @property
    def pids(self) -> dict[int, int]:
        """Process id of every rank llmlib started (rank 0 is this process)."""
        return {0: os.getpid(), **{r: w.proc.pid for r, w in self.workers.items()}}

    def runner(self, num_blocks: int, block_size: int) -> TPModelRunner:
        return TPModelRunner(self, num_blocks, block_size)

    def send(self, cmd: int, payload: Seq[int] = ()) -> Any:
        """Tell every rank to run ``cmd``, run it here too, return rank 0's result.

        Every command but the heartbeat also tells the ranks which sequences have let go of
        their blocks since the last one (from the engine's thread, the one that changes them).
        """
        return self._send(cmd, lambda: list(payload))

    def step(self, chunks: Seq[Any], select: Seq[int]) -> Any:
        """One forward pass on every rank: the logits at ``select`` (on rank 0)."""
        return self._send(P.STEP, lambda: self.encoder.step(chunks, select))

    def _send(self, cmd: int, payload: Any) -> Any:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise TensorParallelError("the tensor-parallel group has been shut down")
        with self._lock:
            if self._failure is not None or self._closed:  # while this thread waited
                raise self._failure or TensorParallelError("the group has been shut down")
            if any(w.proc.poll() is not None for w in self.workers.values()):
                self._fail(None)
            released = [] if cmd == P.PING else self.encoder.releases()
            body = payload()
            try:
                self._broadcast(cmd, released, body)
                out = self.rank.handle(cmd, released, body)
            except Exception as e:
                self._fail(e)
            self._last_sent = time.monotonic()
            return out

    def _broadcast(self, cmd: int, released: list[int], payload: Seq[int]) -> None:
        """The command to every worker (:func:`llmlib.parallel.worker.receive` on their side)."""
        body = released + list(payload)
        try:
            dist.broadcast(P.pack([cmd, len(released), len(payload)]), 0, group=self._control)
            if body:
                dist.broadcast(P.pack(body), src=0, group=self._control)
        except Exception as e:  # gloo: a worker has gone
            raise CollectiveError(f"sending a command failed: {e}") from e

    @property
    def _control(self) -> Any:
        assert self.rank is not None
        return self.rank.groups.control

    def report(self) -> list[RankReport]:
        """Every rank's :class:`~llmlib.parallel.worker.RankReport` (weights, pool, timings)."""
        return self.send(P.REPORT)

    def reset_stats(self) -> None:
        self.send(P.RESET)

    # ---- failure ---------------------------------------------------------------------------------
    def explain(self, exc: BaseException | None, wait_s: float = 3.0) -> str:
        """Which rank failed and why: its own error if it left one, else how its process ended."""
        if exc is not None and not isinstance(exc, CollectiveError):  # the driver's own failure
            return f"rank 0 (pid {os.getpid()}, the driver): {type(exc).__name__}: {exc}"
        deadline = time.monotonic() + wait_s
        while True:
            errors = read_errors(self.store, self.tp)
            exited = {r: w.proc.poll() for r, w in self.workers.items()}
            exited = {r: c for r, c in exited.items() if c is not None}
            primary = [r for r, e in errors.items() if not e["in_collective"]]
            primary += [r for r in exited if r not in errors]
            if primary or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        lines = []
        for r in sorted(set(primary)) or sorted(errors):
            if r in errors and not (r in exited and errors[r]["in_collective"]):
                e = errors[r]
                lines.append(
                    f"rank {r} (pid {e['pid']} on {e['host']}): {e['type']}: {e['message']}"
                )
            elif r in exited:
                w = self.workers[r]
                tail = w.last_output()
                out = "\n    ".join(tail) if tail else "(no output)"
                lines.append(
                    f"rank {r} (pid {w.proc.pid}) {exit_reason(exited[r])}; its last output:\n    {out}"
                )
        return "; ".join(lines) or f"a collective failed: {exc}"

    def _fail(self, exc: BaseException | None) -> None:
        msg = self.explain(exc)
        self._failure = TensorParallelError(
            f"the tensor-parallel group lost a rank and was shut down: {msg}"
        )
        self._teardown(join_heartbeat=False)  # it may be waiting for the lock this holds
        raise self._failure from exc

    # ---- the end -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every rank and leave the process groups (idempotent)."""
        if self._closed:
            return
        if self._failure is None and self.rank is not None:
            if self._lock.acquire(timeout=self.options.timeout_s):
                try:
                    with contextlib.suppress(Exception):
                        self._broadcast(P.SHUTDOWN, [], [])
                finally:
                    self._lock.release()
        self._teardown()

    def _teardown(self, join_heartbeat: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        beat = self._beat
        if join_heartbeat and beat is not None and beat is not threading.current_thread():
            self._beat.join(self.options.heartbeat_s + 1)
        for w in self.workers.values():
            w.stop(grace_s=10.0 if self._failure is None else 0.5)
        close_groups()

    def _heartbeat(self) -> None:
        hb = self.options.heartbeat_s
        while not self._stop.wait(hb / 2):
            if time.monotonic() - self._last_sent >= hb:
                try:
                    self.send(P.PING)
                except TensorParallelError:
                    return  # recorded: the engine's next call raises it


class TPModelRunner(ModelRunner):
    """The engine's runner under tensor parallelism: each forward pass runs on every rank."""

    def __init__(self, driver: Driver, num_blocks: int, block_size: int) -> None:
        # no super().__init__: the pool is rank 0's, made by the POOL command on every rank
        driver.send(P.POOL, [num_blocks, block_size])
        # every rank answers, so a rank that could not make its pool fails here, not later
        pools = {(r.num_blocks, r.pool_bytes) for r in driver.report()}
        if len(pools) != 1:
            raise TensorParallelError(f"the ranks' KV pools differ: {sorted(pools)}")
        assert driver.rank is not None and driver.rank.runner is not None
        self.driver = driver
        self.model, self.cache = driver.model, driver.rank.runner.cache
        self.device, self.dtype = self.cache.device, self.cache.dtype
        self.mode, self.steps = "eager", Steps(driver.model)  # each step: collectives, eager
        self.forward_passes = 0

    def _forward(self, chunks: list, select: list[int]) -> torch.Tensor:
        self.forward_passes += 1
        return self.driver.step(chunks, select)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Every rank holds its own heads of each block: the copy runs on all of them."""
        if pairs:
            self.driver.send(P.COPY, [x for pair in pairs for x in pair])


_LIVE: weakref.WeakSet[Driver] = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    for d in list(_LIVE):
        with contextlib.suppress(Exception):
            d.shutdown()


def peek_config(path: str | Path) -> Any:
    """The checkpoint's config, read without its weights (to refuse a bad split at once)."""
    from llmlib.checkpoints.lazy import read_checkpoint_lazy

    return read_checkpoint_lazy(path)[0]


def start_engine(
    model: Any, tp: int, device: Any, dtype: Any, tokenizer: Any, options: TPOptions | None
) -> tuple[Driver, Any, Any]:
    """What :class:`llmlib.LLM` needs to run split: ``(driver, rank 0's shard, tokenizer)``."""
    if not isinstance(model, (str, Path)):
        raise ValueError(
            "tensor_parallel_size > 1 needs a checkpoint path: every rank reads its own slice "
            "of the weights from it"
        )
    driver = start(model, tp, device, dtype, options)
    if tokenizer is None:
        from llmlib.checkpoints import load_tokenizer_for

        try:
            tokenizer = load_tokenizer_for(Path(model), required=False)
        except BaseException:
            driver.shutdown()
            raise
    return driver, driver.model, tokenizer


def start(
    path: str | Path,
    tp: int,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    options: TPOptions | None = None,
) -> Driver:
    """Start ``tp`` ranks on the checkpoint at ``path``; rank 0 (this process) is returned."""
    from llmlib.device import choose

    options = options or TPOptions()
    path = Path(path).expanduser().resolve()
    cfg = peek_config(path)
    try:
        check_engine_tp(cfg, tp)
    except ValueError as e:
        raise ValueError(f"tensor_parallel_size={tp}: {e}") from None
    place = choose(device, dtype)
    kind = place.device.type
    if kind == "cuda" and torch.cuda.device_count() < tp and DistEnv.from_env() is None:
        raise TensorParallelError(
            f"tensor_parallel_size={tp} needs {tp} GPUs; this machine has {torch.cuda.device_count()}"
        )
    spec = Spec(
        str(path),
        tp,
        kind,
        str(place.dtype).removeprefix("torch."),
        options.timeout_s,
        options.control_timeout_s,
        options.timing,
    )
    env = DistEnv.from_env()
    launched = env is not None and env.world_size > 1  # under torchrun
    sock = None
    if launched:
        if env.world_size != tp or env.rank != 0:
            raise TensorParallelError(
                f"torchrun started rank {env.rank} of {env.world_size}, but this is the driver of "
                f"tensor_parallel_size={tp}: it must be rank 0 of exactly {tp}"
            )
        store = connect(env, options.startup_timeout_s)
    else:
        sock = listen(options.host, options.port)
        port = sock.getsockname()[1]
        store = driver_store(sock, tp, options.startup_timeout_s)
        env = DistEnv(0, tp, 0, options.host, port)
    driver = Driver(tp, spec, options, store)
    _LIVE.add(driver)
    try:
        store.set("spec", spec.to_json())
        if not launched:
            _spawn(driver, env, options)
        driver.rank = _start_rank0(driver, spec, env, store, local=not launched)
    except BaseException as e:
        if driver._failure is None and not isinstance(e, TensorParallelError):
            report_error(store, 0, e, False)
        driver._failure = driver._failure or TensorParallelError(str(e))
        driver._teardown()
        raise
    driver._beat = threading.Thread(target=driver._heartbeat, daemon=True, name="tp-heartbeat")
    driver._beat.start()
    return driver


def _spawn(driver: Driver, env: DistEnv, options: TPOptions) -> None:
    import llmlib

    root = str(Path(llmlib.__file__).resolve().parents[1])
    from llmlib.kernels.flags import flags

    base = dict(os.environ)
    base.update(flags().as_env())  # every rank makes the kernel choices this process made
    base["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [base.get("PYTHONPATH")])])
    base.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    base["LLMLIB_TP_LOCAL"] = "1"
    base["LLMLIB_TP_STARTUP_TIMEOUT"] = str(options.startup_timeout_s)
    for r in range(1, driver.tp):
        e = DistEnv(r, env.world_size, r, env.master_addr, env.master_port)
        driver.workers[r] = LocalWorker(r, {**base, **e.as_env(), **options.worker_env})


def _start_rank0(driver: Driver, spec: Spec, env: DistEnv, store: Any, local: bool) -> Rank:
    """Load rank 0's shard while the workers load theirs, wait for all, then join the groups."""
    from llmlib.parallel.load import load_shard

    t0 = time.perf_counter()
    model, cfg = load_shard(
        spec.path, spec.tp, 0, None if spec.device == "cpu" else "cuda:0", spec.dtype
    )
    load_s = time.perf_counter() - t0
    deadline = time.monotonic() + driver.options.startup_timeout_s
    pending = set(range(1, spec.tp))
    while pending:
        pending = {r for r in pending if not store.check([f"loaded/{r}"])}
        errors = read_errors(store, spec.tp)
        if errors or any(w.proc.poll() is not None for w in driver.workers.values()):
            driver._fail(None)
        if pending and time.monotonic() > deadline:
            raise TensorParallelError(
                f"ranks {sorted(pending)} did not load their shards within "
                f"{driver.options.startup_timeout_s:.0f} s (TPOptions.startup_timeout_s)"
            )
        if pending:
            time.sleep(0.05)
    store.set("init", "1")
    rank = _join(spec, env, store, local, model, cfg)
    rank.load_seconds = load_s
    return rank


def _join(spec: Spec, env: DistEnv, store: Any, local: bool, model: Any, cfg: Any) -> Rank:
    from llmlib.parallel.group import init_groups

    groups = init_groups(
        store, 0, env.world_size, spec.device, spec.timeout_s, spec.control_timeout_s, local
    )
    return Rank(spec, env, groups, model, cfg)
