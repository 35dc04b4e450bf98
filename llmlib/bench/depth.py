"""``llmlib bench depth``: long prompts in llama-bench's terms, beside llama.cpp, in one run.

llama-bench reports a model's speed as ``pp N`` (prompt processing: an N-token prompt read at
once, tokens/s) and ``tg M @ d N`` (text generation: M tokens decoded one at a time *at depth N*,
after N tokens of context). Short prompts hide what a long one costs: every decode step reads the
whole KV cache, and prefill's attention grows with the square of the prompt. This bench measures
both at each depth in ``--depths`` (default 512 and 4096), for llmlib and for llama.cpp on the
same GGUF file with the same number of threads:

* prefill: the seconds to the first token of an N-token prompt (llmlib: the request's time to
  its first token through :class:`llmlib.LLM`; llama.cpp: ``llm.eval(prompt)`` and the argmax of
  its last logits, :func:`llmlib.bench._llama_cpp.greedy`), and N over them;
* decode: ``--new-tokens`` greedy tokens after the prompt, tokens/s over the steps after the first.

The prompt is the book's own text (:func:`llmlib.perplexity.book_text_ids`), tiled where it is
shorter than N. Prefix caching is off, so a repeated prompt is computed again every run. Runs
alternate between the two engines so a noisy neighbour slows both alike; medians are reported,
and ratios llmlib / llama.cpp of speeds (above 1: llmlib faster).

Each run is repeated per KV cache type in ``--kv-cache-dtype``: ``auto`` (the activations'
dtype in llmlib; llama.cpp's default F16 cache) and ``int8`` (llmlib's int8 cache; llama.cpp's
q8_0 keys and values). llama.cpp runs with flash attention on for both (its default on a CPU,
and what a q8_0 value cache needs). A smaller cache is a cheaper decode at depth, so the bench
also prints each cache's bytes per token and, with ``--perplexity-tokens``, what it costs in
quality: the perplexity of the book's text over the same sliding windows
(:func:`llmlib.perplexity.windows`) for both engines and both caches. llmlib scores *through
the engine* (each window a request with ``prompt_logprobs``), so the cache it reads is the
one measured; llama.cpp scores from its logits of every position. The ratio int8 / auto per
engine is the cache's perplexity cost, llmlib's int8 beside llama.cpp's q8_0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from llmlib.bench import _llama_cpp, save_json
from llmlib.perplexity import Perplexity, over_windows

KV_CACHE_DTYPES = _llama_cpp.KV_CACHE_TYPES

#: tokens of room the engines get past the deepest prompt and its new tokens
SLACK = 16


def log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


# ---- pure helpers -------------------------------------------------------------------------------
def prompt_of(ids: Sequence[int], n: int) -> list[int]:
    """Exactly ``n`` tokens: ``ids`` tiled (repeated from its start) as often as needed, and cut."""
    if n < 1:
        raise ValueError(f"a prompt needs at least one token, got {n}")
    if not ids:
        raise ValueError("no tokens to build a prompt from")
    ids = list(ids)
    return (ids * -(-n // len(ids)))[:n]


def logprobs_nll(
    prompt_logprobs: Sequence[Any], ids: Sequence[int], begin: int, first: int, end: int
) -> float:
    """The same sum from a request's ``prompt_logprobs`` for the window ``ids[begin:end]`` (entry
    ``i`` is the log-probability of the window's token ``i``, None for the first)."""
    total = 0.0
    for t in range(first, end):
        e = prompt_logprobs[t - begin]
        if e is None or e.token_id != ids[t]:
            raise ValueError(f"prompt_logprobs at {t - begin} is not token {ids[t]}: {e!r}")
        total -= e.logprob
    return total


def int_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of integers: {text!r}") from None
    if not out or any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"need positive integers, got {text!r}")
    return out


def kv_list(text: str) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    for x in out:
        if x not in KV_CACHE_DTYPES:
            raise argparse.ArgumentTypeError(
                f"unknown KV cache type {x!r}; one of: {', '.join(KV_CACHE_DTYPES)}"
            )
    if not out:
        raise argparse.ArgumentTypeError("no KV cache type given")
    return list(dict.fromkeys(out))


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


# ---- the engines --------------------------------------------------------------------------------
def llmlib_engine(path: Path, kv: str, max_model_len: int, compile: bool | None = None) -> Any:
    """One sequence at a time, no prefix cache (a repeated prompt is computed again), ``kv``'s
    cache."""
    from llmlib.engine import LLM

    return LLM(path, max_num_seqs=1, max_model_len=max_model_len, enable_prefix_caching=False,
               compile=compile, kv_cache_dtype=kv)  # fmt: skip


