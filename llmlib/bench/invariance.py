"""``llmlib bench invariance``: is a request's output the same alone and in company?

Runs :func:`llmlib.analysis.invariance.measure` on the real model, default mode and
batch-invariant mode (eager; ``batch_invariant_compiled`` for its compiled groups too), on
prompts cut from the book's corpus, and writes per case the largest logit difference, the share
of bitwise-identical steps and every greedy divergence (with the two tokens' text).
Correctness, not speed: it runs under ``cpu-run``, not ``bench-run``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from llmlib.analysis.invariance import CASES, measure, prompts_from_text
from llmlib.bench import save_json

CORPUS = Path(__file__).resolve().parents[2] / "data" / "austen.txt"


def run(
    model: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    max_tokens: int,
    cases: tuple[str, ...] = CASES,
    modes: tuple[str, ...] = ("default", "batch_invariant"),
    log=print,
) -> dict[str, Any]:
    """Both modes over the same prompts; a JSON-ready dict."""
    from llmlib.engine import LLM

    out: dict[str, Any] = {}
    for mode in modes:
        inv, comp = mode.startswith("batch_invariant"), mode.endswith("_compiled")
        log(f"-- {mode}")

        def make(inv: bool = inv, comp: bool = comp, **kw: Any) -> LLM:
            kw.setdefault("num_blocks", 2048)
            return LLM(model, tokenizer, batch_invariant=inv, compile=comp, max_num_seqs=64, **kw)

        res = measure(make, prompts, max_tokens, cases, log=log)
        cases_out = {}
        for name, r in res.items():
            d = r.as_dict()
            for dv in d["divergences"]:
                p = prompts[dv["prompt"]]
                dv["prompt_tokens"] = len(p)
                if tokenizer is not None:
                    dv["alone_text"] = tokenizer.decode([dv["alone"]])
                    dv["other_text"] = tokenizer.decode([dv["other"]])
                    dv["prompt_tail"] = tokenizer.decode(p[-12:])
            cases_out[name] = d
        out[mode] = cases_out
    return out


def cost_summary(
    runs: list[dict[str, Any]], con: dict[str, Any], total: int, log=print
) -> dict[str, Any]:
    """For ``llmlib bench batching --batch-invariant``: the median batch-invariant run of
    ``runs`` against the default continuous run ``con`` (same requests, same run)."""
    inv = sorted(runs, key=lambda r: r["seconds"])[(len(runs) - 1) // 2]
    inv_tps, con_tps = total / inv["seconds"], total / con["seconds"]
    same = sum(a == b for a, b in zip(inv["outputs"], con["outputs"])) / len(con["outputs"])
    log(
        f"  batch-invariant {inv_tps:5.1f} tok/s  ({inv['seconds']:.1f} s): "
        f"{inv_tps / con_tps:.2f}x the default continuous mode; "
        f"greedy tokens equal to it: {same:.0%}"
    )
    return {
        "tokens_per_s": inv_tps,
        "seconds": inv["seconds"],
        "seconds_all_runs": [r["seconds"] for r in runs],
        "ratio_vs_continuous": inv_tps / con_tps,
        "same_tokens_as_continuous": same,
        "preemptions": inv["stats"].preemptions,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="llmlib bench invariance", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf file or HF folder (default: SmolLM2)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(8, 160), metavar=("MIN", "MAX"))
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", nargs="+", default=list(CASES))
    ap.add_argument(
        "--modes",
        nargs="+",
        default=["default", "batch_invariant"],
        choices=["default", "batch_invariant", "batch_invariant_compiled"],
        help="batch_invariant_compiled: the mode's compiled groups (engine.invariant)",
    )
    ap.add_argument("--out", default=None, help="write the results as JSON to this file")
    from llmlib.cli.common import add_format_args, model_format

    add_format_args(ap)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    import torch

    from llmlib.checkpoints import load_model, load_tokenizer_for
    from llmlib.checkpoints.fetch import fetch_model
    from llmlib.device import choose_format, machine_info

    path = Path(args.model) if args.model else fetch_model(quiet=True)
    device, dtype, q = model_format(args)
    place, q = choose_format(device, dtype, q, gguf_blocks=path.suffix == ".gguf", batched=True)
    model = load_model(path, place.device, place.dtype, q)
    tok = load_tokenizer_for(path)
    prompts = prompts_from_text(
        tok, CORPUS.read_text(), args.num_prompts, tuple(args.prompt_len), args.seed
    )
    fmt = getattr(model, "weight_format", str(model.dtype))
    print(f"weights: {fmt}; {len(prompts)} prompts, {args.max_tokens} tokens each")
    res = run(model, tok, prompts, args.max_tokens, tuple(args.cases), tuple(args.modes))
    doc = {
        "machine": machine_info(args.device),
        "threads": torch.get_num_threads(),
        "weight_format": fmt,
        "num_prompts": len(prompts),
        "prompt_len": list(args.prompt_len),
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "modes": res,
    }
    for mode, cases in res.items():
        n = sum(len(c["divergences"]) for c in cases.values())
        share = min(c["identical_share"] for c in cases.values())
        print(f"{mode}: {n} greedy divergences; lowest share of identical steps {share:.1%}")
    save_json(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
