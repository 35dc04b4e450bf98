"""Compiled decode steps kept on disk: compile once per machine, load in a fraction of a second.

``torch.compile`` compiles in the process that runs: every start pays for tracing the step (and,
on a cold cache, for code generation), a minute or more on a small CPU. AOTInductor compiles
ahead of time: ``torch.export`` traces the step once, inductor turns the graph into a shared
library, and any later process opens it (:class:`Package`). The package holds code only: the
weights stay the model's tensors, handed over by name (``user_managed=True``), so loading a
step adds no copy of the model.

A step whose weights are all bfloat16 CPU matrices is *frozen* (:func:`freezes`), as the
in-memory step is (:mod:`llmlib.runtime.compile`): inductor re-stores each matrix in oneDNN's
layout, so the package holds its own copy. Integer matrices are read by llmlib's kernels as
they are: a quantized model's package stays code only.

A package is found by its key (:func:`step_key`): the model file's SHA-256 (remembered beside
the cache), ``model.weight_format``, the step's kind, torch's and llmlib's versions, and the
CPU's choices (:class:`llmlib.kernels.flags.Flags`: the kernels a graph calls are part of its
code). A model not loaded from a file has no key: it compiles in memory
(:func:`llmlib.runtime.compile.compile_step`).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

#: bumped when what a package holds changes meaning
VERSION = 7  # 7: int4_linear takes float16 units (Q4_K factored), optional


def cache_dir() -> Path:
    from llmlib.kernels.flags import flags

    return flags().cache / "compiled"


def file_digest(path: Path) -> str:
    """The SHA-256 of a model file (or of a folder's safetensors), remembered beside the cache by
    path, size and modification time, so a multi-gigabyte file is read for it once."""
    from llmlib.files import remembered_sha256

    path = Path(path).resolve()
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    return remembered_sha256(files, cache_dir() / "digests.json")


def step_key(model: nn.Module, kind: str) -> str | None:
    """The name of ``model``'s compiled ``kind`` step on disk; None for a model not from a file."""
    import llmlib
    from llmlib.kernels.flags import flags

    source = getattr(model, "source_path", None)
    if source is None:
        return None
    f = flags()
    parts = {
        "version": VERSION,
        "llmlib": llmlib.__version__,
        "torch": torch.__version__,
        "kind": kind,
        "model": file_digest(Path(source)),
        "format": getattr(model, "weight_format", ""),
        "dtype": str(model.dtype),
        "flags": f.describe(),
        "cpu": sorted(f.cpu_flags),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def load_kernels() -> None:
    """Build (once per machine) and register every C++ operator the flags choose here."""
    from llmlib.kernels import integer, matvec, norm, paged_attention

    for kernel in (integer, matvec, norm, paged_attention):
        kernel.available()


def freezes(model: nn.Module) -> bool:
    """Whether ``model``'s compiled steps are frozen, their weights the package's constants: on
    the CPU, where every matrix is dense bfloat16 (oneDNN's layout included, which the graph's
    view turns plain: :func:`llmlib.runtime.compile.graph_view`)."""
    from llmlib.kernels.bfloat16 import Bfloat16Weight
    from llmlib.kernels.onednn import OneDNNWeight
    from llmlib.kernels.prepare import weight_matrices
    from llmlib.kernels.weights import PlainWeight
    from llmlib.runtime.compile import compile_options

    if compile_options(model) is None:
        return False
    mats = [m.weight for m in weight_matrices(model).values()]
    dense = (OneDNNWeight, Bfloat16Weight, PlainWeight, nn.Parameter)
    return bool(mats) and all(isinstance(w, dense) and w.dtype == torch.bfloat16 for w in mats)


class Package:
    """A compiled step's ``.pt2`` file opened by AOTInductor's C++ loader, called directly.
    ``aoti_load_package`` also imports inductor and dynamo and probes the machine, over a second
    of every start; a package here was compiled on this machine (its key names the CPU's flags)."""

    def __init__(self, path: Path) -> None:
        from torch.utils import _pytree

        # (file, model name, single-threaded, runners, device index): load_package's defaults
        self.loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        self.out_spec = _pytree.treespec_loads(self.loader.get_call_spec()[1])
        self._unflatten = _pytree.tree_unflatten

    def __call__(self, *tensors: torch.Tensor):
        return self._unflatten(self.loader.boxed_run(list(tensors)), self.out_spec)

    def get_constant_fqns(self) -> list[str]:
        return self.loader.get_constant_fqns()

    def load_constants(
        self, constants: dict[str, torch.Tensor], *, check_full_update: bool, user_managed: bool
    ) -> None:
        # (map, use the inactive buffer, check that all are given, user managed, copy to device)
        self.loader.load_constants(constants, False, check_full_update, user_managed, False)


def _constants(module: nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p for n, p in module.named_parameters()}
    out.update({n: b for n, b in module.named_buffers()})
    return out


def load_step(
    model: nn.Module,
    kind: str,
    wrapper: nn.Module,
    compile: Callable[[Path], None],
    log: Callable[[str], None] | None = None,
):
    """``wrapper``'s package for ``model``, compiled first by ``compile(path)`` if there is none:
    ``(loaded, cached)``, or ``(None, False)`` where the model has no key or the step cannot be
    compiled ahead of time here (the caller compiles in memory). It reads the model's own
    tensors, except a frozen package (:func:`freezes`)."""
    frozen = freezes(model)
    if frozen:  # the graph sees plain matrices (a graph view), and re-stores them itself
        kind += "-frozen"
    key = step_key(model, kind)
    if key is None:
        return None, False
    path = cache_dir() / f"{kind}-{key}.pt2"
    failed = path.with_suffix(".failed")  # why it could not be done, so no later start tries again
    if failed.exists():
        if log is not None:
            why = failed.read_text()[:200]
            log(
                f"llmlib: this step ({kind}) compiles in memory here ({why}; delete {failed} to retry)"
            )
        return None, False
    cached = path.exists()
    load_kernels()  # a package calls llmlib's C++ operators by name: register them first
    try:
        if not cached:
            compile(path)
        loaded = Package(path)
        if not frozen:
            consts = _constants(wrapper)
            names = loaded.get_constant_fqns()
            loaded.load_constants(
                {n: consts[n] for n in names}, check_full_update=True, user_managed=True
            )
    except Exception as e:  # an op or layout AOTInductor cannot take here: compile in memory
        if log is not None:
            log(f"llmlib: this step ({kind}) cannot be compiled ahead of time here ({e!s:.200})")
        path.unlink(missing_ok=True)
        failed.parent.mkdir(parents=True, exist_ok=True)
        failed.write_text(f"{type(e).__name__}: {e!s:.500}")
        return None, False
    return loaded, cached


def export_and_package(wrapper, model, args, shapes, path: Path, log, what: str) -> None:
    """Trace ``wrapper`` with ``torch.export`` and compile it into a package at ``path`` (written
    beside and renamed, so a crash never leaves half a package): code only, or for a frozen step
    (:func:`freezes`) with the in-memory step's inductor options and its weights as constants."""
    from llmlib.runtime.compile import compile_options, prepare_inductor

    prepare_inductor()
    if freezes(model):
        configs = {k: v for k, v in compile_options(model).items() if k != "cpp_wrapper"}
    else:
        configs = {"aot_inductor.package_constants_in_so": False}
    t0 = time.perf_counter()
    if log is not None:
        log(f"llmlib: compiling {what} for this machine, once ({expected(model, what)})...")
    import torch.fx.experimental._config as fx_config

    with (
        torch.inference_mode(False),
        torch.no_grad(),
        fx_config.patch(use_duck_shape=False),
        warnings.catch_warnings(),
    ):
        for message in TORCH_NOTICES:  # PyTorch's notes to itself, not the user's to act on
            warnings.filterwarnings("ignore", message=message)
        ep = torch.export.export(wrapper, args, dynamic_shapes=shapes, strict=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.pt2")
        torch._inductor.aoti_compile_and_package(
            ep, package_path=str(tmp), inductor_configs=configs
        )
    tmp.replace(path)
    _remember_time(model, what, time.perf_counter() - t0)


#: warnings PyTorch raises from inside an export and its compile, about its own code: a pytree
#: spec checked the deprecated way, and float16 group constants fused beside bfloat16 ones
TORCH_NOTICES = (r".*isinstance\(treespec, LeafSpec\)", "bf16 and fp16 are mixed")


def _times() -> Path:
    return cache_dir() / "compile_seconds.json"


def _remember_time(model: nn.Module, what: str, seconds: float) -> None:
    try:
        known = json.loads(_times().read_text()) if _times().exists() else {}
    except (OSError, ValueError):
        known = {}
    known[f"{what}: {getattr(model, 'weight_format', '')}"] = round(seconds, 1)
    _times().write_text(json.dumps(known))


def expected(model: nn.Module, what: str) -> str:
    """The compile's expected time: the last one's for this step and format, else a rough figure."""
    try:
        known = json.loads(_times().read_text())
        s = known.get(f"{what}: {getattr(model, 'weight_format', '')}")
        if s:
            return f"about {s:.0f} s, as last time"
    except (OSError, ValueError):
        pass
    return "about a minute on a small CPU"


def print_progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
