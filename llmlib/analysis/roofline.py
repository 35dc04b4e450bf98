"""The roofline: how fast a forward pass can possibly run on a machine, and which wall it hits.

A kernel, or a whole forward pass, does ``F`` floating-point operations and moves ``B`` bytes between
memory and the chip. Its *arithmetic intensity* is ``I = F / B`` FLOPs per byte. A machine has two
ceilings: peak arithmetic ``P`` (FLOP/s) and memory bandwidth ``W`` (bytes/s). The pass cannot
finish faster than either ``F / P`` or ``B / W``, so the best it can do is

    time >= max(F / P, B / W)        attainable FLOP/s = min(P, I * W)

(Williams, Waterman and Patterson, 2009). The two terms are equal at the *ridge*
``I* = P / W``: below it a pass is memory-bound and faster arithmetic would not help; above it the
pass is compute-bound and faster memory would not help.

This module has two halves:

* the **model** of a phase of inference (prefill of T tokens, or one decode step at batch B and
  context S): its FLOPs and its bytes (weights, KV cache, activations) counted by
  :mod:`llmlib.analysis.costs` (one place counts parameters), the intensity, the predicted time and the
  bound;
* the **measurement** of a machine's two ceilings: the median throughput of a large matmul per
  dtype, and the median bandwidth of reading a large buffer, timed with CUDA events on a GPU.

Weight-only quantization (``weight_dtype="q8_0"`` or ``"q4_1"``, the GGUF formats) shrinks the
weight bytes and leaves the FLOPs alone, which lowers the decode floor in proportion. Note that
llmlib's GGUF loader dequantizes to float at load time, so on llmlib's own model the bytes a
decode step actually reads are the float bytes; the quantized floor is what a kernel reading the
packed blocks directly would reach.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from llmlib.analysis import costs as C
from llmlib.analysis.gpus import GPU, get_gpu
from llmlib.config import ModelConfig, get_config
from llmlib.dtypes import canonical

#: ``weight_bits`` shorthand -> the GGUF block format the book's loaders read.
WEIGHT_BITS: dict[int, str] = {8: "q8_0", 4: "q4_1"}


# ---------------------------------------------------------------------------------------------
# the phase model
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """One forward pass of ``batch`` sequences, each adding ``tokens`` new tokens after ``context``
    cached ones: prefill is ``tokens = T``, decode is ``tokens = 1``. FLOPs and bytes for the whole pass."""

    kind: str
    model: str
    batch: int
    tokens: int
    context: int
    dtype: str  # activations and KV cache
    weight_dtype: str
    flops: float
    weight_bytes: float
    kv_bytes: float
    activation_bytes: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.activation_bytes

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.flops / self.bytes

    @property
    def new_tokens(self) -> int:
        """Tokens this pass produces rows for (batch x tokens)."""
        return self.batch * self.tokens

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "bytes": self.bytes, "intensity": self.intensity}


def _resolve_weight_dtype(dtype: str, weight_dtype: str | None, weight_bits: int | None) -> str:
    if weight_bits is not None:
        if weight_dtype is not None:
            raise ValueError("give weight_dtype or weight_bits, not both")
        if weight_bits not in WEIGHT_BITS:
            raise ValueError(
                f"weight_bits must be one of {sorted(WEIGHT_BITS)} (or None for {dtype}), got {weight_bits!r}"
            )
        return WEIGHT_BITS[weight_bits]
    wd = weight_dtype or dtype
    C.bytes_per_param(wd)  # validates the name
    return wd


def phase(
    cfg: ModelConfig | str,
    kind: str,
    tokens: int | None = None,
    batch: int = 1,
    context: int = 0,
    dtype: str = "bf16",
    weight_dtype: str | None = None,
    weight_bits: int | None = None,
    last_only: bool = False,
) -> Phase:
    """FLOPs and bytes of one pass of ``kind`` ``"prefill"`` (``tokens`` new tokens per sequence,
    default 1) or ``"decode"`` (one new token per sequence) at ``batch`` sequences, each with
    ``context`` tokens already cached.

    Bytes: the weights once per pass (all layers, final norm, full LM head; for a mixture of experts
    the experts the batch is expected to touch), plus per sequence the cached keys/values read and the
    new ones written, plus per new token its embedding row and activations
    (:func:`llmlib.analysis.costs.activation_bytes_per_token`). ``last_only`` models a prefill that runs the
    LM head for the last position only (all a generator needs): the other rows' LM-head FLOPs and
    logits disappear, though the LM head's weights are still read once.
    """
    cfg = get_config(cfg)
    if kind not in ("prefill", "decode"):
        raise ValueError(f"kind must be 'prefill' or 'decode', got {kind!r}")
    if tokens is None:
        tokens = 1
    if kind == "decode" and tokens != 1:
        raise ValueError(f"a decode step adds exactly one token per sequence, got tokens={tokens}")
    for name, v, lo in (("tokens", tokens, 1), ("batch", batch, 1), ("context", context, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    C.bytes_per_param(dtype)
    wd = _resolve_weight_dtype(dtype, weight_dtype, weight_bits)
    rows = batch * tokens
    experts = C.expected_experts_read(cfg, rows) if cfg.n_experts else None
    kv_tok = C.kv_bytes_per_token(cfg, dtype)
    skipped = batch * (tokens - 1) if last_only else 0  # rows whose logits are never computed
    return Phase(
        kind=kind,
        model=cfg.name,
        batch=batch,
        tokens=tokens,
        context=context,
        dtype=dtype,
        weight_dtype=wd,
        flops=batch * C.prefill_flops(cfg, tokens, past=context)
        - skipped * 2.0 * C.param_counts(cfg).lm_head_read,
        weight_bytes=C.pass_weight_bytes(cfg, wd, experts_read=experts)
        + rows * C.embedding_row_bytes(cfg, wd),
        kv_bytes=batch * (context + tokens) * kv_tok,
        activation_bytes=rows * C.activation_bytes_per_token(cfg, dtype)
        - skipped * cfg.vocab_size * 4.0,
    )


def prefill(cfg: ModelConfig | str, tokens: int, batch: int = 1, **kw: Any) -> Phase:
    """:func:`phase` for a prefill of ``tokens`` prompt tokens per sequence."""
    return phase(cfg, "prefill", tokens=tokens, batch=batch, **kw)


def decode(cfg: ModelConfig | str, batch: int = 1, context: int = 0, **kw: Any) -> Phase:
    """:func:`phase` for one decode step of ``batch`` sequences with ``context`` cached tokens each."""
    return phase(cfg, "decode", tokens=1, batch=batch, context=context, **kw)


@dataclass(frozen=True)
class Roof:
    """A machine's two ceilings: peak FLOP/s (at the dtype in question) and bytes/s."""

    name: str
    peak_flops: float
    bandwidth: float
    source: str = ""

    def __post_init__(self) -> None:
        if not (self.peak_flops > 0 and self.bandwidth > 0):
            raise ValueError(f"Roof {self.name!r}: peak_flops and bandwidth must be positive")

    @property
    def ridge(self) -> float:
        """The intensity (FLOPs/byte) where the memory slope meets the compute ceiling."""
        return self.peak_flops / self.bandwidth

    def attainable(self, intensity: float) -> float:
        """The roofline itself: the best FLOP/s a kernel of this intensity can reach."""
        return min(self.peak_flops, intensity * self.bandwidth)

    @classmethod
    def from_gpu(cls, gpu: GPU | str) -> Roof:
        """A GPU of :data:`llmlib.analysis.costs.GPUS`, at its dense bf16 datasheet figures."""
        g = get_gpu(gpu)
        return cls(g.name, g.flops, g.bandwidth, g.source)


