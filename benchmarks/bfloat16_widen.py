"""bfloat16 prompts on a CPU without bfloat16 arithmetic: widened to float32, or not, in one run.

    LLMLIB_AS_CPU=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        python benchmarks/bfloat16_widen.py --out results/cpu/bfloat16_widen_as_avx2.json

The book's model is loaded three times in one process: in float32 (the reference), and in
bfloat16 with the flag ``bfloat16_widen`` forced on and off and oneDNN's blocked layout off
(:class:`llmlib.kernels.bfloat16.Bfloat16Weight`, or plain matrices that PyTorch multiplies in
bfloat16). Each reads the same chat prompt and decodes a few tokens, eagerly, in turns, and the
record keeps the median prefill and decode step of each, with the ratios to float32. On a CPU
with bfloat16 arithmetic the widened product is not the default; the run still shows both.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--prompt", default="What is a quadratic equation?")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import llmlib
    from llmlib.checkpoints.fetch import fetch_model
    from llmlib.device import machine_info
    from llmlib.kernels.flags import flags, forced

    torch.set_num_threads(args.threads)
    path = fetch_model(quiet=True)
    tok = llmlib.load_tokenizer(path)
    cases = {"float32": (torch.float32, None)}
    cases |= {"bfloat16 widened": (torch.bfloat16, True), "bfloat16 plain": (torch.bfloat16, False)}
    gens = {}
    for name, (dtype, widen) in cases.items():
        # oneDNN's blocked layout, where the CPU has one, would take every bfloat16 matrix first
        changes = {} if widen is None else {"bfloat16_widen": widen, "onednn_bfloat16": False}
        with forced(**changes):  # a model keeps the choices it was loaded with
            model = llmlib.load_model(path, "cpu", dtype)
        gens[name] = llmlib.Generator(model, tok, compile=False)
    ids = gens["float32"].encode_prompt(args.prompt, chat=True)[1]
    prefill: dict[str, list[float]] = {n: [] for n in gens}
    step: dict[str, list[float]] = {n: [] for n in gens}
    for g in gens.values():
        g.generate(ids, max_new_tokens=2, ignore_eos=True)  # warm up
    for i in range(args.runs):
        for name, g in gens.items():
            t = g.generate(ids, max_new_tokens=args.new_tokens, ignore_eos=True).timing
            prefill[name].append(t.prefill_s)
            step[name].append(t.decode_s / len(t.step_s))
        print(
            f"run {i + 1}/{args.runs}: "
            + ", ".join(f"{n} {v[-1]:.3f} s" for n, v in prefill.items())
        )
    rows = {}
    for name in gens:
        p, s = statistics.median(prefill[name]), statistics.median(step[name])
        rows[name] = {
            "prefill_s": round(p, 4),
            "decode_step_s": round(s, 5),
            "prefill_vs_float32": round(p / statistics.median(prefill["float32"]), 2),
        }
        print(
            f"{name:18s} prefill {p:.3f} s ({rows[name]['prefill_vs_float32']:.2f}x float32), "
            f"decode step {s * 1e3:.1f} ms"
        )
    record = {
        "machine": machine_info("cpu"),
        "flags": flags().describe(),
        "prompt_tokens": len(ids),
        "threads": args.threads,
        "runs": args.runs,
        "cases": rows,
        "widened_vs_plain": round(
            rows["bfloat16 plain"]["prefill_s"] / rows["bfloat16 widened"]["prefill_s"], 2
        ),
    }
    print(f"widened prefill: {record['widened_vs_plain']:.2f}x as fast as plain bfloat16's")
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