def llmlib_perplexity(llm: Any, ids: list[int], context: int, stride: int) -> Perplexity:
    """Perplexity scored through the engine: each window a request with ``prompt_logprobs``."""
    from llmlib.sampling import SamplingParams

    sp = SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=0)

    def nll(begin: int, end: int, first: int) -> float:
        out = llm.generate([ids[begin:end]], sp, use_tqdm=False)[0]
        return logprobs_nll(out.prompt_logprobs, ids, begin, first, end)

    return over_windows(nll, len(ids), context, stride)


def llmlib_kv_bytes_per_token(llm: Any) -> float | None:
    """What the engine's pool holds per token, from its cache (None where it does not say)."""
    cache = getattr(getattr(llm, "runner", None), "cache", None)
    per_block, size = getattr(cache, "bytes_per_block", None), getattr(cache, "block_size", None)
    return per_block / size if per_block and size else None


def llama_kv_bytes_per_token(cfg: Any, kv: str) -> float:
    """llama.cpp's cache per token for the same model: keys and values of every layer, in its
    cache type (computed from the model's shape)."""
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * KV_CACHE_DTYPES[kv][2]


# ---- the run ------------------------------------------------------------------------------------
def run(
    path: Path,
    depths: list[int],
    kv_dtypes: list[str],
    new_tokens: int = 64,
    runs: int = 3,
    threads: int = 2,
    perplexity_tokens: int = 0,
    perplexity_context: int = 512,
    llama_cpp: bool = True,
    compile: bool | None = None,
) -> dict[str, Any]:
    import llmlib
    from llmlib.bench.formats import one_request
    from llmlib.device import machine_info
    from llmlib.perplexity import book_text_ids

    peer = llama_cpp and _llama_cpp.available()
    if llama_cpp and not peer:
        log("llama-cpp-python is not installed: llmlib alone")
    torch.set_num_threads(threads)
    tok = llmlib.load_tokenizer(path)
    text = book_text_ids(tok, max(depths))
    prompts = {n: prompt_of(text, n) for n in depths}
    max_len = max(max(depths) + new_tokens + SLACK, perplexity_context)
    gens, peers = {}, {}
    for kv in kv_dtypes:
        log(f"loading {path.name}, KV cache {kv}: llmlib" + (" and llama.cpp" if peer else ""))
        gens[kv] = g = llmlib_engine(path, kv, max_len, compile)
        log(f"  llmlib: {g.engine_config.describe()}; decode {g.runner.decode_path}")
        one_request(g, prompts[min(depths)], 2)  # the first steps allocate and pick kernels
        if peer:
            peers[kv] = _llama_cpp.llama(path, kv, threads, max_len)
            _llama_cpp.greedy(peers[kv], prompts[min(depths)], 2)
    keys = [(kv, n) for kv in kv_dtypes for n in depths]
    t: dict[str, dict[tuple[str, int], list[float]]] = {
        k: {key: [] for key in keys} for k in ("pp", "tg", "pp_peer", "tg_peer")
    }
    same: dict[tuple[str, int], bool] = {}
    for i in range(runs):
        for kv, n in keys:
            ours, step, prefill = one_request(gens[kv], prompts[n], new_tokens)
            t["pp"][kv, n].append(prefill)
            t["tg"][kv, n].append(step)
            line = (
                f"run {i + 1}/{runs} {kv} depth {n}: llmlib pp {n / prefill:.0f} tg {1 / step:.1f}"
            )
            if peer:
                theirs, step, prefill = _llama_cpp.greedy(peers[kv], prompts[n], new_tokens)
                t["pp_peer"][kv, n].append(prefill)
                t["tg_peer"][kv, n].append(step)
                same[kv, n] = ours == theirs
                line += f", llama.cpp pp {n / prefill:.0f} tg {1 / step:.1f} tok/s"
            log(line)
    rows = []
    for kv, n in keys:
        r: dict[str, Any] = {"kv_cache_dtype": kv, "depth": n}
        for who, pp, tg in (("llmlib", "pp", "tg"), ("llama_cpp", "pp_peer", "tg_peer")):
            if not t[pp][kv, n]:
                continue
            pp_s, tg_s = statistics.median(t[pp][kv, n]), statistics.median(t[tg][kv, n])
            r[f"{who}_prefill_s"] = round(pp_s, 4)
            r[f"{who}_prefill_tokens_per_s"] = round(n / pp_s, 1)
            r[f"{who}_decode_tokens_per_s"] = round(1 / tg_s, 2)
            r[f"{who}_prefill_seconds"] = [round(x, 4) for x in t[pp][kv, n]]
            r[f"{who}_decode_step_seconds"] = [round(x, 5) for x in t[tg][kv, n]]
        if peer:
            r["prefill_ratio"] = ratio(
                r["llmlib_prefill_tokens_per_s"], r["llama_cpp_prefill_tokens_per_s"]
            )
            r["decode_ratio"] = ratio(
                r["llmlib_decode_tokens_per_s"], r["llama_cpp_decode_tokens_per_s"]
            )
            r["same_greedy_tokens"] = same[kv, n]
        rows.append(r)
    cfg = next(iter(gens.values())).config
    kv_cache = {
        kv: {
            "llmlib_bytes_per_token": llmlib_kv_bytes_per_token(gens[kv]),
            "llama_cpp_type": KV_CACHE_DTYPES[kv][1],
            "llama_cpp_bytes_per_token": llama_kv_bytes_per_token(cfg, kv) if peer else None,
        }
        for kv in kv_dtypes
    }
    res: dict[str, Any] = {
        "machine": machine_info("cpu"),
        "model": path.name,
        "threads": threads,
        "llama_cpp_threads": threads if peer else None,
        "depths": depths,
        "kv_cache_dtypes": kv_dtypes,
        "new_tokens": new_tokens,
        "runs": runs,
        "llmlib_engine": {kv: g.engine_config.as_dict() for kv, g in gens.items()},
        "llmlib_decode_path": {kv: g.runner.decode_path for kv, g in gens.items()},
        "llama_cpp_build": _llama_cpp.build() if peer else None,
        "llama_cpp_n_batch": _llama_cpp.n_batch() if peer else None,
        "llama_cpp_flash_attn": True if peer else None,
        "rows": rows,
        "kv_cache": kv_cache,
    }
    if perplexity_tokens:
        res["perplexity"] = quality(
            path, gens, tok, perplexity_tokens, perplexity_context, threads, peer
        )
    return res


