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


def auto_format(
    path: Any, device: str | None, dtype: str | None, quantization: str | None
) -> tuple[Any, Any, str | None]:
    """``(device, dtype, quantization)`` to load ``path`` with: as asked, or when neither a dtype
    nor a quantization is given, the machine's fastest accurate format
    (:func:`llmlib.device.choose_format`)."""
    from pathlib import Path

    from llmlib.device import choose_format

    place, q = choose_format(device, dtype, quantization, gguf_blocks=Path(path).suffix == ".gguf")
    return place.device, place.dtype, q


def generator_args(args: argparse.Namespace) -> tuple[Any, Any, Any, str | None]:
    """``(path, device, dtype, quantization)`` for :func:`llmlib.generate.load_generator`: the
    format the model arguments ask for, or the default (:func:`auto_format`)."""
    from llmlib.checkpoints import resolve_model_path

    path = resolve_model_path(args.model)
    return (path, *auto_format(path, *model_format(args)))


def add_decode_args(ap: argparse.ArgumentParser, compile_help: str) -> None:
    """``--compile``/``--no-compile`` and ``--speculative``: how the one-request generator
    decodes. Compiled is the default on a CPU (the compiled step is kept on disk after the first
    start: :mod:`llmlib.runtime.aot`); speculative decoding runs eagerly."""
    from llmlib.speculative.config import SPEC_HELP

    ap.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=compile_help + " (default: on a CPU, unless --speculative or LLMLIB_COMPILE=0)",
    )
    ap.add_argument("--speculative", default=None, metavar="SPEC", help=SPEC_HELP)


def cli_generator(args: argparse.Namespace) -> Any:
    """The :class:`~llmlib.generate.Generator` the model, format and decode arguments ask for;
    compiled now where it compiles, so the first answer's timing is decoding, not compilation."""
    from llmlib.device import compiles_by_default, pick_device
    from llmlib.generate import load_generator
    from llmlib.speculative.config import SpeculativeConfig

    spec = SpeculativeConfig.parse(args.speculative) if args.speculative else None
    compile = args.compile
    if compile is None:  # the fast path by default, where it is fast: a CPU's compiled step
        device = pick_device(getattr(args, "device", None))
        compile = compiles_by_default(args.model, device, speculative=spec)
    gen = load_generator(
        *generator_args(args), group_size=args.group_size, compile=compile, speculative=spec
    )
    if gen.decode_path == "compiled (in memory)":
        gen.warmup()  # torch.compile compiles on the first call
    return gen


def decode_note(gen: Any) -> str:
    """The timing line's word on which decode step ran, and what compiling cost."""
    note = f"; decode {gen.decode_path}"
    if gen.compile_s:
        note += f" in {gen.compile_s:.1f} s"
    return note
