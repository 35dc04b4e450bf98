"""Device and dtype, chosen once at load, and honest timing on whichever device that is.

The CPU path and the GPU path are the same code; what differs is where the tensors live and
which floating-point format they use. On a CUDA GPU we want bfloat16: it halves the bytes every
decode step has to read (decode is bound by memory bandwidth, chapter 9) and keeps float32's
exponent range, so nothing overflows. On a CPU, float32 unless the CPU multiplies bfloat16 in
hardware (:func:`native_bf16`): most have no bfloat16 units, and converting back and forth costs
more than it saves. The user-facing entry points pick the whole format with
:func:`choose_format`.

Timing a GPU is a trap: kernels are queued asynchronously, so a wall clock read right after a
call measures the queueing, not the work. :class:`Timer` synchronises (or uses CUDA events) so
the number is the work.
"""

from __future__ import annotations

import os
import platform
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import torch

from llmlib.dtypes import torch_dtype
from llmlib.kernels.flags import flags


def pick_device(device: str | torch.device | None = None) -> torch.device:
    """``None`` means CUDA when a GPU is visible, else the CPU; anything else is checked and used.

    Asking for CUDA on a machine without it is an error rather than a silent fallback: a
    benchmark that quietly ran on the CPU would report the wrong machine.
    """
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(
            f"device: {device!r} is not a device name (try 'cpu', 'cuda' or 'cuda:1')"
        ) from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device: {device!r} was asked for, but torch sees no CUDA GPU on this machine"
        )
    if dev.type == "mps" and not (
        hasattr(torch.backends, "mps") and torch.backends.mps.is_available()
    ):
        raise ValueError(f"device: {device!r} was asked for, but MPS is not available")
    return dev


def compiles_by_default(
    model: Any,
    device: torch.device,
    speculative: Any = None,
    tensor_parallel: bool = False,
    batch_invariant: bool = False,
) -> bool:
    """Whether a decode step is compiled when ``compile`` is left out (``LLM``, ``llmlib generate``,
    ``chat``, ``serve``): for a checkpoint (a path, or None for the default file) on a CPU, where
    the compiled step is kept on disk keyed by the file, so only a machine's first start pays for
    compiling. A model built in memory stays as built (its step would compile again at every
    start), and so do the modes that run steps of their own (speculation, tensor parallelism).
    The batch-invariant mode compiles too, where its fixed-shape groups
    (:class:`llmlib.engine.invariant.InvariantRows`) outrun its eager steps: on a CPU with AMX
    (``invariant_compile``). Without AMX its eager steps kept up or won: held to AVX2 a graph's
    float32 products are MKL's, whose groups under 48 rows give a row other bits, while the
    eager steps take oneDNN's products, a short tile padded to a few rows
    (``results/cpu/batching_invariant_as_avx2.json``, ``batching_invariant_as_zen4.json``).
    ``LLMLIB_COMPILE=0`` turns the default off (:mod:`llmlib.kernels.flags`)."""
    return (
        flags().compile_default
        and not isinstance(model, torch.nn.Module)
        and device.type == "cpu"
        and speculative is None
        and not tensor_parallel
        and (flags().invariant_compile or not batch_invariant)
    )


def pick_dtype(
    device: str | torch.device,
    dtype: str | torch.dtype | None = None,
    quantization: str | None = None,
) -> torch.dtype:
    """``None`` means bfloat16 on CUDA (float16 on a GPU older than sm_80, :func:`cuda_half`)
    and float32 elsewhere; names like ``"bf16"`` are accepted
    (:mod:`llmlib.dtypes` is the one table of names).

    With a weight-only ``quantization`` the dtype is the activations': bfloat16 on CUDA, and on a
    CPU :attr:`llmlib.kernels.flags.Flags.activations` (bfloat16 where the CPU multiplies it in
    hardware, float32 elsewhere; ``LLMLIB_ACTIVATIONS`` forces it).
    """
    dev = torch.device(device)
    if dtype is None or dtype == "auto":
        if dev.type == "cuda":
            # (a plan for a GPU not on this machine: one of sm_80 or newer)
            cap = torch.cuda.get_device_capability(dev) if torch.cuda.is_available() else (8, 0)
            return cuda_half(cap)
        if quantization and dev.type == "cpu":
            return torch_dtype(flags().activations)
        return torch.float32
    return torch_dtype(dtype)


