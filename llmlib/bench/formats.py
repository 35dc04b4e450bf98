"""``llmlib bench generate --formats ...``: every weight format side by side, in one run.

For each format (``float32``, ``bfloat16``, ``int8``, ``int4``, ``gguf``; ``NAME+compile`` for
the compiled step, as ``llmlib generate`` runs by default) the same file is loaded, and the same
prompt is decoded greedily at batch 1 for the same number of new tokens, by the product path:
the batching engine with one sequence (``LLM(..., max_num_seqs=1)``). Runs go round-robin over the formats so a noisy
neighbour slows all alike; medians are reported, with ratios against float32 from this run.

Per format: decode tokens/s; prefill's seconds for the prompt; the bytes one decode step reads
(every weight matrix as stored, scales included, plus the KV cache at the mean length); that
traffic as a share of the read bandwidth measured in the same run
(:func:`llmlib.analysis.roofline.measure_bandwidth`); the resident memory the loaded weights add to
a fresh process, against the bytes the format stores; and, with ``--perplexity-tokens``, perplexity
on the book's text, KL divergence from float32 and the share of greedy tokens that agree
(:mod:`llmlib.perplexity`). Where ``llama-cpp-python`` is installed, llama.cpp decodes the same
weights in the same run, at each format's bits per weight (:mod:`llmlib.bench._llama_cpp`: F32,
BF16 and Q8_0 copies of the file, and the file itself).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from llmlib.bench import _llama_cpp
from llmlib.bench.memory import rss_anon

FORMATS = {  # name -> (dtype, quantization); None: the activations pick_dtype chooses here
    "float32": ("float32", None),
    "bfloat16": ("bfloat16", None),
    "int8": (None, "int8"),
    "int4": (None, "int4"),
    "gguf": (None, "gguf"),
}


def format_of(name: str) -> tuple[str, str | None]:
    """A format's ``(dtype, quantization)`` on this CPU: the integer formats run bfloat16
    activations where bfloat16 is native and float32 elsewhere, as ``load_model`` picks them."""
    from llmlib.device import pick_dtype

    dtype, q = FORMATS[name]
    return dtype or str(pick_dtype("cpu", None, q)).removeprefix("torch."), q


def parse_formats(text: str) -> list[tuple[str, bool]]:
    """``"float32,gguf+compile"`` -> ``[("float32", False), ("gguf", True)]``."""
    out = []
    for item in text.split(","):
        name, _, extra = item.strip().partition("+")
        if name not in FORMATS or extra not in ("", "compile"):
            raise ValueError(f"unknown format {item!r}; one of {sorted(FORMATS)} (+compile)")
        out.append((name, extra == "compile"))
    return out


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads from the weights: every matrix it multiplies by as stored
    (packed codes and scales, or the dense matrix), the norms, one embedding row."""
    from llmlib.kernels.prepare import read_bytes, weight_matrices
    from llmlib.kernels.weights import PackedWeight

    mats = weight_matrices(model)
    total = 0
    for mod in mats.values():
        total += read_bytes(mod.weight)
    for p in model.parameters():
        if p.dim() == 1:
            total += p.numel() * p.element_size()
    if "embed" not in mats:  # one row of the table, dense or packed (an untied table's codes)
        e = model.embed.weight
        total += (
            e.nbytes // e.shape[0] if isinstance(e, PackedWeight) else e.shape[1] * e.element_size()
        )
    return total


