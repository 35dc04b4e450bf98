"""The few C++ kernels llmlib compiles for this CPU (``llmlib/kernels/csrc``), built once per
machine by ``torch.utils.cpp_extension`` into its cache and loaded as PyTorch operators.

Four use this: :mod:`llmlib.kernels.integer`, :mod:`llmlib.kernels.paged_attention`,
:mod:`llmlib.kernels.matvec` (built for AVX-512 or AVX2) and :func:`llmlib.model.norm.rms_norm`
(AVX-512 only). All are optional: where the CPU, the compiler or the build fails, :func:`build`
says so once and PyTorch's operators serve. Which build runs is
:attr:`llmlib.kernels.flags.Flags.isa` (``LLMLIB_NATIVE_ISA=avx2`` runs the AVX2 builds on an
AVX-512 CPU, ``none`` none: how the tests check every path on any x86 machine).

Every kernel splits its work with ``at::parallel_for``, which spreads over threads only when the
extension is compiled with OpenMP: without ``-fopenmp`` the loop silently runs on one thread, so
the flags here always carry it (and share PyTorch's thread count).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from llmlib.kernels.flags import flags

__all__ = ["AVX2", "AVX512", "CSRC", "build", "cached", "has_avx2", "has_avx512", "isa"]

CSRC = Path(__file__).parent / "csrc"
AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl"]
AVX2 = ["-mavx2", "-mfma", "-mf16c"]
_COMMON = ["-O3", "-std=c++17", "-fopenmp"]


def isa() -> str:
    """Which build of the kernels runs here: ``"avx512"``, ``"avx2"`` or ``"none"``."""
    return flags().isa


def has_avx512() -> bool:
    """Whether the AVX-512 builds (F, BW, VL) run here: the CPU has them and the flags allow it."""
    return isa() == "avx512"


def has_avx2() -> bool:
    """Whether a kernel written for both ISAs runs here (AVX2 and FMA at least)."""
    return isa() in ("avx512", "avx2")


def flags_for(which: str) -> list[str]:
    """The compiler flags of one build."""
    return AVX512 if which == "avx512" else AVX2


def _versioned(name: str, source: str, flags: list[str]) -> str:
    """``name`` plus a digest of source, flags and torch's version: found by contents, not path."""
    import hashlib

    import torch

    h = hashlib.sha256((CSRC / source).read_bytes())
    h.update(" ".join([*_COMMON, *flags, torch.__version__]).encode())
    return f"{name}_{h.hexdigest()[:12]}"


def _built(name: str) -> Path | None:
    """The finished library of extension ``name`` in cpp_extension's cache, if there is one."""
    from torch.utils import cpp_extension

    try:
        where = Path(cpp_extension._get_build_directory(name, False))
    except Exception:  # a private helper of cpp_extension: a newer PyTorch may move it
        return None
    # a build in progress (another process holds the lock) is left to cpp_extension to wait for
    so = where / f"{name}.so"
    return so if so.exists() and not (where / "lock").exists() else None


def cached(name: str, source: str, flags: list[str]) -> bool:
    """Whether extension ``name`` is already compiled in cpp_extension's cache."""
    return _built(_versioned(name, source, flags)) is not None


def build(name: str, source: str, flags: list[str], what: str) -> bool:
    """Compile (once per machine) and load ``csrc/<source>`` as extension ``name``; False, with
    one warning naming ``what``, where that fails. A finished build is loaded directly:
    ``cpp_extension.load`` would run ninja, which rebuilds whenever the source's path differs
    from the last build's, as in every fresh clone."""
    import torch
    from torch.utils import cpp_extension

    full = _versioned(name, source, flags)
    try:
        so = _built(full)
        if so is not None:
            torch.ops.load_library(str(so))
            return True
        print(f"llmlib: compiling the {what} (once per machine)...", file=sys.stderr)
        cpp_extension.load(
            name=full,
            sources=[str(CSRC / source)],
            extra_cflags=_COMMON + flags,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:
        warnings.warn(f"llmlib: {what} unavailable ({e}); using PyTorch's", stacklevel=3)
        return False
    return True
