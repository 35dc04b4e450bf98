"""``llmlib bench generate``: decode speed at batch 1, llmlib against transformers, in one run.

Both load the same SmolLM2 GGUF in float32 on the CPU and generate the same number of new tokens
greedily from the same prompt ids (the question in SmolLM2's chat template; transformers with
``min_new_tokens`` so it cannot stop early, llmlib with ``ignore_eos``). llmlib runs what
``llmlib generate`` runs: the batching engine with one sequence, its step compiled by default on a
CPU (``--no-compile``: eager). Runs alternate between the two so a noisy neighbour on this shared
machine slows both alike; we report medians and their ratio.

Threads: llmlib decodes with one thread by default (``--threads``). A batch-1 step is a chain of
matrix-vector products limited by memory bandwidth, which one core of this machine already
saturates, and one thread does not stall when another
process holds the other core. transformers keeps PyTorch's default (``--hf-threads`` to change it);
both counts are printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from llmlib.bench import save_json
from llmlib.bench import speculative as spec_bench
from llmlib.device import timings
from llmlib.speculative.config import SPEC_HELP

PROMPT = "What is a quadratic equation?"


def run(
    model_path: str | None = None,
    new_tokens: int = 64,
    runs: int = 3,
    threads: int | None = 1,
    prompt: str = PROMPT,
    verbose: bool = True,
    hf_threads: int | None = None,
    compile: bool | None = None,
) -> dict:
    from llmlib.bench.formats import one_request
    from llmlib.checkpoints import resolve_model_path
    from llmlib.engine import LLM

    default_threads = torch.get_num_threads()
    ours_threads = threads or default_threads
    theirs_threads = hf_threads or default_threads
    path = resolve_model_path(model_path)
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if verbose else (lambda *a: None)

    log(
        f"loading {path.name} into llmlib and transformers (float32, CPU; threads: "
        f"llmlib {ours_threads}, transformers {theirs_threads}) ..."
    )
    gen = LLM(path, device="cpu", dtype="float32", max_num_seqs=1, compile=compile)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()

    # the chat template, as a user would ask (SmolLM2-Instruct's first greedy token after the bare
    # question is its end-of-turn token, so the raw prompt would measure a continuation past it)
    ids = gen.encode([{"role": "user", "content": prompt}])[1]
    ids_t = torch.tensor([ids])

    def ours() -> list[int]:
        torch.set_num_threads(ours_threads)
        try:
            return one_request(gen, ids, new_tokens)[0]
        finally:
            torch.set_num_threads(default_threads)

    def theirs() -> list[int]:
        torch.set_num_threads(theirs_threads)
        try:
            with torch.inference_mode():
                out = hf.generate(
                    ids_t,
                    attention_mask=torch.ones_like(ids_t),
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )
        finally:
            torch.set_num_threads(default_threads)
        return out[0, len(ids) :].tolist()

    # warm up both (first calls allocate caches and pick kernels), and compare the tokens
    same = ours() == theirs()
    t_ours, t_theirs = [], []
    for i in range(runs):
        t_ours += timings(ours, warmup=0, reps=1)
        t_theirs += timings(theirs, warmup=0, reps=1)
        log(
            f"run {i + 1}/{runs}: llmlib {new_tokens / t_ours[-1]:.1f} tok/s, "
            f"transformers {new_tokens / t_theirs[-1]:.1f} tok/s"
        )
    ours_tps = new_tokens / statistics.median(t_ours)
    theirs_tps = new_tokens / statistics.median(t_theirs)
    return {
        "model": path.name,
        "dtype": "float32",
        "device": "cpu",
        "llmlib_threads": ours_threads,
        "llmlib_decode_path": gen.runner.decode_path,
        "transformers_threads": theirs_threads,
        "prompt_tokens": len(ids),
        "new_tokens": new_tokens,
        "runs": runs,
        "llmlib_tokens_per_s": round(ours_tps, 2),
        "transformers_tokens_per_s": round(theirs_tps, 2),
        "ratio": round(ours_tps / theirs_tps, 3),
        "same_tokens": same,
        "llmlib_seconds": [round(t, 3) for t in t_ours],
        "transformers_seconds": [round(t, 3) for t in t_theirs],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="llmlib bench generate", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a .gguf file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for llmlib (default: 1; 0 = torch's default)",
    )
    ap.add_argument(
        "--hf-threads",
        type=int,
        default=None,
        help="torch threads for transformers (default: torch's default)",
    )
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="llmlib's step compiled (default: as `llmlib generate` runs, compiled on a CPU)",
    )
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument(
        "--formats",
        default=None,
        help="compare weight formats instead of transformers: a comma list of float32, bfloat16, "
        "int8, int4, gguf, each optionally +compile (llmlib.bench.formats)",
    )
    ap.add_argument(
        "--perplexity-tokens",
        type=int,
        default=0,
        help="with --formats: also perplexity, KL and greedy agreement on this many tokens",
    )
    ap.add_argument("--no-memory", action="store_true", help="with --formats: skip resident memory")
    ap.add_argument("--no-llama-cpp", action="store_true", help="with --formats: skip llama.cpp")
    ap.add_argument("--out", default=None, help="with --formats: also write the JSON here")
    ap.add_argument(
        "--starts",
        action="store_true",
        help="with --formats: also each format's cold and warm start, process start to the first "
        "token of `llmlib generate` (cold compiles into an empty cache: minutes a format), and "
        "llama.cpp's (llmlib.bench.starts)",
    )
    ap.add_argument(
        "--requantize",
        default=None,
        metavar="TYPE",
        help="with --formats: run on a copy of the model made by llama.cpp's own quantizer "
        "(needs llama-cpp-python), e.g. Q4_K_M, Q5_K_M, Q6_K: the mixes GGUF files come in",
    )
    ap.add_argument(
        "--speculative",
        default=None,
        metavar="SPEC[,SPEC]",
        help="compare speculative decoding with plain instead (its options: llmlib bench "
        "speculative --help); " + SPEC_HELP,
    )
    if any(a.startswith("--speculative") for a in argv or []):
        return spec_bench.main(argv)
    args = ap.parse_args(argv)
    if args.formats:
        return _formats_main(args)
    if (
        args.new_tokens < 1
        or args.runs < 1
        or args.threads < 0
        or (args.hf_threads is not None and args.hf_threads < 1)
    ):
        print(
            "llmlib bench generate: --new-tokens, --runs and --hf-threads must be >= 1, --threads >= 0",
            file=sys.stderr,
        )
        return 2
    r = run(
        args.model,
        args.new_tokens,
        args.runs,
        args.threads or None,
        args.prompt,
        verbose=not args.json,
        hf_threads=args.hf_threads,
        compile=args.compile,
    )
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(
            f"{r['model']} float32 CPU, batch 1, {r['prompt_tokens']} prompt tokens, {r['new_tokens']} new tokens, "
            f"median of {r['runs']} runs"
        )
        print(
            f"  llmlib        {r['llmlib_tokens_per_s']:7.1f} tokens/s   ({r['llmlib_threads']} threads)"
        )
        print(
            f"  transformers  {r['transformers_tokens_per_s']:7.1f} tokens/s   ({r['transformers_threads']} threads)"
        )
        print(
            f"  ratio         {r['ratio']:7.2f}x   (same greedy tokens: {'yes' if r['same_tokens'] else 'no'})"
        )
    return 0


def _formats_main(args: argparse.Namespace) -> int:

    from llmlib.bench import formats as F
    from llmlib.checkpoints import resolve_model_path

    try:
        fmts = F.parse_formats(args.formats)
    except ValueError as e:
        print(f"llmlib bench generate: {e}", file=sys.stderr)
        return 2
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    path = resolve_model_path(args.model)
    if args.requantize:
        from llmlib.bench import _llama_cpp

        if not _llama_cpp.available():
            print("llmlib bench generate: --requantize needs llama-cpp-python", file=sys.stderr)
            return 2
        try:
            path = _llama_cpp.copy_of(Path(path), args.requantize, threads=args.threads or 2)
        except (KeyError, RuntimeError) as e:
            print(f"llmlib bench generate: --requantize {args.requantize}: {e}", file=sys.stderr)
            return 2
        log(f"model: {path.name} (llama.cpp's quantizer, {args.requantize})")
    res = F.run(
        path,
        fmts,
        new_tokens=args.new_tokens,
        runs=args.runs,
        threads=args.threads or torch.get_num_threads(),
        prompt=args.prompt,
        perplexity_tokens=args.perplexity_tokens,
        memory=not args.no_memory,
        llama_cpp=not args.no_llama_cpp,
        log=log,
    )
    if args.starts:
        from llmlib.bench import starts

        res["starts"] = starts.run(
            path, fmts, res["threads"], llama_cpp=not args.no_llama_cpp, log=log
        )
        for r in res["formats"]:
            got = res["starts"].get(r["name"], {})
            r["cold_start_s"], r["warm_start_s"] = got.get("cold_s"), got.get("warm_s")
            r["start_peak_rss_bytes"] = got.get("peak_rss")
    save_json(res, args.out)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        F.print_table(res)
    return 0