def stored_bytes(model: torch.nn.Module) -> int:
    """Bytes the format stores: every tensor of the model once (parameters and packed buffers)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_mkldnn:  # oneDNN's opaque blocked layout: no storage to ask
            total += t.numel() * t.element_size()
            continue
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if t.device.type != "meta" and key not in seen:
            seen.add(key)
            total += key[1]
    for m in model.modules():  # float32's oneDNN copies, held beside the module's buffers
        blocked = getattr(m, "blocked", None)
        if isinstance(blocked, torch.Tensor):
            total += blocked.numel() * blocked.element_size()
    return total - sum(b.untyped_storage().nbytes() for b in model.rope.buffers())


def resident_bytes(path: Path, dtype: str, quantization: str | None) -> dict[str, int]:
    """What loading the format adds to a fresh process's resident memory (after, and at its peak
    on the way: :func:`llmlib.bench.memory.load_memory`), and what it stores."""
    from llmlib.bench.memory import load_memory

    return load_memory(path, dtype, quantization)


def run(
    path: Path,
    formats: list[tuple[str, bool]],
    new_tokens: int = 64,
    runs: int = 3,
    threads: int = 2,
    prompt: str = "What is a quadratic equation?",
    perplexity_tokens: int = 0,
    memory: bool = True,
    llama_cpp: bool = True,
    log=print,
) -> dict[str, Any]:
    import llmlib
    from llmlib.analysis.roofline import measure_bandwidth
    from llmlib.device import machine_info, timings
    from llmlib.engine import LLM

    torch.set_num_threads(threads)
    tok = llmlib.load_tokenizer(path)
    gens: dict[str, LLM] = {}
    rows: dict[str, dict[str, Any]] = {}
    for name, comp in formats:
        label = name + ("+compile" if comp else "")
        dtype, q = format_of(name)
        model = llmlib.load_model(path, "cpu", dtype, q)
        before = rss_anon()
        gens[label] = g = LLM(model, tok, max_num_seqs=1, compile=comp)
        t0 = time.perf_counter()
        one_request(g, [1, 2], 3)  # the first step allocates and picks kernels (or compiles)
        warm = (g.compile_s or 0.0) + time.perf_counter() - t0
        # what compiling added to this process: workspace, and the constants a frozen graph owns
        grown = None if before is None or not comp else rss_anon() - before
        rows[label] = {
            "name": label,
            "dtype": dtype,
            "quantization": q,
            "compiled": comp,
            "weight_format": model.weight_format,
            "decode_path": g.runner.decode_path,
            "compile_s": round(warm, 2) if comp else None,
            "compile_resident_bytes": grown,
            "weight_bytes_per_token": weight_bytes(model),
        }
        log(
            f"loaded {label}: {model.weight_format}, decode {g.runner.decode_path}"
            + (f" in {warm:.1f} s" if comp and g.compile_s else "")
            + (f", +{grown / 2**20:.0f} MiB resident" if grown is not None else "")
        )
    ids = next(iter(gens.values())).encode([{"role": "user", "content": prompt}])[1]
    peers: dict[str, Any] = {}  # llama.cpp at each format's bits per weight, on the same weights
    if llama_cpp and _llama_cpp.available():
        for kind in dict.fromkeys(_llama_cpp.PEER_TYPES[n] for n, _ in formats):
            copy = _llama_cpp.copy_of(path, kind, threads)
            peers[_llama_cpp.label(kind)] = _llama_cpp.decoder(copy, threads, ids, new_tokens)
    times: dict[str, list[float]] = {k: [] for k in [*gens, *peers]}
    prefills: dict[str, list[float]] = {k: [] for k in [*gens, *peers]}
    tokens: dict[str, list[int]] = {}
    for decode in peers.values():
        decode()  # warm up
    bw = []
    for i in range(runs):
        bw.append(statistics.median(measure_bandwidth("cpu", reps=3)))
        for label, g in gens.items():

            def once(g=g, label=label) -> None:
                tokens[label], step_s, prefill_s = one_request(g, ids, new_tokens)
                times[label].append(step_s)
                prefills[label].append(prefill_s)

            timings(once, warmup=0, reps=1)
        for name, decode in peers.items():
            toks, secs, prefill = decode()
            tokens[name] = toks
            times[name].append(secs / (new_tokens - 1))
            prefills[name].append(prefill)
        log(f"run {i + 1}/{runs}: " + ", ".join(f"{k} {1 / v[-1]:.1f}" for k, v in times.items()))
    bandwidth = statistics.median(bw)
    ref = tokens.get("float32") or next(iter(tokens.values()))
    kv_len = len(ids) + new_tokens / 2
    cfg = next(iter(gens.values())).config
    for label, g in gens.items():
        r = rows[label]
        step = statistics.median(times[label])
        kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * kv_len * g.dtype.itemsize
        r["tokens_per_s"] = round(1 / step, 2)
        r["prefill_s"] = round(statistics.median(prefills[label]), 4)
        r["bytes_per_token"] = int(r["weight_bytes_per_token"] + kv)
        r["bandwidth_share"] = round(r["bytes_per_token"] / step / bandwidth, 3)
        r["same_tokens_as_float32"] = round(
            sum(a == b for a, b in zip(tokens[label], ref)) / len(ref), 3
        )
    for name in peers:
        step = statistics.median(times[name])
        rows[name] = {
            "name": name,
            "tokens_per_s": round(1 / step, 2),
            "prefill_s": round(statistics.median(prefills[name]), 4),
            "prefill_n_batch": _llama_cpp.n_batch(),
        }
    base = rows.get("float32", {}).get("tokens_per_s")
    for r in rows.values():
        r["vs_float32"] = round(r["tokens_per_s"] / base, 2) if base else None
        peer = _llama_cpp.label(_llama_cpp.PEER_TYPES.get(r["name"].split("+")[0]))
        if peer in rows and r["name"] not in peers:
            r["llama_cpp_peer"] = peer
            r["vs_llama_cpp"] = round(r["tokens_per_s"] / rows[peer]["tokens_per_s"], 2)
    if perplexity_tokens:
        eager = {k: g.model for k, g in gens.items() if not rows[k]["compiled"]}
        quality(eager, tok, perplexity_tokens, rows, log)
    if memory:
        for label, r in rows.items():
            if label in peers or r["compiled"]:
                continue
            m = resident_bytes(path, r["dtype"], r["quantization"])
            r["resident_bytes"], r["stored_bytes"] = m["rss"], m["stored"]
            r["load_peak_bytes"] = m["peak"]
            r["resident_vs_stored"] = round(m["rss"] / m["stored"], 3)
            r["load_peak_vs_resident"] = round(m["peak"] / max(m["rss"], 1), 3)
    return {
        "machine": machine_info("cpu"),
        "model": path.name,
        "threads": threads,
        "prompt_tokens": len(ids),
        "new_tokens": new_tokens,
        "runs": runs,
        "read_bandwidth_bytes_per_s": bandwidth,
        "formats": list(rows.values()),
        "llama_cpp_build": _llama_cpp.build() if peers else None,
    }


def one_request(llm: Any, ids: list[int], new_tokens: int) -> tuple[list[int], float, float]:
    """One greedy request of ``new_tokens`` through ``llm`` alone: its tokens, the seconds a
    decode step took (the mean after the first token) and the time to its first token."""
    from llmlib.sampling import SamplingParams

    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    out = llm.generate([ids], sp, use_tqdm=False)[0]
    m = out.metrics
    steps = max(len(out.token_ids) - 1, 1)
    return out.token_ids, (m.finished_time - m.first_token_time) / steps, m.time_to_first_token


def quality(models: dict, tok, n: int, rows: dict, log) -> None:
    """Perplexity of each model on ``n`` tokens of the book's text, and against ``models``'s
    float32 (if present) its ratio, KL divergence and greedy agreement, into ``rows[label]``."""
    from llmlib.perplexity import book_text_ids, compare, perplexity

    ids = book_text_ids(tok, n)
    ref = models.get("float32")
    ppl_ref = perplexity(ref, ids) if ref is not None else None
    for label, model in models.items():
        ppl = ppl_ref if model is ref else perplexity(model, ids)
        r = rows[label]
        r["perplexity"] = round(ppl, 4)
        if ppl_ref:
            r["perplexity_vs_float32"] = round(ppl / ppl_ref, 4)
            if model is not ref:
                c = compare(ref, model, ids)
                r["kl_vs_float32"] = round(c.kl, 5)
                r["greedy_agreement"] = round(c.greedy_agreement, 4)
        log(f"{label}: perplexity {ppl:.3f}")


def print_table(res: dict[str, Any]) -> None:
    bw = res["read_bandwidth_bytes_per_s"]
    print(
        f"{res['model']}, batch 1, {res['threads']} threads, {res['new_tokens']} new tokens, "
        f"median of {res['runs']} runs; measured read bandwidth {bw / 1e9:.1f} GB/s"
    )
    cols = (
        ("tokens_per_s", "tok/s", "{:8.1f}"),
        ("prefill_s", "prefill", "{:8.3f}"),
        ("vs_float32", "x fp32", "{:7.2f}"),
        ("vs_llama_cpp", "x llama", "{:8.2f}"),
        ("bytes_per_token", "MB/tok", "{:7.1f}"),
        ("bandwidth_share", "of BW", "{:6.0%}"),
        ("resident_bytes", "RSS MB", "{:7.1f}"),
        ("resident_vs_stored", "/stored", "{:8.2f}"),
        ("load_peak_vs_resident", "peak/res", "{:8.2f}"),
        ("cold_start_s", "cold s", "{:7.1f}"),
        ("warm_start_s", "warm s", "{:7.1f}"),
        ("start_peak_rss_bytes", "start MB", "{:8.0f}"),  # peak resident at the first token
        ("perplexity", "ppl", "{:7.3f}"),
        ("kl_vs_float32", "KL", "{:8.5f}"),
        ("greedy_agreement", "agree", "{:6.1%}"),
    )
    print(f"  {'format':16s}" + "".join(f"{h:>9s}" for _, h, _ in cols))
    for r in res["formats"]:
        cells = []
        for key, _, fmt in cols:
            v = r.get(key)
            if v is None:
                cells.append(f"{'-':>9s}")
            else:
                scaled = ("bytes_per_token", "resident_bytes", "start_peak_rss_bytes")
                v = v / 1e6 if key in scaled else v
                cells.append(f"{fmt.format(v):>9s}")
        print(f"  {r['name']:16s}" + "".join(cells))
    for r in res["formats"]:
        if r.get("weight_format"):
            print(f"  {r['name']}: {r['weight_format']}")


def breakdown(
    path: Path,
    names: tuple[str, ...] = ("float32", "bfloat16", "int8", "gguf"),
    context: int = 64,
    reps: int = 5,
) -> dict[str, dict[str, float]]:
    """Per format, Going further 1's decomposition of one batch-1 decode step
    (:func:`llmlib.bench.roofline.decode_breakdown`): the full step, the weight matrices alone as
    stored, and the same format's 30-layer skeleton (overhead), plus the bytes the step reads."""
    import llmlib
    from llmlib.bench.roofline import decode_breakdown, overhead_model
    from llmlib.kernels.prepare import prepare, quantize_model
    from llmlib.model import random_model

    out = {}
    for name in names:
        dtype, q = format_of(name)
        model = llmlib.load_model(path, "cpu", dtype, q)
        skeleton = random_model(overhead_model(model.config), "cpu", model.dtype)
        if q is not None:
            quantize_model(skeleton, "int4" if q == "gguf" else q)
        else:
            prepare(skeleton)
        bd = decode_breakdown(model, skeleton, context, reps)
        out[name] = {
            **bd,
            "weight_bytes": float(weight_bytes(model)),
            "format": model.weight_format,
        }
        del model
    return out


