"""Arguments the model-running commands share (``generate``, ``chat``): which model, in which
format, how to sample."""

from __future__ import annotations

import argparse
from typing import Any

from llmlib.dtypes import FLOAT_NAMES, QUANTIZATIONS
from llmlib.sampling import SamplingParams


def add_model_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--model",
        default=None,
        help="a .gguf file or a Hugging Face folder (default: SmolLM2-135M-Instruct, fetched if missing)",
    )
    ap.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    add_format_args(ap)


def add_format_args(ap: argparse.ArgumentParser, auto: bool = True) -> None:
    """``--dtype`` and ``--quantization`` (and ``--group-size`` for int4)."""
    default = (
        "default: the fastest accurate format here (llmlib.device.choose_format: on a CPU with "
        "native bfloat16, bfloat16 activations with the file's own blocks or int8; on other "
        "CPUs, one request in float32 activations with them where the integer kernels run, "
        "else float32; bfloat16 on CUDA)"
        if auto
        else "default: bfloat16 on CUDA, float32 on CPU"
    )
    ap.add_argument("--dtype", default=None, choices=FLOAT_NAMES, help=default)
    ap.add_argument(
        "--quantization",
        default=None,
        choices=("none", *QUANTIZATIONS),
        help="weight-only int8 (per channel), int4 (groups), gguf (the file's own blocks)",
    )
    ap.add_argument("--group-size", type=int, default=32, help="int4 weights per scale (32..256)")


def model_format(args: argparse.Namespace) -> tuple[str | None, str | None, str | None]:
    """``(device, dtype, quantization)`` the arguments ask for; ``--quantization none`` means
    plain weights in ``--dtype`` (or float32), never the automatic choice."""
    q = args.quantization
    if q == "none":
        return args.device, args.dtype or "float32", None
    return args.device, args.dtype, q


def add_sampling_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--min-p", type=float, default=None)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The request the sampling arguments describe (a ValueError names a bad one)."""
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        max_tokens=args.max_new_tokens,
        stop=args.stop or [],
    )


def add_decode_args(ap: argparse.ArgumentParser, compile_help: str) -> None:
    """``--compile``/``--no-compile`` and ``--speculative``: how the engine decodes. Compiled is
    the default on a CPU (the compiled step is kept on disk after the first start:
    :mod:`llmlib.runtime.aot`)."""
    from llmlib.speculative.config import SPEC_HELP

    ap.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=compile_help + " (default: on a CPU, unless --speculative or LLMLIB_COMPILE=0)",
    )
    ap.add_argument("--speculative", default=None, metavar="SPEC", help=SPEC_HELP)
    add_kv_cache_arg(ap)


def add_kv_cache_arg(ap: argparse.ArgumentParser) -> None:
    """``--kv-cache-dtype``: how the engine's KV pool holds keys and values."""
    from llmlib.engine.kv_rows import KV_CACHE_DTYPES

    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="auto: keys and values in the activations' dtype (default); int8: one byte each "
        "and a scale per head and token, about half bfloat16's bytes (CPU)",
    )


def engine_config(args: argparse.Namespace, **fields: Any) -> Any:
    """The :class:`~llmlib.engine.config.EngineConfig` the model, format and decode arguments
    ask for (``fields``: the command's own, e.g. ``max_num_seqs=1`` for one request at a time)."""
    from llmlib.engine.config import EngineConfig
    from llmlib.speculative.config import SpeculativeConfig

    device, dtype, quantization = model_format(args)
    spec = getattr(args, "speculative", None)
    return EngineConfig(
        device=device,
        dtype=dtype,
        quantization=quantization,
        group_size=getattr(args, "group_size", None),
        compile=getattr(args, "compile", None),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        speculative_config=SpeculativeConfig.parse(spec) if spec else None,
        **fields,
    )


def cli_engine(args: argparse.Namespace) -> Any:
    """The engine ``llmlib generate`` and ``chat`` run: :class:`llmlib.LLM` with one sequence at
    a time, in the format the arguments ask for (or the machine's fastest for one request), its
    step compiled (or loaded) now, so the first answer's timing is decoding, not compiling."""
    from llmlib.checkpoints import resolve_model_path
    from llmlib.engine import LLM

    tp = getattr(args, "tensor_parallel_size", 1)
    config = engine_config(args, max_num_seqs=1, tensor_parallel_size=tp)
    return LLM(resolve_model_path(args.model), config=config)


def engine_note(llm: Any) -> str:
    """The timing line's word on what ran: the weights, the engine's resolved config, and what
    compiling the step cost this start."""
    reads = "" if getattr(llm, "_tp", None) else read_note(llm.model)  # sharded: a rank's slice
    note = f"weights {llm.model.weight_format}{reads}; "
    note += f"decode {llm.runner.decode_path}"
    if llm.compile_s:
        note += f" in {llm.compile_s:.1f} s"
    return note + f"; engine: {llm.engine_config.describe()}"


def read_note(model: Any) -> str:
    """The bytes a decode step reads from the weights as stored (:func:`llmlib.bench.formats.
    weight_bytes`), and for a GGUF file against the file's own tensor bytes (less an untied
    token table, of which a step reads one row): how close the layouts keep to the file."""
    from pathlib import Path

    from llmlib.bench.formats import weight_bytes

    try:
        reads = weight_bytes(model)
    except (AttributeError, RuntimeError):  # a sharded or unusual model: say nothing
        return ""
    note = f", {reads / 1e9:.2f} GB read a token"
    src = getattr(model, "source_path", None)
    if src is not None and Path(src).suffix == ".gguf":
        from llmlib.checkpoints.gguf import open_gguf

        tied = model.config.tie_embeddings
        f = open_gguf(src)
        own = sum(t.nbytes for n, t in f.tensors.items() if tied or n != "token_embd.weight")
        if own > 0:
            note += f" ({reads / own:.2f}x the file's)"
    return note