@dataclass(frozen=True)
class Prediction:
    """The roofline's verdict on one phase on one machine."""

    phase: Phase
    roof: Roof
    t_compute: float  # seconds if only arithmetic counted
    t_memory: float  # seconds if only bytes counted

    @property
    def time(self) -> float:
        return max(self.t_compute, self.t_memory)

    @property
    def bound(self) -> str:
        return "compute" if self.t_compute >= self.t_memory else "memory"

    def mfu(self, measured_s: float) -> float:
        """Model FLOP utilisation: the phase's FLOPs over the measured time, as a fraction of peak."""
        return self.phase.flops / measured_s / self.roof.peak_flops

    def mbu(self, measured_s: float) -> float:
        """Model bandwidth utilisation: the phase's bytes over the measured time, as a fraction of peak."""
        return self.phase.bytes / measured_s / self.roof.bandwidth


def predict(ph: Phase, roof: Roof) -> Prediction:
    """Predicted time of a phase: the larger of compute time and memory time."""
    return Prediction(ph, roof, ph.flops / roof.peak_flops, ph.bytes / roof.bandwidth)


def crossover_batch(
    cfg: ModelConfig | str, roof: Roof, context: int = 0, max_batch: int = 1 << 20, **kw: Any
) -> int | None:
    """The smallest decode batch at which a step turns compute-bound on ``roof``, or None.

    Batching shares one read of the weights among B tokens, so intensity grows about linearly in B
    while weights dominate the bytes. Each sequence's own KV cache does *not* amortise, though: at
    long contexts its bytes grow with B as fast as the FLOPs do, intensity saturates, and the step
    may never become compute-bound (the function then returns None).
    """

    def compute_bound(b: int) -> bool:
        return predict(decode(cfg, batch=b, context=context, **kw), roof).bound == "compute"

    hi = 1
    while not compute_bound(hi):
        if hi >= max_batch:
            return None
        hi = min(hi * 2, max_batch)
    lo = hi // 2  # not compute-bound (or 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if compute_bound(mid) else (mid, hi)
    return hi


