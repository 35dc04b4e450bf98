"""What this machine can do, and what the user forced: read once per process, into one record.

Every choice llmlib makes that depends on the CPU is decided from :class:`Flags`, and nothing
else in the package reads the environment. Each choice can be forced, which is how the tests
run every path this machine can execute, so that a bug that lives on another class of CPU fails
here too (``tests/test_forced_paths.py``).

==========================  =====================  ==============================================
variable                    values                 what it decides (default)
==========================  =====================  ==============================================
``LLMLIB_CACHE``            a folder               where fetched models live (``~/.cache/llmlib``)
``LLMLIB_NATIVE_ISA``       ``avx512``, ``avx2``,  which build of the C++ kernels runs (the best
                            ``none``               the CPU has; ``none``: PyTorch's operators)
``LLMLIB_INTEGER``          ``vnni``, ``avx2``,    int8/int4 by integer dot products (``vnni``
                            ``0``                  with VNNI, else ``avx2``); ``0``: PyTorch's
``LLMLIB_MATVEC``           ``0``, ``1``           llmlib's one-row float32 kernel (not Intel)
``LLMLIB_ONEDNN_FLOAT32``   ``0``, ``1``           oneDNN copy of float32 matrices (not Intel)
``LLMLIB_ONEDNN_BFLOAT16``  ``0``, ``1``           bfloat16 in oneDNN's layout (AVX-512 BF16)
``LLMLIB_BFLOAT16_WIDEN``   ``0``, ``1``           plain bfloat16 matrices widened to float32 for
                                                   several rows (no bfloat16 arithmetic: AVX2)
``LLMLIB_FUSED_NORM``       ``0``, ``1``           RMSNorm as one C++ pass per row (``1``)
``LLMLIB_PAGED_KERNEL``     ``0``, ``1``           llmlib's in-place decode attention (``1``)
``LLMLIB_SIX_BIT``          ``0``, ``1``           codes that fit six bits (GGUF's Q6_K) kept in
                                                   six, as the file holds them (``1``); ``0``: 8
``LLMLIB_ACTIVATIONS``      ``float32``,           the activations' dtype of int8/int4/gguf
                            ``bfloat16``           models (bfloat16 where the CPU multiplies it)
``LLMLIB_COMPILE``          ``0``, ``1``           ``LLM(path)`` and the CLI compile CPU decode
                                                   steps (``1``); ``0``: eager unless asked
``LLMLIB_INVARIANT_COMPILE``  ``0``, ``1``         the batch-invariant mode compiles too (with
                                                   AMX; without, eager was as fast or faster)
``LLMLIB_PACKED_CACHE``     ``0``, ``1``           a quantized model's packed weights kept on disk
                                                   after its first load and mapped at later ones
``LLMLIB_TP_STARTUP_TIMEOUT``  seconds             tensor-parallel ranks' start timeout (600)
``LLMLIB_TP_LOCAL``         ``0``, ``1``           a torchrun rank computes alone (tests)
``LLMLIB_AS_CPU``           ``avx2``, ``zen4``     run as that class of CPU (see below)
==========================  =====================  ==============================================

``LLMLIB_AS_CPU`` makes this machine take another class's choices: llmlib reads that class's
vendor and flags (:data:`CLASSES`) instead of ``/proc/cpuinfo``. PyTorch, inductor, oneDNN and
MKL pick their own instructions, so the class must be named to them before Python starts
(``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``; a mismatch is an
error). ``make test CPU=avx2`` sets all four. It runs another class's code paths, not its speed.

A variable with any other value is an error that names it. :func:`flags` reads once per process;
:func:`forced` swaps in a changed record for a block of code (tests).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

ISAS = ("avx512", "avx2", "none")
INTEGER = ("vnni", "avx2", "off")
ACTIVATIONS = ("float32", "bfloat16")


@dataclass(frozen=True)
class CpuClass:
    """A class of CPU this machine can run as: what its ``/proc/cpuinfo`` says, and the variables
    that keep PyTorch (and inductor's code), oneDNN and MKL to its instructions."""

    vendor: str
    cpu_flags: frozenset[str]
    env: Mapping[str, str]


_BASE = "sse sse2 ssse3 sse4_1 sse4_2 popcnt avx avx2 fma f16c bmi1 bmi2 movbe aes pclmulqdq"
#: The classes the project has run on besides Intel's with AMX: an AMD EPYC with AVX2 only (no
#: AVX-512, no bfloat16 arithmetic) and an AMD Zen 4 (AVX-512 with VNNI and BF16, no AMX).
CLASSES = {
    "avx2": CpuClass(
        "AuthenticAMD",
        frozenset(f"{_BASE} sha_ni clzero sse4a".split()),
        {
            "ATEN_CPU_CAPABILITY": "avx2",
            "ONEDNN_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        },
    ),
    "zen4": CpuClass(
        "AuthenticAMD",
        frozenset(
            f"{_BASE} sha_ni sse4a avx512f avx512dq avx512cd avx512bw avx512vl avx512ifma "
            "avx512vbmi avx512_vbmi2 avx512_vnni avx512_bitalg avx512_vpopcntdq avx512_bf16 "
            "gfni vaes vpclmulqdq".split()
        ),
        {
            "ATEN_CPU_CAPABILITY": "avx512",
            "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
            "MKL_ENABLE_INSTRUCTIONS": "AVX512",
        },
    ),
}
#: The flags that name instructions: a class is only run where this CPU has all of its.
_INSTRUCTIONS = ("avx", "fma", "f16c", "amx", "gfni", "vaes", "vpclmulqdq", "sha_ni")


@dataclass(frozen=True)
class Flags:
    """The machine's capabilities (read from the CPU) and every choice made from them."""

    # ---- what the CPU is ----
    vendor: str  # "GenuineIntel", "AuthenticAMD", "" where unknown
    cpu_flags: frozenset[str]  # /proc/cpuinfo's flags
    # ---- the choices (each forceable) ----
    isa: str  # which build of the C++ kernels: "avx512", "avx2" or "none"
    integer: str  # int8/int4 products: "vnni", "avx2" or "off" (PyTorch's weight-only kernels)
    matvec: bool  # one-row float32 products by llmlib's kernel
    onednn_float32: bool  # a oneDNN-blocked copy of each float32 matrix for several rows
    onednn_bfloat16: bool  # bfloat16 matrices in oneDNN's blocked layout (where it exists)
    bfloat16_widen: bool  # plain bfloat16 matrices multiply several rows in float32
    fused_norm: bool  # RMSNorm in C++ (needs the AVX-512 build)
    paged_kernel: bool  # decode attention by llmlib's kernel
    six_bit: bool  # 8-bit group codes that fit six bits (Q6_K) kept in six by the integer kernels
    activations: str  # the dtype int8/int4/gguf models compute in: "float32" or "bfloat16"
    invariant_compile: bool  # the batch-invariant mode compiles by default, as the default does
    # ---- not about the CPU ----
    cache: Path  # where fetched models live
    compile_default: bool = True  # LLM(path) and the CLI compile their CPU decode steps
    packed_cache: bool = True  # packed weights kept on disk (llmlib.checkpoints.packed)
    tp_startup_timeout: float = 600.0
    tp_local: bool = False
    as_cpu: str = ""  # the class this machine runs as (LLMLIB_AS_CPU), "" for itself
    model_name: str = ""  # /proc/cpuinfo's "model name" (the machine's own, whatever it runs as)

    @property
    def mkl_tuned(self) -> bool:
        """Whether MKL (plain float32 products) runs its tuned code: it picks by vendor (Intel)."""
        return self.vendor in ("GenuineIntel", "")

    @property
    def native_bf16(self) -> bool:
        """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX-BF16)."""
        return bool(self.cpu_flags & {"avx512_bf16", "amx_bf16"})

    @property
    def has_vnni(self) -> bool:
        """Whether the CPU has AVX-512 VNNI (byte dot products into int32, one instruction)."""
        return "avx512_vnni" in self.cpu_flags

    def describe(self) -> str:
        """The choices in one line (logs, benchmarks, :func:`llmlib.runtime.aot.step_key`)."""
        return (
            f"isa={self.isa} integer={self.integer} matvec={int(self.matvec)} "
            f"onednn_float32={int(self.onednn_float32)} "
            f"onednn_bfloat16={int(self.onednn_bfloat16)} "
            f"bfloat16_widen={int(self.bfloat16_widen)} fused_norm={int(self.fused_norm)} "
            f"paged_kernel={int(self.paged_kernel)} six_bit={int(self.six_bit)} "
            f"activations={self.activations}"
        )

    def as_env(self) -> dict[str, str]:
        """The variables that force exactly these choices in another process."""
        return {
            "LLMLIB_NATIVE_ISA": self.isa,
            "LLMLIB_INTEGER": "0" if self.integer == "off" else self.integer,
            "LLMLIB_MATVEC": str(int(self.matvec)),
            "LLMLIB_ONEDNN_FLOAT32": str(int(self.onednn_float32)),
            "LLMLIB_ONEDNN_BFLOAT16": str(int(self.onednn_bfloat16)),
            "LLMLIB_BFLOAT16_WIDEN": str(int(self.bfloat16_widen)),
            "LLMLIB_FUSED_NORM": str(int(self.fused_norm)),
            "LLMLIB_PAGED_KERNEL": str(int(self.paged_kernel)),
            "LLMLIB_SIX_BIT": str(int(self.six_bit)),
            "LLMLIB_ACTIVATIONS": self.activations,
            "LLMLIB_INVARIANT_COMPILE": str(int(self.invariant_compile)),
        }


def _cpuinfo() -> tuple[str, frozenset[str], str]:
    """Vendor, flags and model name from ``/proc/cpuinfo`` (empty elsewhere): its one reader."""
    fields = {"vendor_id": "", "flags": "", "model name": ""}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in fields and not fields[key]:
                    fields[key] = value.strip()
                if all(fields.values()):
                    break
    except OSError:
        pass
    return fields["vendor_id"], frozenset(fields["flags"].split()), fields["model name"]


def _choice(env: Mapping[str, str], name: str, allowed: tuple[str, ...]) -> str | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    v = value.strip().lower()
    if v not in allowed:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(allowed)}")
    return v


def _switch(env: Mapping[str, str], name: str) -> bool | None:
    v = _choice(env, name, ("0", "1"))
    return None if v is None else v == "1"


def read(env: Mapping[str, str] | None = None, cpu: tuple[str, frozenset[str]] | None = None):
    """A record from ``env`` (default: the process's) and the CPU (default: this one). Nothing is
    built here: where a chosen kernel fails to build, its module says so and PyTorch's serve."""
    env = os.environ if env is None else env
    vendor, cflags, model_name = _cpuinfo() if cpu is None else (*cpu, "")
    as_cpu = _choice(env, "LLMLIB_AS_CPU", tuple(CLASSES)) or ""
    if as_cpu:
        vendor, cflags = _run_as(as_cpu, env, cflags)
    best = (
        "avx512"
        if {"avx512f", "avx512bw", "avx512vl"} <= cflags
        else "avx2"
        if {"avx2", "fma", "f16c"} <= cflags
        else "none"
    )
    isa = _choice(env, "LLMLIB_NATIVE_ISA", ISAS) or best
    if ISAS.index(isa) < ISAS.index(best):
        raise ValueError(f"LLMLIB_NATIVE_ISA={isa}: this CPU has at most {best}")
    integer = _choice(env, "LLMLIB_INTEGER", ("vnni", "avx2", "0"))
    vnni_ok = isa == "avx512" and "avx512_vnni" in cflags
    if integer is None:
        integer = "vnni" if vnni_ok else "avx2" if isa != "none" else "off"
    elif integer == "0":
        integer = "off"
    elif integer == "vnni" and not vnni_ok:
        raise ValueError("LLMLIB_INTEGER=vnni: needs AVX-512 VNNI and LLMLIB_NATIVE_ISA=avx512")
    elif integer == "avx2" and isa == "none":
        raise ValueError("LLMLIB_INTEGER=avx2: needs LLMLIB_NATIVE_ISA avx2 or avx512")
    not_intel = vendor not in ("GenuineIntel", "")
    native_bf16 = bool(cflags & {"avx512_bf16", "amx_bf16"})
    matvec = _switch(env, "LLMLIB_MATVEC")
    fused = _switch(env, "LLMLIB_FUSED_NORM")
    paged = _switch(env, "LLMLIB_PAGED_KERNEL")
    six = _switch(env, "LLMLIB_SIX_BIT")
    onednn32 = _switch(env, "LLMLIB_ONEDNN_FLOAT32")
    onednn16 = _switch(env, "LLMLIB_ONEDNN_BFLOAT16")
    widen16 = _switch(env, "LLMLIB_BFLOAT16_WIDEN")
    acts = _choice(env, "LLMLIB_ACTIVATIONS", ACTIVATIONS)
    inv_compile = _switch(env, "LLMLIB_INVARIANT_COMPILE")
    timeout = env.get("LLMLIB_TP_STARTUP_TIMEOUT")
    try:
        tp_timeout = 600.0 if not timeout else float(timeout)
    except ValueError:
        raise ValueError(f"LLMLIB_TP_STARTUP_TIMEOUT={timeout!r}: expected seconds") from None
    cache = env.get("LLMLIB_CACHE") or str(Path.home() / ".cache" / "llmlib")
    return Flags(
        vendor=vendor,
        cpu_flags=cflags,
        isa=isa,
        integer=integer,
        matvec=(not_intel if matvec is None else matvec) and isa != "none",
        onednn_float32=not_intel if onednn32 is None else onednn32,
        onednn_bfloat16=native_bf16 if onednn16 is None else onednn16,
        bfloat16_widen=not native_bf16 if widen16 is None else widen16,
        fused_norm=(True if fused is None else fused) and isa == "avx512",
        paged_kernel=(True if paged is None else paged) and isa != "none",
        six_bit=True if six is None else six,
        activations=acts or ("bfloat16" if native_bf16 else "float32"),
        invariant_compile="amx_bf16" in cflags if inv_compile is None else inv_compile,
        cache=Path(cache).expanduser(),
        tp_startup_timeout=tp_timeout,
        tp_local=bool(_switch(env, "LLMLIB_TP_LOCAL")),
        compile_default=_switch(env, "LLMLIB_COMPILE") is not False,
        packed_cache=_switch(env, "LLMLIB_PACKED_CACHE") is not False,
        as_cpu=as_cpu,
        model_name=model_name,
    )


def class_env(name: str) -> dict[str, str]:
    """The variables that run a process as class ``name`` (:data:`CLASSES`)."""
    return {"LLMLIB_AS_CPU": name, **CLASSES[name].env}


def _run_as(name: str, env: Mapping[str, str], own: frozenset[str]) -> tuple[str, frozenset[str]]:
    """The vendor and flags of class ``name``, once this CPU can execute them and the libraries
    below llmlib are held to them too (else a ValueError that names what is missing)."""
    cls = CLASSES[name]
    needed = {f for f in cls.cpu_flags if f.startswith(_INSTRUCTIONS)}
    if needed - own:
        lacks = ", ".join(sorted(needed - own))
        raise ValueError(f"LLMLIB_AS_CPU={name}: this CPU lacks {lacks}")
    for var, value in cls.env.items():
        if env.get(var, "").strip().lower() != value.lower():
            raise ValueError(
                f"LLMLIB_AS_CPU={name} needs {var}={value} set before Python starts "
                f"(it is {env.get(var)!r}); make CPU={name} sets it"
            )
    return cls.vendor, cls.cpu_flags


_current: list[Flags] = []


def flags() -> Flags:
    """This process's record (read on the first call)."""
    if not _current:
        _current.append(read())
    return _current[0]


@contextlib.contextmanager
def forced(**changes) -> Iterator[Flags]:
    """Within the block, :func:`flags` has ``changes`` applied; a model loaded inside keeps the
    choices it was loaded with. A choice the CPU cannot run is refused."""
    base = flags()
    new = dataclasses.replace(base, **changes)
    cpu_best = read(env={}, cpu=(base.vendor, base.cpu_flags)).isa
    if ISAS.index(new.isa) < ISAS.index(cpu_best):
        raise ValueError(f"forced isa={new.isa}: this CPU has at most {cpu_best}")
    if new.integer == "vnni" and not (new.isa == "avx512" and new.has_vnni):
        raise ValueError("forced integer='vnni': this CPU (or isa) has no AVX-512 VNNI")
    if new.integer == "avx2" and new.isa == "none":
        raise ValueError("forced integer='avx2' needs isa 'avx2' or 'avx512'")
    if new.fused_norm and new.isa != "avx512":
        raise ValueError("forced fused_norm=True needs isa='avx512'")
    _current[:] = [new]
    try:
        yield new
    finally:
        _current[:] = [base]


#: The on/off choices :func:`paths` flips, one at a time.
SWITCHES = (
    "matvec",
    "onednn_float32",
    "paged_kernel",
    "fused_norm",
    "onednn_bfloat16",
    "bfloat16_widen",
)


def paths(f: Flags | None = None) -> list[dict[str, object]]:
    """Every forced choice that changes a fast path here, one at a time from the default (tests)."""
    f = f or flags()
    best = read(env={}, cpu=(f.vendor, f.cpu_flags))
    out: list[dict[str, object]] = [{}]
    for isa in ISAS[ISAS.index(best.isa) + 1 :]:
        out.append({"isa": isa, **_implied(isa, best)})
    if best.integer != "off":
        out.append({"integer": "off"})
    for name in SWITCHES:
        value = getattr(best, name)
        if name == "fused_norm" and best.isa != "avx512":
            continue
        if name == "matvec" and best.isa == "none":
            continue
        out.append({name: not value})
    return out


def _implied(isa: str, best: Flags) -> dict[str, object]:
    """What forcing a lower ISA drags along (no VNNI below AVX-512, no kernels at none; at AVX2,
    the bfloat16 products of a CPU without bfloat16 arithmetic, as an AVX2-only CPU has)."""
    changes: dict[str, object] = {}
    if best.integer == "vnni" or isa == "none":
        changes["integer"] = "avx2" if isa == "avx2" else "off"
    if isa != "avx512":
        changes["fused_norm"] = False
    if isa == "avx2" and not best.bfloat16_widen:
        changes["bfloat16_widen"] = True
    if isa != "avx512":
        changes["invariant_compile"] = False
    if isa == "none":
        changes.update(matvec=False, paged_kernel=False)
    return changes
