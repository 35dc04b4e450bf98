"""How the engine's fixed-shape step is compiled, device by device (:mod:`llmlib.engine.fixed_step`).

Once the weights shrink to bfloat16, int8 or int4, a decode step on the CPU costs less in bytes
than in the work around them: ATen's weight-only kernels are tuned for many rows, and every small
operator between them is a separate call. Inductor has settings for both:

* ``freezing``: the weights become constants of the compiled graph, so inductor may re-store them
  once, in the layouts its own kernels want (oneDNN's blocked layout for bfloat16, a packed tile
  layout for its weight-only int8/int4 kernels);
* int8 and int4 matrices held for :mod:`llmlib.kernels.integer`'s integer kernels (where the CPU
  runs them: the loader decided so) stay in inductor's graph as extern calls, which read the
  codes as they are (activations rounded to int8, as llama.cpp rounds them);
* ``max_autotune`` with the ``CPP`` GEMM backend: inductor generates C++ matrix kernels (AMX
  micro-kernels where the CPU has them, AVX-512 or AVX2 ones elsewhere) with the dequantization
  and the following element-wise work fused in, and times them against ATen's for each shape
  (``ATEN`` stays a choice), keeping the faster;
* ``cpp_wrapper``: the code that calls those kernels one after another is C++ too, where by
  default it is Python; with a few hundred calls in a step of a few milliseconds, the Python
  between them is a visible share of the step. It makes the first compile longer.

Every compiled step also skips dynamo's guards on the model's modules (:func:`own_step`): before
each call dynamo checks thousands of facts about the modules it traced (their types, hooks,
attributes, the identity of each weight), a visible share of a small model's step.
The compiled step treats the modules as fixed, the same promise freezing already makes for the
weights, and compiles a private copy of the step function, so that no other model can ever reach
its graphs.

What it costs: a longer first compile (the timing line reports it; inductor caches its kernels
and choices on disk for the next process), constants a graph owns (the model keeps its own
weights for prefill), and a compiled step that no longer sees later changes to the weights.

float32 keeps inductor's defaults: freezing would add another, blocked float32 copy of every
matrix. On CUDA the step keeps inductor's defaults too (Triton kernels); there the fixed-shape step
is captured as CUDA graphs instead (:mod:`llmlib.runtime.graphs`).
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
    # quiet: inductor writes every shape's autotune timings to standard error, dozens of lines
    # under the one progress line a first start prints
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
    """What a graph compiled by inductor runs for ``model``: a view sharing its tensors, in which
    every matrix is what its layout says a graph should multiply
    (:meth:`~llmlib.kernels.weights.PackedWeight.for_graph`: the plain matrix in place of
    oneDNN's opaque layout or of a product that picks its code at run time) and every fused norm
    the plain module (inductor fuses it). The one conversion before compiling, so no kernel asks
    whether it is being traced; the model itself keeps its own layouts for the eager steps."""
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
    """The plain layer ``mod`` stands for, holding ``w`` (shared) as its parameter: an
    ``nn.Linear``, or the token table it was."""
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
    """How many int8/int4 matrices of ``model`` a frozen graph multiplies with inductor's own
    weight-only kernels (those :mod:`llmlib.kernels.integer` did not take: a width off its tiles, or
    ``LLMLIB_INTEGER=0``).

    Inductor re-packs such a matrix for its kernel while it compiles, and its on-disk cache of
    compiled graphs keys frozen weights by shape and dtype alone: a second model of the same shape,
    in a later process, would be handed the first model's packed codes. So a graph with any of them
    is compiled without that cache (``fx_graph_cache=False``); tests/test_quantize.py checks
    both models' logits.
    """
    from llmlib.kernels.prepare import weight_matrices
    from llmlib.kernels.weights import Int4Weight, Int8Weight

    return sum(
        isinstance(m.weight, Int8Weight | Int4Weight) for m in weight_matrices(model).values()
    )


def own_step(step: Callable) -> Callable:
    """A copy of ``step`` with a code object of its own.

    dynamo keeps a function's compiled graphs, and the guards that pick one, on its code object,
    whichever ``torch.compile`` wrapper called it. Once the guards on modules are dropped
    (:func:`compile_step`), two engines on two models sharing
    :func:`llmlib.engine.fixed_step.engine_forward`'s code could run one model's graph on the
    other's call; a private code object gives each compiled step its own graphs (and spares each
    call the other models' guards).
    """
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
    """What inductor needs before each CPU compile (not at load: loading a model must not import
    the compiler).

    * Where this process runs as a class of CPU without AMX (``LLMLIB_AS_CPU=zen4``), keep it
      from writing AMX micro-kernels: it chooses its vector code from the CPU itself, and given
      ``ATEN_CPU_CAPABILITY=avx512`` on a CPU with AMX it takes AMX.
    * Keep its on-disk caches apart by the instructions it writes code for
      (:func:`inductor_cache_dir`).
    """
    f = flags()
    if f.as_cpu and "amx_tile" not in f.cpu_flags:
        import torch._inductor.cpu_vec_isa as vec

        kept = [isa for isa in vec.valid_vec_isa_list() if "amx" not in str(isa)]
        vec.valid_vec_isa_list = lambda: kept
    inductor_cache_dir()


def inductor_cache_dir() -> str:
    """Point inductor's caches at a folder named by the vector instructions it writes code for in
    this process (``avx2``, ``avx512-avx512_vnni-amx_tile``), inside the folder it would use
    (``TORCHINDUCTOR_CACHE_DIR`` or its default), and return it.

    The keys of its caches leave those instructions out. A graph cached as AVX-512 code, which
    steps 16 floats at a time, was compiled again for AVX2 (8 floats to a vector) and gave wrong
    tokens. That happens to a process run as another class (``ATEN_CPU_CAPABILITY``), or to a
    cache folder that machines with different CPUs share."""
    import torch._inductor.cpu_vec_isa as vec
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    tag = "-".join(str(vec.pick_vec_isa()).split()) or "novec"
    root = os.path.abspath(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir())
    if os.path.basename(root) != tag:
        root = os.path.join(root, tag)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = root
    return root


def compile_step(step: Callable, model: nn.Module, *, dynamic: bool | None = None) -> Callable:
    """``torch.compile(step)`` with the options that serve ``model``'s device and format.

    ``model`` is what the graph runs: the engine hands it a view of its model in which every
    matrix is what a graph should multiply (:func:`graph_view`: plain
    bfloat16 in place of oneDNN's opaque layout, which a frozen graph then packs itself; integer
    matrices as the loader stored them). The compiled step does not check the modules again
    (:func:`own_step`). ``dynamic=True`` traces every size as a symbol, so one graph serves every
    batch.
    """
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
        # Settings dynamo reads from the global config when it traces, so they are set around
        # each call (which covers a recompile too): ``freezing`` (it then treats the parameters
        # as constants; ``options`` reach only inductor), and for symbolic sizes no "duck
        # shaping", which would assume two sizes equal because they were in the first call
        # (a step's rows and its block table's length, say) and compile again when they differ.
        with (
            torch._inductor.config.patch(freezing=frozen),
            fx_config.patch(use_duck_shape=not dynamic),
        ):
            return compiled(*args, **kwargs)

    return compiled_step