def cuda_half(capability: tuple[int, int]) -> torch.dtype:
    """The 16-bit format for a GPU of compute ``capability``: bfloat16 from sm_80 (A100, L4,
    H100), which has bfloat16 tensor cores; float16 before it (Colab's T4 is sm_75, a V100
    sm_70), where bfloat16 runs slowly and PyTorch's flash and memory-efficient attention
    refuse it. float16's narrow range is safe for these models' activations at inference."""
    return torch.bfloat16 if tuple(capability) >= (8, 0) else torch.float16


def int4_refused(capability: tuple[int, int]) -> str | None:
    """Why the int4 weight kernel cannot run on a GPU of this capability (None: it can). On
    CUDA it is PyTorch's tinygemm (``_weight_int4pack_mm``), built for sm_80 and newer."""
    if tuple(capability) >= (8, 0):
        return None
    major, minor = capability
    return (
        "the int4 kernel on CUDA needs sm_80 or newer (an A100, L4 or H100); "
        f"this GPU is sm_{major}{minor}"
    )


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX-BF16): the condition
    under which bfloat16 and the weight-only kernels beat float32 here (chapter 9 measures it)."""
    return flags().native_bf16


def integer_kernels() -> bool:
    """Whether llmlib's integer kernels multiply int8 and 4-bit codes here (AVX-512 VNNI or AVX2;
    ``LLMLIB_INTEGER=0`` turns them off). They are compiled on first use: where that fails (no
    C++ compiler), the loader warns and PyTorch's weight-only kernels serve instead."""
    return flags().integer != "off"


#: What ``llmlib generate/chat`` (one request, batch-1 decode) and ``LLM()``/``llmlib serve``
#: (batched) run when neither a dtype nor a quantization is asked for, on a CPU with native
#: bfloat16: the first that applies to the file, in this order. Fastest first among the formats
#: whose perplexity stays within 1% of float32 on the book's text (not int4, which re-rounds 4-bit
#: blocks), as measured here by
#: ``llmlib bench generate --formats ... --perplexity-tokens`` (decode) and ``llmlib bench
#: batching --dtype/--quantization`` (batched); tests/test_quantize.py checks the order against
#: the recorded runs in results/. For batches bfloat16 came first in the latest record: oneDNN
#: multiplies many rows with AMX, where the integer formats' VNNI products (llmlib.kernels.integer) work
#: through a row's dot products vector by vector. (Integer formats in a batch need AVX-512 VNNI:
#: PyTorch's weight-only kernels are made for one row.) ``"decode_float32"`` is one request on a
#: CPU without native bfloat16 whose integer kernels run (AVX2 without AVX-512, say): the same
#: weights with float32 activations, which decoded several times faster than float32 weights when
#: run as such a CPU (``results/cpu/formats_as_avx2.json``); its batches stay in float32.
AUTO_CPU_FORMATS: dict[str, tuple[tuple[str, str | None], ...]] = {
    "decode": (("bfloat16", "gguf"), ("bfloat16", "int8")),
    "batched": (("bfloat16", None),),
    "decode_float32": (("float32", "gguf"), ("float32", "int8")),
}


def choose_format(
    device: str | torch.device | None,
    dtype: str | torch.dtype | None,
    quantization: str | None,
    gguf_blocks: bool = False,
    batched: bool = False,
) -> tuple[Placement, str | None]:
    """The placement and quantization a user-facing entry point runs: what was asked, or, when
    neither was, the fastest accurate format for this machine (:data:`AUTO_CPU_FORMATS` on a CPU
    with native bfloat16, for one request or for ``batched`` ones; on other CPUs, one request
    in float32 activations over integer codes where the integer kernels run, else float32;
    bfloat16 on CUDA). ``gguf_blocks``: whether the file holds GGUF blocks that ``"gguf"`` can
    repack."""
    dev = pick_device(device)
    if dtype is None and quantization is None and dev.type == "cpu":
        table: tuple[tuple[str, str | None], ...] = ()
        if native_bf16():
            table = AUTO_CPU_FORMATS["batched" if batched else "decode"]
        elif not batched and integer_kernels():  # else PyTorch's products: float32 is faster
            table = AUTO_CPU_FORMATS["decode_float32"]
        vnni = flags().integer == "vnni"
        for d, q in table:
            if (q != "gguf" or gguf_blocks) and (q is None or not batched or vnni):
                return Placement(dev, torch_dtype(d)), q
    return Placement(dev, pick_dtype(dev, dtype, quantization)), quantization


