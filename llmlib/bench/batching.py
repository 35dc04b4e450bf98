"""``llmlib bench batching``: sequential, static and continuous batching on the same requests.

Three ways to serve one list of requests (prompt lengths and output lengths drawn with a seed;
every request generates exactly its ``max_tokens``, ignoring EOS, so all modes do the same useful
work):

* sequential — the :class:`~llmlib.generate.Generator`, one request at a time (batch 1);
* static — fixed batches of ``--static-batch`` requests in arrival order, prompts left-padded to the
  longest, a static KV cache (:class:`~llmlib.model.kv_cache.KVCache`) sized for the longest prompt plus
  the longest output, every row computed until the batch's longest request is done;
* continuous — :class:`~llmlib.engine.LLM` over the paged cache, at most ``--max-num-seqs`` at once.

Static and continuous get the same KV memory (``--kv-budget-tokens`` positions per layer), which
is the comparison that matters to a server: a static batch must reserve room for the longest
possible request in every slot (``max prompt + max output`` positions), so the budget fixes its
batch size; the paged engine hands the same memory out block by block as sequences actually grow,
so more sequences fit, and it preempts when they do not. ``--static-batch`` overrides the size.

Printed: output tokens per second of each, the ratios, and the KV memory allocated but unused
(averaged over steps): for the paged cache, the empty tails of last blocks among the blocks in use;
for the static cache, everything in the batch's preallocation not holding a real token (padding,
room reserved for tokens not yet generated, rows that already finished).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from llmlib.bench import save_json
from llmlib.bench._workload import Request, make_requests, run_continuous
from llmlib.bench.invariance import cost_summary
from llmlib.model.attention import KVCacheLike
from llmlib.model.kv_cache import KVCache

# ---- static batching ------------------------------------------------------------------------------


class PaddedStaticCache(KVCacheLike):
    """The static KV cache for a left-padded batch: hides the padding slots from attention.

    Rows are left-padded so every row's newest token sits in the same column; the wrapped
    :class:`KVCache` stores the pads like any token, and this wrapper adds "not a pad" to the mask.
    """

    def __init__(self, inner: KVCache, pad: torch.Tensor) -> None:
        self.inner = inner
        self.pad = pad  # [B] number of pad slots at the start of each row
        self._mask: torch.Tensor | None = None

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None = None
    ):
        start = self.inner.length
        k_all, v_all, _ = self.inner.update(layer, k, v, positions)
        if layer == 0:
            T, S = k.shape[2], start + k.shape[2]
            q_pos = torch.arange(start, S).view(1, T, 1)
            k_pos = torch.arange(S).view(1, 1, S)
            real = k_pos >= self.pad.view(-1, 1, 1)  # [B, 1, S]
            mask = (k_pos <= q_pos) & real  # [B, T, S]
            mask |= k_pos == q_pos  # a pad query sees itself (never all -inf); its output is unused
            self._mask = mask.unsqueeze(1)
        return k_all, v_all, self._mask


@torch.inference_mode()
def run_static(model: Any, requests: list[Request], batch_size: int) -> dict[str, Any]:
    """Static batching; returns outputs, time and the cache's measured allocated-but-unused share."""
    cfg = model.config
    p = next(model.parameters())
    outputs: list[list[int]] = []
    slots_alloc = slots_used = 0
    t0 = time.perf_counter()
    for b0 in range(0, len(requests), batch_size):
        batch = requests[b0 : b0 + batch_size]
        B = len(batch)
        L = max(len(r.prompt_ids) for r in batch)
        steps = max(r.max_tokens for r in batch)
        pad = torch.tensor([L - len(r.prompt_ids) for r in batch])
        ids = torch.zeros((B, L), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, L - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
        cache = PaddedStaticCache(
            KVCache.from_config(cfg, batch=B, max_len=L + steps, device=p.device, dtype=p.dtype),
            pad,
        )
        pos = (torch.arange(L).view(1, L) - pad.view(B, 1)).clamp(min=0)
        logits = model(ids.to(p.device), pos.to(p.device), cache, last_only=True)
        tok = logits[:, -1].argmax(-1)
        out = [[int(t)] for t in tok]
        for s in range(1, steps):
            # memory: the whole [B, L + steps] preallocation vs the slots holding real tokens
            slots_alloc += B * (L + steps)
            slots_used += sum(len(r.prompt_ids) + min(s, r.max_tokens) for r in batch)
            logits = model(tok.view(B, 1), (pos[:, -1:] + s).to(p.device), cache, last_only=True)
            tok = logits[:, -1].argmax(-1)
            for i, t in enumerate(tok.tolist()):
                out[i].append(t)
        outputs += [o[: r.max_tokens] for o, r in zip(out, batch)]
    dt = time.perf_counter() - t0
    return {
        "outputs": outputs,
        "seconds": dt,
        "waste": 1 - slots_used / slots_alloc if slots_alloc else 0.0,
    }


def run_sequential(model: Any, tokenizer: Any, requests: list[Request]) -> dict[str, Any]:
    from llmlib.generate import Generator

    gen = Generator(model, tokenizer)
    t0 = time.perf_counter()
    outputs = [
        gen.generate(
            r.prompt_ids, max_new_tokens=r.max_tokens, temperature=0.0, ignore_eos=True
        ).token_ids
        for r in requests
    ]
    return {"outputs": outputs, "seconds": time.perf_counter() - t0}


def static_batch_for_budget(requests: list[Request], kv_budget_tokens: int) -> int:
    """How many slots a static cache of ``kv_budget_tokens`` positions holds when every slot must be
    ready for the longest request of the workload (longest prompt + longest output)."""
    worst = max(len(r.prompt_ids) for r in requests) + max(r.max_tokens for r in requests)
    return max(1, kv_budget_tokens // worst)


def bench(
    model: Any,
    tokenizer: Any,
    requests: list[Request],
    *,
    static_batch: int | None = None,
    max_num_seqs: int = 64,
    block_size: int = 16,
    max_num_batched_tokens: int = 512,
    sequential_subset: int | None = None,
    kv_budget_tokens: int | None = 8192,
    repeats: int = 1,
    log=print,
    batch_invariant: bool = False,
) -> dict[str, Any]:
    """Run all three modes on ``requests``; return tokens/s, ratios and waste.

    ``kv_budget_tokens`` gives static and continuous batching the same KV memory: the paged pool
    has ``kv_budget_tokens // block_size`` blocks, and the static batch size is what that memory
    holds at the workload's worst case (unless ``static_batch`` is given). ``None``: the engine's
    default pool. ``sequential_subset`` times the sequential mode on the first k requests only (it
    is by far the slowest) and reports its tokens/s from those; the batched modes run everything,
    ``repeats`` times each, alternating, and report the median time (this machine is noisy).
    ``batch_invariant`` adds continuous batching in batch-invariant mode to the alternation
    (:mod:`llmlib.engine.invariant`) and reports its throughput against the default mode's.
    """
    num_blocks = None if kv_budget_tokens is None else kv_budget_tokens // block_size
    if static_batch is None:
        static_batch = (
            static_batch_for_budget(requests, kv_budget_tokens) if kv_budget_tokens else 16
        )
    total = sum(r.max_tokens for r in requests)
    if kv_budget_tokens:
        log(
            f"KV budget for both batched modes: {kv_budget_tokens} positions per layer "
            f"({num_blocks} blocks of {block_size}; static batch {static_batch})"
        )
    seq_reqs = requests[:sequential_subset] if sequential_subset else requests
    log(f"{len(requests)} requests, {total} output tokens; sequential on {len(seq_reqs)}")
    seq = run_sequential(model, tokenizer, seq_reqs)
    seq_tps = sum(r.max_tokens for r in seq_reqs) / seq["seconds"]
    log(f"  sequential   {seq_tps:8.1f} tok/s  ({seq['seconds']:.1f} s)")
    runs: dict[str, list[dict[str, Any]]] = {"static": [], "continuous": [], "batch_invariant": []}
    engine = (max_num_seqs, block_size, max_num_batched_tokens, num_blocks)
    for _ in range(max(1, repeats)):
        runs["static"].append(run_static(model, requests, static_batch))
        runs["continuous"].append(run_continuous(model, tokenizer, requests, *engine))
        if batch_invariant:
            runs["batch_invariant"].append(
                run_continuous(model, tokenizer, requests, *engine, batch_invariant=True)
            )
    sta, con = (
        sorted(runs[m], key=lambda r: r["seconds"])[(len(runs[m]) - 1) // 2]
        for m in ("static", "continuous")
    )
    ran = [(m, rs) for m, rs in runs.items() if rs]
    if repeats > 1:
        log(
            "  runs (s): "
            + "; ".join(f"{m} " + ", ".join(f"{r['seconds']:.1f}" for r in rs) for m, rs in ran)
            + " -> medians below"
        )
    sta_tps = total / sta["seconds"]
    log(
        f"  static  B={static_batch:<3} {sta_tps:7.1f} tok/s  ({sta['seconds']:.1f} s), "
        f"KV allocated but unused {sta['waste']:.1%}"
    )
    con_tps = total / con["seconds"]
    log(
        f"  continuous   {con_tps:8.1f} tok/s  ({con['seconds']:.1f} s), KV allocated but unused {con['waste']:.1%}"
        f" (block size {block_size}), preemptions {con['stats'].preemptions}"
    )
    invariant = cost_summary(runs["batch_invariant"], con, total, log) if batch_invariant else None
    # the three must agree on the tokens (greedy) wherever they ran the same requests
    from llmlib.bench.formats import fp32_copy_check

    copy = fp32_copy_check(run_continuous, model, tokenizer, requests, con, *engine, log=log)
    agree_static = sum(a == b for a, b in zip(sta["outputs"], con["outputs"])) / len(requests)
    agree_seq = sum(a == b for a, b in zip(seq["outputs"], con["outputs"])) / len(seq_reqs)
    from llmlib.device import machine_info

    return {
        "machine": machine_info("cpu" if next(model.parameters()).device.type == "cpu" else None),
        "weight_format": getattr(model, "weight_format", str(model.dtype)),
        "num_requests": len(requests),
        "output_tokens": total,
        "threads": torch.get_num_threads(),
        "static_batch": static_batch,
        "max_num_seqs": max_num_seqs,
        "block_size": block_size,
        "kv_budget_tokens": kv_budget_tokens,
        "tokens_per_s": {"sequential": seq_tps, "static": sta_tps, "continuous": con_tps},
        "seconds": {
            "sequential": seq["seconds"],
            "static": sta["seconds"],
            "continuous": con["seconds"],
        },
        "repeats": max(1, repeats),
        "seconds_all_runs": {m: [r["seconds"] for r in rs] for m, rs in ran},
        "ratio_continuous_vs_sequential": con_tps / seq_tps,
        "ratio_continuous_vs_static": con_tps / sta_tps,
        "ratio_static_vs_sequential": sta_tps / seq_tps,
        "kv_waste": {"static": sta["waste"], "paged": con["waste"]},
        "paged_peak_used_blocks": con["peak_used_blocks"],
        "paged_pool_blocks": con["pool_blocks"],
        "preemptions": con["stats"].preemptions,
        "same_tokens_as_continuous": {"sequential": agree_seq, "static": agree_static},
        "fp32_onednn_copy": copy,
        "batch_invariant": invariant,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="llmlib bench batching", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model", default=None, help="a .gguf file or HF folder (default: SmolLM2-135M-Instruct)"
    )
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(20, 200), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    ap.add_argument(
        "--kv-budget-tokens",
        type=int,
        default=8192,
        help="KV positions per layer given to both static and continuous batching (0: engine default pool)",
    )
    ap.add_argument(
        "--static-batch",
        type=int,
        default=None,
        help="batch size of the static baseline (default: what the KV budget holds at the worst case)",
    )
    ap.add_argument("--max-num-seqs", type=int, default=64, help="most sequences running at once")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument(
        "--sequential-subset", type=int, help="time the slow sequential mode on N requests only"
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="run static and continuous batching this many times each (alternating); report medians",
    )
    ap.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's choice)"
    )
    ap.add_argument("--batch-invariant", action="store_true", help="time that mode too")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--out", default=None, help="also write the results as JSON to this file")
    from llmlib.bench.batching_formats import add_formats_args, main_formats
    from llmlib.cli.common import add_format_args, model_format

    add_format_args(ap, auto=False)
    ap.add_argument("--device", default="cpu")
    add_formats_args(ap)
    args = ap.parse_args(argv)
    if args.num_requests < 1:
        ap.error("--num-requests must be >= 1")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    log = (lambda *a, **k: print(*a, **k, file=sys.stderr)) if args.json else print
    if args.formats:
        return main_formats(ap, args, log)
    from llmlib.generate import load_generator

    device, dtype, q = model_format(args)
    gen = load_generator(args.model, device, dtype, q, group_size=args.group_size)
    model, tok = gen.model, gen.tokenizer
    log(f"weights: {gen.weight_format}")
    reqs = make_requests(
        args.num_requests,
        model.config.vocab_size,
        args.seed,
        tuple(args.prompt_len),
        tuple(args.output_len),
    )
    res = bench(
        model,
        tok,
        reqs,
        static_batch=args.static_batch,
        max_num_seqs=args.max_num_seqs,
        kv_budget_tokens=args.kv_budget_tokens or None,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        sequential_subset=args.sequential_subset,
        repeats=args.repeats,
        log=log,
        batch_invariant=args.batch_invariant,
    )
    save_json(res, args.out)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(f"continuous / sequential: {res['ratio_continuous_vs_sequential']:.2f}x (goal >= 4)")
        print(f"continuous / static:     {res['ratio_continuous_vs_static']:.2f}x (goal >= 1.5)")
        print(
            f"KV allocated but unused: paged {res['kv_waste']['paged']:.1%} (goal <= 5%), "
            f"static {res['kv_waste']['static']:.1%}"
        )
        print(
            f"greedy tokens equal to continuous: sequential {res['same_tokens_as_continuous']['sequential']:.0%}, "
            f"static {res['same_tokens_as_continuous']['static']:.0%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