# ---------------------------------------------------------------------------------------------
# measuring the machine
# ---------------------------------------------------------------------------------------------


@dataclass
class Ceilings:
    """This machine's measured ceilings: median matmul FLOP/s per dtype and read bandwidth."""

    device: str
    device_name: str
    matmul_flops: dict[str, float]  # dtype name -> FLOP/s
    bandwidth: float  # bytes/s, reading a buffer far larger than every cache
    matmul_n: int
    bandwidth_bytes: int  # size of that buffer
    samples: dict[str, list[float]] = field(default_factory=dict)  # raw per-rep figures

    def roof(self, dtype: str = "float32") -> Roof:
        """The roofline at ``dtype``'s measured matmul peak and the measured bandwidth."""
        key = canonical(dtype)
        if key not in self.matmul_flops:
            raise ValueError(
                f"no matmul measured at {dtype!r}; measured: {', '.join(self.matmul_flops)}"
            )
        return Roof(
            f"{self.device_name} ({key}, measured)",
            self.matmul_flops[key],
            self.bandwidth,
            "measured here",
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure_matmul(
    dtype: Any = "float32", device: Any = None, n: int | None = None, reps: int = 5, warmup: int = 2
) -> list[float]:
    """FLOP/s of ``reps`` square ``n x n`` matmuls (``2 n^3`` FLOPs each) at ``dtype``, after a warm-up.

    ``n`` defaults to 1024 on a CPU (big enough to leave the cache-friendly regime of small
    matrices, small enough for a second of work) and 8192 on a GPU. Returns each rep's figure;
    take the median.

    The matrix is stored as the loader would store a model's (:func:`llmlib.kernels.prepare.pack_dense`),
    so the product is the one every weight product of the model takes: on a CPU not made by Intel,
    in float32, oneDNN with the weight re-ordered into its blocked layout, measurably faster there
    than a plain ``torch.mm``; the ceiling is what the model's own kernels can reach.
    """
    import torch
    import torch.nn.functional as F

    from llmlib.device import pick_device, pick_dtype, timings
    from llmlib.kernels.prepare import Format, pack_dense

    dev = pick_device(device)
    dt = pick_dtype(dev, dtype)
    n = n or (8192 if dev.type == "cuda" else 1024)
    a = torch.randn(n, n, device=dev).to(dt)
    w = pack_dense("w", torch.randn(n, n, device=dev) / n**0.5, Format(dev, dt))
    product = (lambda: F.linear(a, w)) if isinstance(w, torch.Tensor) else (lambda: w.linear(a))
    secs = timings(product, dev, warmup, reps)
    return [2.0 * n**3 / s for s in secs]


def measure_bandwidth(
    device: Any = None,
    nbytes: int | None = None,
    reps: int = 7,
    warmup: int = 2,
    kind: str = "read",
) -> list[float]:
    """Bytes/s of ``reps`` passes over an ``nbytes`` buffer: the memory roof.

    ``kind="read"`` (the default) reads the buffer once and writes nothing (the dot product of its
    two halves, BLAS's fastest streaming read), which is what a decode step does to its weights,
    so it is the ceiling a weight stream is compared with.
    ``kind="copy"`` copies it into a second buffer and counts read + write (2 x ``nbytes``), the
    figure GPU vendors' and STREAM's benchmarks quote. The buffer must dwarf every cache (256 MB on
    a CPU, 2 GB on a GPU) or the figure is the cache's, not memory's. Returns each rep's figure;
    take the median.
    """
    import torch

    from llmlib.device import pick_device, timings

    if kind not in ("read", "copy"):
        raise ValueError(f"kind must be 'read' or 'copy', got {kind!r}")
    dev = pick_device(device)
    nbytes = nbytes or ((2 << 30) if dev.type == "cuda" else (256 << 20))
    src = torch.ones(nbytes // 4, device=dev, dtype=torch.float32)
    if kind == "copy":
        dst = torch.empty_like(src)
        secs = timings(lambda: dst.copy_(src), dev, warmup, reps)
        return [2.0 * src.numel() * 4 / s for s in secs]
    half = src.numel() // 2
    a, b = src[:half], src[half : 2 * half]
    secs = timings(lambda: torch.dot(a, b), dev, warmup, reps)
    return [2 * half * 4 / s for s in secs]


def measure_machine(
    device: Any = None,
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    reps: int = 5,
    matmul_n: int | None = None,
    bandwidth_bytes: int | None = None,
) -> Ceilings:
    """Measure this machine's ceilings: median matmul FLOP/s per dtype and median read bandwidth."""
    from llmlib.device import device_name, pick_device

    dev = pick_device(device)
    n = matmul_n or (8192 if dev.type == "cuda" else 1024)
    nb = bandwidth_bytes or ((2 << 30) if dev.type == "cuda" else (256 << 20))
    samples: dict[str, list[float]] = {}
    flops: dict[str, float] = {}
    for d in dtypes:
        key = canonical(d)
        s = measure_matmul(key, dev, n=n, reps=reps)
        samples[f"matmul_{key}"] = s
        flops[key] = statistics.median(s)
    bw = measure_bandwidth(dev, nbytes=nb, reps=max(reps, 5))
    samples["read"] = bw
    return Ceilings(str(dev), device_name(dev), flops, statistics.median(bw), n, nb, samples)


def fmt_si(x: float, unit: str = "") -> str:
    """``1.23e11`` -> ``'123 G'`` + unit: three significant digits with an SI prefix."""
    if x == 0 or not math.isfinite(x):
        return f"{x} {unit}".strip()
    for p, s in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= s:
            return f"{x / s:.3g} {p}{unit}"
    return f"{x:.3g} {unit}".strip()