def _weight_matrices(model: torch.nn.Module) -> dict:
    from llmlib.kernels.prepare import weight_matrices

    return weight_matrices(model)


def fp32_copy_check(
    run_continuous, model, tokenizer, requests, con, *engine_args, log=print
) -> dict | None:
    """Whether a second, oneDNN-blocked copy of a float32 CPU model's matrices
    (:class:`llmlib.kernels.weights.Float32Weight`'s ``blocked``, used for multi-row products)
    pays for itself: the continuous run again with it (or without it, where the loader made it),
    in the same run, and the bytes it costs: the measurement behind the loader's choice
    (:attr:`llmlib.kernels.flags.Flags.onednn_float32`)."""
    from llmlib.kernels.prepare import blocked_copies
    from llmlib.kernels.weights import Float32Weight

    mats = [m.weight for m in _weight_matrices(model).values()]
    if not mats or not all(isinstance(w, Float32Weight) for w in mats):
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    was_packed = any(w.blocked is not None for w in mats)  # the main run had the copy
    extra = sum(w.w.numel() * 4 for w in mats)  # the copy is as big as the matrices
    blocked_copies(model, not was_packed)
    try:
        other = run_continuous(model, tokenizer, requests, *engine_args)
    finally:
        blocked_copies(model, was_packed)
    total = sum(r.max_tokens for r in requests)
    main, second = total / con["seconds"], total / other["seconds"]
    w, wo = (main, second) if was_packed else (second, main)
    log(
        f"  float32 oneDNN copy: continuous {w:.1f} tok/s with it, {wo:.1f} without "
        f"({w / wo:.2f}x) for {extra / 2**20:.0f} MiB more"
    )
    return {"with_tok_s": w, "without_tok_s": wo, "ratio": w / wo, "extra_bytes": extra}
