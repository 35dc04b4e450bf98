"""``llmlib perplexity --model M FILE``: perplexity of a text, in sliding windows, in any format.

With ``--compare``, the same windows also run in float32 and the KL divergence of the chosen
format's next-token distribution from float32's, and the share of greedy tokens that agree, are
printed beside the two perplexities.
"""

from __future__ import annotations

import argparse
import json
import sys

from llmlib.cli.common import add_format_args, model_format


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="llmlib perplexity", description="Perplexity of a text file (sliding windows)."
    )
    ap.add_argument("file", help="a UTF-8 text file")
    ap.add_argument("--model", default=None, help="a .gguf file or HF folder (default: SmolLM2)")
    ap.add_argument("--device", default=None)
    add_format_args(ap, auto=False)
    ap.add_argument("--context", type=int, default=512, help="tokens per window")
    ap.add_argument("--stride", type=int, default=256, help="tokens each window advances")
    ap.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens")
    ap.add_argument("--compare", action="store_true", help="also float32: KL and greedy agreement")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    import llmlib
    from llmlib.checkpoints import load_tokenizer_for, resolve_model_path
    from llmlib.perplexity import compare, perplexity_details

    try:
        path = resolve_model_path(args.model)
        device, dtype, q = model_format(args)
        model = llmlib.load_model(path, device, dtype, q, group_size=args.group_size)
        tok = load_tokenizer_for(path)
        with open(args.file, encoding="utf-8") as f:
            ids = tok.encode(f.read())[: args.max_tokens]
        res = perplexity_details(model, ids, args.context, args.stride)
    except (ValueError, FileNotFoundError) as e:
        print(f"llmlib perplexity: error: {e}", file=sys.stderr)
        return 2
    out = {
        "model": str(path.name),
        "format": model.weight_format,
        "perplexity": res.perplexity,
        "tokens": res.tokens,
        "windows": res.windows,
        "context": args.context,
        "stride": args.stride,
    }
    if args.compare:
        ref = llmlib.load_model(path, device, "float32")
        c = compare(ref, model, ids, args.context, args.stride)
        ref_ppl = perplexity_details(ref, ids, args.context, args.stride).perplexity
        out |= {
            "float32_perplexity": ref_ppl,
            "ratio": res.perplexity / ref_ppl,
            "kl": c.kl,
            "kl_max": c.kl_max,
            "greedy_agreement": c.greedy_agreement,
        }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"{out['model']} [{out['format']}]: perplexity {res.perplexity:.4f} over {res.tokens} "
        f"tokens ({res.windows} windows of {args.context}, stride {args.stride})"
    )
    if args.compare:
        print(
            f"  float32 {out['float32_perplexity']:.4f} (ratio {out['ratio']:.4f}); KL from "
            f"float32 {out['kl']:.5f} nats (max {out['kl_max']:.3f}); greedy agreement "
            f"{out['greedy_agreement']:.1%}"
        )
    return 0
