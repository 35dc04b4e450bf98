"""Getting ``N`` processes into one ``torch.distributed`` group, and telling the driver what failed.

Both ways of starting the ranks end in the same environment, the one ``torchrun`` sets:
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``.

* llmlib on one machine: the driver (rank 0, the caller's process) binds a TCP store to
  ``127.0.0.1`` itself (:func:`listen`, so a port already taken is a clear error, and port 0
  any free one) and starts ranks ``1 .. N-1`` with that environment.
* ``torchrun``: it starts every rank; each runs the same command, rank 0 drives, the others
  serve (:func:`llmlib.parallel.worker.main`), and they meet at torchrun's store through
  ``env://`` (:func:`connect`).

The store (torch.distributed's own key-value server) carries the start-up: the driver's
:class:`Spec` (which checkpoint, how to split it), every rank's ``hello`` and ``loaded``, and any
rank's error (:func:`report_error`), which is how the driver can say which rank died and why.
Then :func:`init_groups` makes two groups over all ranks: the compute group (gloo on a CPU,
NCCL on CUDA) for the all-reduces and the logit gather, and a gloo control group for the
driver's commands. Every wait has a timeout: the compute group's is the longest a step may
take, the control group's the longest a worker waits for word from the driver (which sends a
heartbeat when idle).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

PREFIX = "llmlib-tp/"


class TensorParallelError(RuntimeError):
    """The tensor-parallel group could not start, or lost a rank; it has been shut down."""


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits, as ``torchrun`` (or llmlib's launcher) describes it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def from_env(cls) -> DistEnv | None:
        """The environment's description, or None outside a distributed launch."""
        e = os.environ
        if "RANK" not in e or "WORLD_SIZE" not in e:
            return None
        return cls(
            int(e["RANK"]),
            int(e["WORLD_SIZE"]),
            int(e.get("LOCAL_RANK", e["RANK"])),
            e.get("MASTER_ADDR", "127.0.0.1"),
            int(e.get("MASTER_PORT", "29500")),
        )

    def as_env(self) -> dict[str, str]:
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


@dataclass(frozen=True)
class Spec:
    """What the driver tells every rank at start-up (JSON in the store; no pickle anywhere)."""

    path: str
    tp: int
    device: str  # "cpu" or "cuda": each rank takes its LOCAL_RANK's GPU
    dtype: str | None
    timeout_s: float  # the longest a collective in a step may wait
    control_timeout_s: float  # the longest a worker waits for the driver's next command
    timing: bool | None

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Spec:
        return cls(**json.loads(raw))


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` for the driver's store; a port in use is refused."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as e:
        sock.close()
        taken = "already in use" if e.errno in (98, 48, 10048) else f"not usable ({e.strerror})"
        raise TensorParallelError(
            f"cannot start the tensor-parallel group: port {port} on {host} is {taken}; "
            "pass another port (TPOptions(port=...)), or 0 for any free one"
        ) from None
    return sock


def driver_store(sock: socket.socket, world_size: int, timeout_s: float) -> dist.Store:
    """The TCP store the driver hosts, on the socket :func:`listen` bound."""
    host, port = sock.getsockname()[:2]
    store = dist.TCPStore(
        host,
        port,
        world_size,
        True,
        timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=sock.fileno(),
    )
    sock.detach()  # the store's server owns the listening socket now, and closes it
    return dist.PrefixStore(PREFIX, store)


def connect(env: DistEnv, timeout_s: float) -> dist.Store:
    """Join the store ``env`` points at (torchrun's, or the driver's): ``env://`` rendezvous."""
    saved = {k: os.environ.get(k) for k in env.as_env()}
    os.environ.update(env.as_env())
    try:
        store, _, _ = next(
            dist.rendezvous(
                "env://", env.rank, env.world_size, timeout=timedelta(seconds=timeout_s)
            )
        )
    except Exception as e:
        raise TensorParallelError(
            f"rank {env.rank}: cannot reach the store at {env.master_addr}:{env.master_port} "
            f"({e}); is the port free and the driver running?"
        ) from None
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return dist.PrefixStore(PREFIX, store)


@contextlib.contextmanager
def loopback_gloo(on: bool) -> Iterator[None]:
    """Make gloo listen on the loopback interface while groups are made (one machine only)."""
    if not on or "GLOO_SOCKET_IFNAME" in os.environ or not sys.platform.startswith("linux"):
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        yield
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)


@dataclass
class Groups:
    compute: Any  # the all-reduces and the logit gather (gloo on a CPU, NCCL on CUDA)
    control: Any  # the driver's commands and the reports (gloo: CPU tensors)


def init_groups(
    store: dist.Store,
    rank: int,
    world_size: int,
    device: str,
    timeout_s: float,
    control_timeout_s: float,
    local: bool,
    local_rank: int = 0,
) -> Groups:
    """Join the process groups (every rank calls this, in the same order)."""
    if dist.is_initialized():
        raise TensorParallelError(
            "torch.distributed is already initialised in this process (another tensor-parallel "
            "LLM still running? call its shutdown() first)"
        )
    backend = "nccl" if device == "cuda" else "gloo"
    kw: dict[str, Any] = {}
    if backend == "nccl":
        import torch

        torch.cuda.set_device(local_rank)
        kw["device_id"] = torch.device("cuda", local_rank)
    with loopback_gloo(local):
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("pg/", store),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            **kw,
        )
        control = dist.new_group(backend="gloo", timeout=timedelta(seconds=control_timeout_s))
    return Groups(dist.group.WORLD, control)


def close_groups() -> None:
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


# ---- worker processes llmlib starts itself ---------------------------------------------------


class LocalWorker:
    """A worker process llmlib started, with the tail of its output kept for error messages."""

    def __init__(self, rank: int, env: dict[str, str]) -> None:
        self.rank = rank
        self.tail: collections.deque[str] = collections.deque(maxlen=20)
        cmd = [sys.executable, "-m", "llmlib.parallel.worker"]
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        self.reader = threading.Thread(target=self._read, daemon=True, name=f"tp-rank-{rank}-out")
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.tail.append(line.rstrip())
            print(f"[tp rank {self.rank}] {line}", end="", file=sys.stderr)

    def last_output(self, wait_s: float = 2.0) -> list[str]:
        """The tail of what the worker printed. Once it has exited, the reader is given a moment
        to reach the end of the pipe first: the exit is often seen before its last lines are."""
        if self.proc.poll() is not None:
            self.reader.join(wait_s)
        return list(self.tail)

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace_s)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.proc.poll() is None:
                self.proc.send_signal(sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(5)
        self.reader.join(2)


def exit_reason(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by signal {-code} ({signal.Signals(-code).name})"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


# ---- errors, through the store ---------------------------------------------------------------


def report_error(store: dist.Store, rank: int, exc: BaseException, in_collective: bool) -> None:
    """Leave this rank's failure in the store for the driver (best effort: the store may be gone)."""
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    info = {
        "rank": rank,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "type": type(exc).__name__,
        "message": str(exc)[:2000],
        "traceback": "".join(tb)[-4000:],
        "time": time.time(),
        "in_collective": in_collective,
    }
    with contextlib.suppress(Exception):
        store.set(f"error/{rank}", json.dumps(info))


def read_errors(store: dist.Store, world_size: int) -> dict[int, dict]:
    """The errors ranks have left in the store, by rank."""
    out = {}
    for r in range(world_size):
        with contextlib.suppress(Exception):
            if store.check([f"error/{r}"]):
                out[r] = json.loads(store.get(f"error/{r}"))
    return out