@dataclass(frozen=True)
class Placement:
    """Where a model runs and in which format: the one decision every later stage inherits."""

    device: torch.device
    dtype: torch.dtype

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def __str__(self) -> str:
        return f"{self.device} / {str(self.dtype).removeprefix('torch.')}"


def choose(
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    quantization: str | None = None,
) -> Placement:
    """Resolve a (device, dtype) request into a :class:`Placement` (defaults: CUDA+bf16, else CPU+fp32;
    with a weight-only quantization, see :func:`pick_dtype`)."""
    dev = pick_device(device)
    return Placement(dev, pick_dtype(dev, dtype, quantization))


def free_memory(device: str | torch.device | None = None) -> int | None:
    """Bytes free for new tensors on ``device``: the GPU's free memory, or on a CPU what the
    system could hand out without swapping (``MemAvailable``); None where that cannot be read."""
    device = pick_device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def synchronize(device: str | torch.device | None = None) -> None:
    """Wait until queued work on ``device`` is done (a no-op on the CPU, where calls are synchronous)."""
    dev = torch.device(device) if device is not None else None
    if (dev is None and torch.cuda.is_available()) or (dev is not None and dev.type == "cuda"):
        torch.cuda.synchronize(dev)


class Timer:
    """``with Timer(device) as t: ...`` then ``t.seconds``: wall time of the work, not of the queueing.

    On CUDA it records CUDA events around the block and synchronises on exit; elsewhere it reads
    ``time.perf_counter``.
    """

    def __init__(self, device: str | torch.device | None = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.seconds = float("nan")

    def __enter__(self) -> Timer:
        if self.device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            self._end.record()
            self._end.synchronize()
            self.seconds = self._start.elapsed_time(self._end) / 1e3
        else:
            self.seconds = time.perf_counter() - self._t0


def timings(
    fn: Callable[[], Any],
    device: str | torch.device | None = None,
    warmup: int = 1,
    reps: int = 5,
    *,
    before: Callable[[], Any] | None = None,
    budget_s: float | None = None,
) -> list[float]:
    """Seconds of each of ``reps`` runs of ``fn()`` after ``warmup`` untimed ones: the one timer.

    ``before`` runs untimed ahead of every run (to clear a cache, say). With ``budget_s``, a slow
    ``fn`` gets fewer runs (never fewer than 3) so the whole measurement takes about that long.
    On CUDA each run is timed with events and a synchronisation (:class:`Timer`).
    """
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    synchronize(device)
    times: list[float] = []
    n = max(0, reps)
    i = 0
    while i < n:
        if before is not None:
            before()
        with Timer(device) as t:
            fn()
        times.append(t.seconds)
        if i == 0 and budget_s is not None:
            n = max(min(3, reps), min(reps, int(budget_s / max(t.seconds, 1e-9))))
        i += 1
    return times


def time_fn(
    fn: Callable[[], Any],
    device: str | torch.device | None = None,
    warmup: int = 2,
    reps: int = 5,
    **kw: Any,
) -> float:
    """Median seconds of ``fn()`` (see :func:`timings`).

    The median, not the mean: these machines are shared, and one stalled run should not move
    the figure.
    """
    return statistics.median(timings(fn, device, warmup, max(1, reps), **kw))


def device_name(device: str | torch.device | None = None) -> str:
    """A human name for the machine that ran the numbers: the GPU's name or the CPU model."""
    dev = pick_device(device) if device is None else torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return cpu_name()


def cpu_name() -> str:
    """The CPU's model, and the class it runs as where ``LLMLIB_AS_CPU`` says so (its records must
    not pass for that class's own)."""
    name = flags().model_name or platform.processor() or platform.machine()
    return f"{name}, run as {flags().as_cpu}" if flags().as_cpu else name


def machine_info(device: str | torch.device | None = None) -> dict[str, Any]:
    """Everything a recorded benchmark should carry about where and when it ran."""
    dev = pick_device(device) if device is None else torch.device(device)
    info: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(dev),
        "device_name": device_name(dev),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
    }
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        info.update(
            {
                "cuda": torch.version.cuda,
                "gpu_memory_bytes": int(props.total_memory),
                "gpu_sm_count": int(props.multi_processor_count),
                "gpu_capability": f"{props.major}.{props.minor}",
            }
        )
    return info
