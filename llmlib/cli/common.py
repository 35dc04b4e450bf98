"""Arguments the model-running commands share (``generate``, ``chat``): which model, how to sample."""

from __future__ import annotations

import argparse

from llmlib.dtypes import FLOAT_NAMES
from llmlib.sampling import SamplingParams


def add_model_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--model",
        default=None,
        help="a .gguf file or a Hugging Face folder (default: SmolLM2-135M-Instruct, fetched if missing)",
    )
    ap.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    ap.add_argument(
        "--dtype",
        default=None,
        choices=FLOAT_NAMES,
        help="default: bfloat16 on CUDA, float32 on CPU",
    )


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
