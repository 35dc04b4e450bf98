"""``llmlib generate "prompt"``: one answer from one model, streamed to the terminal."""

from __future__ import annotations

import argparse
import sys

from llmlib.cli.common import add_model_args, add_sampling_args, generator_args, sampling_params
from llmlib.generate import load_generator


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="llmlib generate", description="Generate text from a prompt (streams by default)."
    )
    ap.add_argument("prompt", help="the prompt text")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument(
        "--chat",
        dest="chat",
        action="store_true",
        default=None,
        help="wrap the prompt in the model's chat template (the default when the model has one)",
    )
    mode.add_argument(
        "--no-chat", dest="chat", action="store_false", help="feed the prompt as raw text"
    )
    ap.add_argument("--no-stream", action="store_true", help="print the text only when done")
    ap.add_argument("--quiet", action="store_true", help="no timing line on stderr")
    ap.add_argument(
        "--compile", action="store_true", help="torch.compile the decode step (compiles once)"
    )
    add_model_args(ap)
    add_sampling_args(ap)
    args = ap.parse_args(argv)
    try:
        params = sampling_params(args)
        gen = load_generator(
            *generator_args(args), group_size=args.group_size, compile=args.compile
        )
        if args.compile:
            gen.warmup()  # compile now, so the timing line reports decode, not compilation
        # An instruction-tuned model answers a bare question badly (SmolLM2's first greedy token
        # after one is its end-of-turn token), so chat is the default whenever a template exists.
        chat = (
            args.chat
            if args.chat is not None
            else bool(getattr(gen.tokenizer, "chat_template", None))
        )
        if args.no_stream:
            out = gen.generate(args.prompt, params, chat=chat)
            print(out.text)
        else:
            for piece in gen.stream(args.prompt, params, chat=chat):
                print(piece, end="", flush=True)
            print()
            out = gen.last_result
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"llmlib generate: error: {e}", file=sys.stderr)
        return 2
    if not args.quiet and out is not None:
        t = out.timing
        print(
            f"[{len(out.prompt_ids)} prompt tokens, {len(out.token_ids)} new, finish={out.finish_reason}; "
            f"prefill {t.prefill_s * 1e3:.0f} ms, decode {t.decode_tokens_per_s:.1f} tokens/s; "
            f"weights {gen.weight_format}"
            + (f", compiled in {gen.compile_s:.1f} s" if gen.compile_s else "")
            + "]",
            file=sys.stderr,
        )
    return 0
