"""One layer's decode attention over the paged pool, read in place by the Triton kernel against the
gather path it replaces (every row's blocks copied by ``index_select``, then SDPA), at the GPU
check's engine setting by default: 256 rows of 128 blocks of 16 keys, 32 query heads over 8 KV
heads of 128 channels (the 8B shape), bfloat16.

    python benchmarks/paged_attention_gpu.py --out /tmp/paged_attention_gpu.json

For each path: the median time of a step's attention (CUDA events, after warming up), the bytes
of every row's keys and values over that time (a ``--window`` reads fewer), the memory it
allocates above what it holds, and whether the two paths agree. ``--device cpu --rows 8
--blocks 4`` checks the script on a CPU (the C++ kernel takes the Triton kernel's place there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from llmlib.engine.paged_cache import PagedKVCache, SeqChunk
from llmlib.model.attention import AttentionSpec


def run(args: argparse.Namespace) -> dict:
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    rows, nb, bs, D = args.rows, args.blocks, args.block_size, args.head_dim
    H, Hkv = args.heads, args.kv_heads
    cache = PagedKVCache(1, rows * nb + 1, Hkv, bs, D, device=dev, dtype=dtype)
    for pool in (cache.k[0], cache.v[0]):
        pool.normal_()
    served = cache.kernel
    # every row full to its last block, its blocks scattered over the pool
    perm = torch.randperm(rows * nb).view(rows, nb).tolist()
    chunks = [[SeqChunk(perm[i], nb * bs - 1, 1)] for i in range(rows)]
    q = torch.randn(rows, H, 1, D, device=dev, dtype=dtype)
    k, v = (torch.randn(rows, Hkv, 1, D, device=dev, dtype=dtype) for _ in range(2))
    spec = AttentionSpec(window=args.window)
    kv_bytes = 2 * rows * nb * bs * Hkv * D * cache.k[0].element_size()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out, res = {}, {"device": str(dev), "served_by_kernel": served, "kv_bytes": kv_bytes}
    for name, kernel in (("kernel", True), ("gather", False)):
        cache.kernel = kernel and served
        step = cache.step(chunks)
        for _ in range(3):
            out[name] = step.attend(0, q, k, v, spec)
        times = []
        for _ in range(args.repeats):
            sync()
            if dev.type == "cuda":
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                step.attend(0, q, k, v, spec)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t = time.perf_counter()
                step.attend(0, q, k, v, spec)
                times.append(time.perf_counter() - t)
        peak = None
        if dev.type == "cuda":
            sync()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step.attend(0, q, k, v, spec)
            sync()
            peak = torch.cuda.max_memory_allocated() - base
        t = statistics.median(times)
        res[name] = {"ms": t * 1e3, "kv_GB_per_s": kv_bytes / t / 1e9, "extra_bytes": peak}
    diff = (out["kernel"].float() - out["gather"].float()).abs().max().item()
    res["max_abs_diff"] = diff
    res["agree"] = diff < (1e-4 if dtype == torch.float32 else 2e-2)
    res["speedup"] = res["gather"]["ms"] / res["kernel"]["ms"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--window", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res = run(args)
    res["args"] = vars(args)
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
