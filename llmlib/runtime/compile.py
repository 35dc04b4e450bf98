"""How the engine's fixed-shape step (:mod:`llmlib.engine.fixed_step`) is compiled, per device.

Once the weights shrink to bfloat16, int8 or int4, a CPU decode step costs less in bytes than in
the work around them: ATen's weight-only kernels are tuned for many rows, and every small
operator between them is a separate call. Inductor's settings for both:

* ``freezing``: the weights become constants, which inductor re-stores once in the layouts its
  kernels want (oneDNN's blocked layout for bfloat16, packed tiles for its int8/int4 kernels;
  matrices held for :mod:`llmlib.kernels.integer` stay extern calls, reading the codes as is);
* ``max_autotune`` with the ``CPP`` GEMM backend: inductor generates C++ matrix kernels (AMX,
  AVX-512 or AVX2) with the dequantization and element-wise work fused in, and times them
  against ATen's for each shape, keeping the faster;
* ``cpp_wrapper``: the code calling those kernels is C++ too, not Python, which is a visible
  share of a step of a few hundred calls in a few milliseconds (the first compile is longer).

Every compiled step also skips dynamo's guards on the model's modules (:func:`own_step`):
checking thousands of facts about them (types, hooks, each weight's identity) before each call
is a visible share of a small model's step. The modules are fixed, as freezing fixes weights.

The cost: a longer first compile (inductor caches on disk for the next process), constants a
graph owns (the model keeps its weights for prefill), and a step blind to later weight changes.
float32 keeps inductor's defaults (freezing would add another, blocked float32 copy of every
matrix); so does CUDA, where the step is captured as CUDA graphs (:mod:`llmlib.runtime.graphs`).
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from llmlib.kernels.flags import flags

#: inductor settings for a CPU decode step whose weights are bfloat16 or quantized
CPU_OPTIONS: dict[str, Any] = {
    "freezing": True,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
    "cpp_wrapper": True,
    # quiet: inductor prints every shape's autotune timings, dozens of lines at a first start
    "autotune_num_choices_displayed": 0,
    "max_autotune_report_choices_stats": False,
}


def compile_options(model: nn.Module) -> dict[str, Any] | None:
    """The inductor options :func:`compile_step` uses for ``model`` (None: the defaults)."""
    p = next(model.parameters())
    if p.device.type != "cpu":
        return None
    dtype = getattr(model, "dtype", p.dtype)
    return dict(CPU_OPTIONS) if dtype != torch.float32 else None


def graph_view(model: nn.Module) -> nn.Module:
    """A view of ``model`` (tensors shared) for inductor: each matrix what its layout says a graph
    should multiply (:meth:`~llmlib.kernels.weights.PackedWeight.for_graph`), each fused norm the
    plain module. The one conversion before compiling, so no kernel asks whether it is traced."""
    from llmlib.kernels import norm as fused_norm
    from llmlib.kernels.modules import PackedEmbedding, PackedLinear
    from llmlib.kernels.prepare import replace_module, shared_copy, weight_matrices
    from llmlib.kernels.weights import PackedWeight, PlainWeight
    from llmlib.model.embedding import TokenEmbedding

    view = shared_copy(model)
    for name, mod in weight_matrices(view).items():
        w = mod.weight
        if not isinstance(w, PackedWeight) or w.for_graph() is w:
            continue
        new, bias = w.for_graph(), getattr(mod, "bias", None)
        if type(new) is PlainWeight:  # the plain layer back, its matrix a parameter: freezing
            layer = _plain_layer(mod, new.w)  # folds parameters into constants, and packs them
        elif isinstance(mod, TokenEmbedding):
            layer = PackedEmbedding(new, mod.scale)
        else:
            layer = PackedLinear(new, None if bias is None else bias.detach())
        replace_module(view, name, layer)
    for name, mod in list(view.named_modules()):
        if isinstance(mod, fused_norm.FusedRMSNorm):
            replace_module(view, name, mod.plain())
    return view


def _plain_layer(mod: nn.Module, w: torch.Tensor) -> nn.Module:
    """The plain ``nn.Linear`` (or token table) ``mod`` stands for, holding ``w`` (shared)."""
    from llmlib.model.embedding import TokenEmbedding

    if isinstance(mod, TokenEmbedding):
        layer = TokenEmbedding(w.shape[0], w.shape[1], "meta", mod.scale)
    else:
        bias = getattr(mod, "bias", None)
        layer = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device="meta")
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach(), requires_grad=False)
    layer.weight = nn.Parameter(w, requires_grad=False)
    return layer


def codes_left_to_inductor(model: nn.Module) -> int:
    """How many int8/int4 matrices a frozen graph multiplies with inductor's own kernels (those
    :mod:`llmlib.kernels.integer` did not take). Inductor's on-disk cache keys frozen weights by
    shape and dtype alone, so a later process's model of the same shape would get the first's
    packed codes: such a graph compiles with ``fx_graph_cache=False`` (tests/test_quantize.py)."""
    from llmlib.kernels.prepare import weight_matrices
    from llmlib.kernels.weights import Int4Weight, Int8Weight

    return sum(
        isinstance(m.weight, Int8Weight | Int4Weight) for m in weight_matrices(model).values()
    )


def own_step(step: Callable) -> Callable:
    """A copy of ``step`` with a code object of its own. dynamo keeps a function's graphs and
    their guards on its code object; with the module guards dropped (:func:`compile_step`), two
    engines sharing :func:`llmlib.engine.fixed_step.engine_forward`'s code could run one
    model's graph on the other's call."""
    fn = types.FunctionType(
        step.__code__.replace(),
        step.__globals__,
        step.__name__,
        step.__defaults__,
        step.__closure__,
    )
    fn.__kwdefaults__ = step.__kwdefaults__
    fn.__doc__, fn.__qualname__ = step.__doc__, step.__qualname__
    return fn


def _guard_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """``options`` plus the guard filter that skips the checks on nn.Module state."""
    return {
        **(options or {}),
        "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
    }


def prepare_inductor() -> None:
    """What inductor needs before each CPU compile (not at load, which must not import it): in a
    process run as a class without AMX (``LLMLIB_AS_CPU=zen4``), no AMX micro-kernels (inductor
    picks from the CPU itself, and given ``ATEN_CPU_CAPABILITY=avx512`` takes AMX); and caches
    kept apart by instruction set (:func:`inductor_cache_dir`)."""
    f = flags()
    if f.as_cpu and "amx_tile" not in f.cpu_flags:
        import torch._inductor.cpu_vec_isa as vec

        kept = [isa for isa in vec.valid_vec_isa_list() if "amx" not in str(isa)]
        vec.valid_vec_isa_list = lambda: kept
    inductor_cache_dir()


def inductor_cache_dir() -> str:
    """Point inductor's caches (``TORCHINDUCTOR_CACHE_DIR``) at a subfolder named by the vector
    instructions it writes code for here (``avx2``, ``avx512-avx512_vnni-amx_tile``); return it.
    Its cache keys leave them out: a graph cached as AVX-512 code was reused for AVX2 and gave
    wrong tokens (a process run as another class, or a folder shared by different CPUs)."""
    import torch._inductor.cpu_vec_isa as vec
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    tag = "-".join(str(vec.pick_vec_isa()).split()) or "novec"
    root = os.path.abspath(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir())
    if os.path.basename(root) != tag:
        root = os.path.join(root, tag)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = root
    return root


def compile_step(step: Callable, model: nn.Module, *, dynamic: bool | None = None) -> Callable:
    """``torch.compile(step)`` with the options for ``model``'s device and format. ``model`` is
    the graph's view (:func:`graph_view`); module guards are skipped (:func:`own_step`).
    ``dynamic=True`` traces every size as a symbol, so one graph serves every batch."""
    from llmlib.kernels.onednn import OneDNNWeight

    if any(isinstance(m, OneDNNWeight) for m in model.modules()):
        raise ValueError(
            "compile_step: this model holds matrices in oneDNN's opaque layout, which a graph "
            "would multiply as garbage: compile its llmlib.runtime.compile.graph_view(model)"
        )
    options = compile_options(model)
    prepare_inductor()
    step = own_step(step)
    if options is not None and codes_left_to_inductor(model):
        options["fx_graph_cache"] = False
    compiled = torch.compile(step, dynamic=dynamic, options=_guard_options(options))
    if options is None and not dynamic:
        return compiled
    import torch.fx.experimental._config as fx_config

    frozen = options is not None

    def compiled_step(*args: Any, **kwargs: Any) -> Any:
        # Set around each call (a recompile too): dynamo reads them from the global config.
        # ``freezing`` (``options`` reach only inductor), and for symbolic sizes no duck shaping,
        # which assumes two sizes equal because they were in the first call (a step's rows and
        # its block table's length) and compiles again when they differ.
        with (
            torch._inductor.config.patch(freezing=frozen),
            fx_config.patch(use_duck_shape=not dynamic),
        ):
            return compiled(*args, **kwargs)

    return compiled_step