def quality(
    path: Path, gens: dict, tok: Any, n: int, context: int, threads: int, peer: bool
) -> dict[str, Any]:
    """Perplexity of ``n`` tokens of the book's text per engine and KV cache type, and each
    engine's ratio of every other cache type to ``auto``."""
    from llmlib.perplexity import book_text_ids

    ids = book_text_ids(tok, n)
    stride = max(context // 2, 1)
    out: dict[str, Any] = {"tokens": len(ids), "context": context, "stride": stride}
    ppl: dict[str, dict[str, float]] = {"llmlib": {}}
    for kv, g in gens.items():
        log(f"perplexity, llmlib {kv}: {len(ids)} tokens, windows of {context} by {stride}")
        p = llmlib_perplexity(g, ids, context, stride)
        ppl["llmlib"][kv] = round(p.perplexity, 4)
        out["scored_tokens"], out["windows"] = p.tokens, p.windows
        log(f"  {p.perplexity:.4f}")
    if peer:
        ppl["llama.cpp"] = {}
        for kv in gens:
            log(f"perplexity, llama.cpp {KV_CACHE_DTYPES[kv][1]} cache")
            llm = _llama_cpp.llama(path, kv, threads, context, logits_all=True)
            p = _llama_cpp.perplexity(llm, ids, context, stride)
            del llm
            ppl["llama.cpp"][kv] = round(p.perplexity, 4)
            log(f"  {p.perplexity:.4f}")
    out["perplexity"] = ppl
    out["vs_auto"] = {
        who: {kv: ratio(v, by_kv.get("auto")) for kv, v in by_kv.items() if kv != "auto"}
        for who, by_kv in ppl.items()
    }
    if peer:
        out["llmlib_vs_llama_cpp"] = {
            kv: ratio(ppl["llmlib"][kv], ppl["llama.cpp"][kv]) for kv in gens
        }
    return out


# ---- the table ----------------------------------------------------------------------------------
def format_table(res: dict[str, Any]) -> str:
    """The result as the plain table ``llmlib bench depth`` prints."""
    peer = res.get("llama_cpp_build") is not None
    lines = [
        f"{res['model']}, batch 1, {res['threads']} threads, {res['new_tokens']} new tokens, "
        f"median of {res['runs']} runs"
        + (f"; llama.cpp flash attention, n_batch {res['llama_cpp_n_batch']}" if peer else "")
    ]
    cols = [
        ("llmlib_prefill_s", "pp s", "{:.3f}"),
        ("llmlib_prefill_tokens_per_s", "pp tok/s", "{:.1f}"),
    ]
    if peer:
        cols += [("llama_cpp_prefill_s", "llama s", "{:.3f}"),
                 ("llama_cpp_prefill_tokens_per_s", "llama t/s", "{:.1f}"),
                 ("prefill_ratio", "x llama", "{:.2f}")]  # fmt: skip
    cols += [("llmlib_decode_tokens_per_s", "tg tok/s", "{:.1f}")]
    if peer:
        cols += [("llama_cpp_decode_tokens_per_s", "llama t/s", "{:.1f}"),
                 ("decode_ratio", "x llama", "{:.2f}")]  # fmt: skip
    lines.append(f"  {'KV cache':9s}{'depth':>7s}" + "".join(f"{h:>10s}" for _, h, _ in cols))
    for r in res["rows"]:
        cells = [f"{'-' if r.get(k) is None else f.format(r[k]):>10s}" for k, _, f in cols]
        lines.append(f"  {r['kv_cache_dtype']:9s}{r['depth']:>7d}" + "".join(cells))
    for kv, c in res["kv_cache"].items():
        b = c["llmlib_bytes_per_token"]
        line = f"  KV cache {kv}: llmlib {'-' if b is None else f'{b:,.0f}'} B/token"
        if c.get("llama_cpp_bytes_per_token"):
            line += (
                f", llama.cpp {c['llama_cpp_type']} {c['llama_cpp_bytes_per_token']:,.0f} B/token"
            )
        lines.append(line)
    q = res.get("perplexity")
    if q:
        lines.append(
            f"  perplexity of {q['tokens']} tokens of the book's text, windows of {q['context']} "
            f"by {q['stride']}:"
        )
        for who, by_kv in q["perplexity"].items():
            cells = ", ".join(
                f"{kv} {v:.4f}" + (f" ({q['vs_auto'][who][kv]:.4f}x auto)" if kv != "auto"
                                   and q["vs_auto"][who].get(kv) else "")
                for kv, v in by_kv.items()
            )  # fmt: skip
            lines.append(f"    {who:10s} {cells}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="llmlib bench depth", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a .gguf file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--depths", type=int_list, default=[512, 4096],
                    help="prompt lengths N, a comma list (default: 512,4096)")  # fmt: skip
    ap.add_argument("--new-tokens", type=int, default=64, help="greedy tokens decoded at depth N")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2,
                    help="torch threads for llmlib and llama.cpp's threads (default: 2)")  # fmt: skip
    ap.add_argument("--kv-cache-dtype", type=kv_list, default=["auto"],
                    help=f"KV cache types, a comma list of {', '.join(KV_CACHE_DTYPES)} (llama.cpp: "
                    "f16 for auto, q8_0 keys and values for int8; default: auto)")  # fmt: skip
    ap.add_argument("--perplexity-tokens", type=int, default=0,
                    help="also perplexity on this many tokens of the book's text (default 0: skip)")  # fmt: skip
    ap.add_argument("--perplexity-context", type=int, default=512,
                    help="perplexity's window (default 512; stride: half of it)")  # fmt: skip
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="llmlib's step compiled (default: as `llmlib generate` runs)")  # fmt: skip
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    if args.new_tokens < 2 or args.runs < 1 or args.threads < 1:
        ap.error("--new-tokens must be >= 2, --runs and --threads >= 1")
    if args.perplexity_tokens and (args.perplexity_tokens < 2 or args.perplexity_context < 2):
        ap.error("--perplexity-tokens and --perplexity-context must be >= 2")
    from llmlib.checkpoints import resolve_model_path

    path = resolve_model_path(args.model)
    before = torch.get_num_threads()
    try:
        res = run(path, args.depths, args.kv_cache_dtype, args.new_tokens, args.runs,
                  args.threads, args.perplexity_tokens, args.perplexity_context,
                  llama_cpp=not args.no_llama_cpp, compile=args.compile)  # fmt: skip
    except ValueError as e:  # an engine that cannot take the cache type, or the length
        print(f"llmlib bench depth: {e}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(before)
    save_json(res, args.out)
    print(json.dumps(res, indent=2) if args.json else format_table(res))
    return 0
