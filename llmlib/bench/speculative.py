"""``llmlib bench generate --speculative ngram:4``: speculative against plain decoding, one run.

The same model and Generator settings decode the same prompts greedily with and without
speculation; runs alternate (plain, then each speculative setting) so a noisy neighbour slows all
alike, and we report medians, the tokens/s ratio against plain decoding, the acceptance, and
whether the tokens were identical. Prompts: two that copy from their context (edit a passage,
rename a variable in code), where prompt lookup has something to find, and two open chat ones.
``--k-sweep`` repeats each method for several k; early exit runs at each ``--exit-layers``.

:func:`verify_cost` measures the claim speculation rests on: one forward pass over T new tokens
after a long cache costs about what a pass over one token costs, while T is small.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from llmlib.bench import save_json
from llmlib.speculative.config import SPEC_HELP, SpeculativeConfig

CODE = """def summarize(values):
    total = 0
    count = 0
    for v in values:
        if v is None:
            continue
        total += v
        count += 1
    mean = total / count if count else 0.0
    return {"total": total, "count": count, "mean": mean}
"""

PASSAGE = (
    "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition, "
    "seemed to unite some of the best blessings of existence; and had lived nearly twenty-one "
    "years in the world with very little to distress or vex her. She was the youngest of the two "
    "daughters of a most affectionate, indulgent father."
)

#: name -> (kind, user message); the chat template wraps each.
PROMPTS: dict[str, tuple[str, str]] = {
    "code_rename": (
        "copy",
        f"Rename the variable `total` to `acc` in this Python function. "
        f"Reply with the whole function only.\n\n{CODE}",
    ),
    "passage_edit": (
        "copy",
        f"Repeat this passage exactly, but replace the name Emma with Anne:\n\n{PASSAGE}",
    ),
    "chat_quadratic": ("open", "What is a quadratic equation?"),
    "chat_story": ("open", "Write a short story about a lighthouse keeper."),
}


def verify_cost(
    model: torch.nn.Module,
    context: int = 512,
    new_tokens: tuple[int, ...] = (1, 2, 4, 8, 16),
    reps: int = 5,
) -> dict[int, float]:
    """Seconds (the fastest of ``reps``) of one forward pass over T new tokens after ``context``
    cached ones."""
    from llmlib.model.kv_cache import KVCache

    p = next(model.parameters())
    dtype = getattr(model, "dtype", p.dtype)
    cfg = model.config
    cache = KVCache.from_config(cfg, 1, context + max(new_tokens), p.device, dtype)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(cfg.vocab_size, (1, context + max(new_tokens)), generator=g).to(p.device)
    pos = torch.arange(ids.shape[1], device=p.device).unsqueeze(0)
    out: dict[int, float] = {}
    with torch.inference_mode():
        model(ids[:, :context], pos[:, :context], cache, last_only=True)
        for t in new_tokens:
            times = []
            for _ in range(reps + 1):
                cache.truncate(context)
                t0 = time.perf_counter()
                model(ids[:, context : context + t], pos[:, context : context + t], cache)
                times.append(time.perf_counter() - t0)
            out[t] = min(times[1:])  # the least disturbed run (a shared machine)
    return out


def _methods(args: argparse.Namespace, n_layers: int) -> list[tuple[str, SpeculativeConfig]]:
    """Every setting to compare: each ``--speculative`` spec (a comma list), at each k of
    ``--k-sweep`` and, for early exit, each layer count of ``--exit-layers``."""
    out = []
    for spec in args.speculative.split(","):
        base = SpeculativeConfig.parse(spec)
        ks = [int(k) for k in args.k_sweep.split(",")] if args.k_sweep else [
            base.num_speculative_tokens
        ]  # fmt: skip
        layers = [base.exit_layer]
        if base.method == "early_exit" and args.exit_layers:
            layers = [int(x) for x in args.exit_layers.split(",")]
        for k in ks:
            for L in layers:
                if base.method == "early_exit":
                    if not 1 <= L < n_layers:
                        raise ValueError(f"early_exit needs 1 <= L < {n_layers}, got {L}")
                    c = SpeculativeConfig("early_exit", k, exit_layer=L)
                    out.append((f"early_exit:{L}:{k}", c))
                elif base.method == "ngram":
                    lo, hi = base.prompt_lookup_min, base.prompt_lookup_max
                    out.append((f"ngram:{k}:{lo}:{hi}", SpeculativeConfig("ngram", k, lo, hi)))
                else:
                    c = SpeculativeConfig("draft", k, draft_model=base.draft_model)
                    out.append((f"draft:{k}", c))
    return out


def run(args: argparse.Namespace, log: Any = print) -> dict[str, Any]:
    import llmlib
    from llmlib.checkpoints import resolve_model_path
    from llmlib.device import machine_info
    from llmlib.generate import Generator

    torch.set_num_threads(args.threads or torch.get_num_threads())
    path = resolve_model_path(args.model)
    model = llmlib.load_model(path, device="cpu", dtype=args.dtype, quantization=args.quantization)
    tok = llmlib.load_tokenizer(path)
    plain = Generator(model, tok)
    methods = _methods(args, model.config.n_layers)
    gens = {name: Generator(model, tok, speculative=spec) for name, spec in methods}
    names = [n for n in args.prompts.split(",")] if args.prompts else list(PROMPTS)
    res: dict[str, Any] = {
        "model": path.name,
        "weights": plain.weight_format,
        "threads": torch.get_num_threads(),
        "max_new_tokens": args.new_tokens,
        "runs": args.runs,
        "machine": machine_info("cpu"),
        "prompts": {},
    }
    if args.verify_cost:
        cost = verify_cost(model, args.verify_context)
        res["verify_cost"] = {
            "context": args.verify_context,
            "seconds": {str(t): round(s, 5) for t, s in cost.items()},
            "ratio_to_one": {str(t): round(s / cost[1], 3) for t, s in cost.items()},
        }
        log(f"verify cost after {args.verify_context} tokens: {res['verify_cost']['ratio_to_one']}")
    for name in names:
        kind, text = PROMPTS[name]
        ids = plain.encode_prompt(text, chat=True)[1]
        kw = dict(max_new_tokens=args.new_tokens)
        want = plain.generate(ids, **kw)
        outs = {n: g.generate(ids, **kw) for n, g in gens.items()}  # warm up, and compare tokens
        t: dict[str, list[float]] = {"plain": [], **{n: [] for n in gens}}
        for _ in range(args.runs):
            t["plain"].append(plain.generate(ids, **kw).timing.decode_s)
            for n, g in gens.items():
                t[n].append(g.generate(ids, **kw).timing.decode_s)
        n_dec = want.timing.decode_tokens
        plain_tps = n_dec / statistics.median(t["plain"])
        row: dict[str, Any] = {
            "kind": kind,
            "prompt_tokens": len(ids),
            "new_tokens": len(want.token_ids),
            "plain_tokens_per_s": round(plain_tps, 2),
            "methods": {},
        }
        for n, o in outs.items():
            tps = o.timing.decode_tokens / statistics.median(t[n])
            s = o.speculative
            row["methods"][n] = {
                "tokens_per_s": round(tps, 2),
                "speedup": round(tps / plain_tps, 3),
                "same_tokens": o.token_ids == want.token_ids,
                **(s.as_dict() if s is not None else {}),
            }
        best = max(row["methods"], key=lambda m: row["methods"][m]["speedup"])
        row["best"] = best
        res["prompts"][name] = row
        log(
            f"{name} ({kind}, {len(want.token_ids)} tokens): plain {plain_tps:.1f} tok/s; "
            + ", ".join(
                f"{m} {r['speedup']:.2f}x (accept {r['acceptance_rate']:.2f})"
                for m, r in row["methods"].items()
            )
        )
    return res


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="llmlib bench generate --speculative", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--speculative", default="ngram:4", help="a comma list; " + SPEC_HELP)
    ap.add_argument("--model", default=None, help="a .gguf file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--new-tokens", type=int, default=128, help="the most new tokens per prompt")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch's default)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--k-sweep", default=None, help="k values for every spec, e.g. 1,2,4,8")
    ap.add_argument(
        "--exit-layers", default=None, help="with early_exit: layer counts, e.g. 4,8,15"
    )
    ap.add_argument(
        "--spec-prompts", dest="prompts", default=None, help=f"a comma list of {list(PROMPTS)}"
    )
    ap.add_argument("--dtype", default="float32", help="with --speculative: the weights' dtype")
    ap.add_argument("--quantization", default=None, help="with --speculative: int8 | int4 | gguf")
    ap.add_argument(
        "--verify-cost", action="store_true", help="also time a pass over 1..16 new tokens"
    )
    ap.add_argument("--verify-context", type=int, default=512)
    return ap


def main(argv: list[str] | None = None) -> int:
    """``llmlib bench speculative ARGS``, also ``llmlib bench generate --speculative SPEC ARGS``."""
    args = parser().parse_args(argv)
    if args.new_tokens < 1 or args.runs < 1 or args.threads < 0:
        print("llmlib bench generate: --new-tokens and --runs must be >= 1", file=sys.stderr)
        return 2
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    try:
        res = run(args, log)
    except ValueError as e:
        print(f"llmlib bench generate: {e}; {SPEC_HELP}", file=sys.stderr)
        return 2
    save_json(res, args.out)
    if args.json:
        print(json.dumps(res, indent=2))
    return 0
