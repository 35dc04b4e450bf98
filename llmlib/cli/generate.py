"""``llmlib generate "prompt"``: one answer from one model, streamed to the terminal."""

from __future__ import annotations

import argparse
import sys

from llmlib.cli.common import (
    add_decode_args,
    add_model_args,
    add_sampling_args,
    cli_generator,
    decode_note,
    sampling_params,
)


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
    add_decode_args(ap, "compile the decode step (once per machine; kept on disk)")
    add_model_args(ap)
    ap.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="shard the model over N ranks (started here, or by torchrun: every rank runs this)",
    )
    add_sampling_args(ap)
    args = ap.parse_args(argv)
    if args.tensor_parallel_size > 1 and args.speculative:
        print("llmlib generate: --speculative runs on one rank only", file=sys.stderr)
        return 2
    if args.tensor_parallel_size > 1:
        return _sharded(args)
    try:
        params = sampling_params(args)
        gen = cli_generator(args)
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
        rate = t.decode_tokens_per_s  # nan after one token: prefill made it, no step was timed
        rate_s = "no step" if rate != rate else f"{rate:.1f} tokens/s"
        print(
            f"[{len(out.prompt_ids)} prompt tokens, {len(out.token_ids)} new, finish={out.finish_reason}; "
            f"prefill {t.prefill_s * 1e3:.0f} ms, decode {rate_s}; "
            f"weights {gen.weight_format}" + decode_note(gen) + _spec_note(out) + "]",
            file=sys.stderr,
        )
    return 0


def _spec_note(out) -> str:
    s = out.speculative
    if s is None:
        return ""
    return (
        f"; speculative: {s.accepted}/{s.proposed} proposed tokens accepted, "
        f"{s.mean_accepted:.2f} per verification over {s.verifications}"
    )


def _sharded(args: argparse.Namespace) -> int:
    """The same answer from the batching engine split over ``--tensor-parallel-size`` ranks.

    Under ``torchrun`` every rank runs this command: rank 0 drives and prints, the others serve
    the forward pass (:func:`llmlib.parallel.worker.main`).
    """
    from llmlib.parallel.group import DistEnv, TensorParallelError

    env = DistEnv.from_env()
    if env is not None and env.rank != 0:
        from llmlib.parallel.worker import main as worker_main

        return worker_main()
    from llmlib.checkpoints import resolve_model_path
    from llmlib.engine import LLM

    try:
        params = sampling_params(args)
        path = resolve_model_path(args.model)
        n = args.tensor_parallel_size
        with LLM(path, device=args.device, dtype=args.dtype, tensor_parallel_size=n) as llm:
            has_template = bool(getattr(llm.tokenizer, "chat_template", None))
            chat = args.chat if args.chat is not None else has_template
            prompt = [{"role": "user", "content": args.prompt}] if chat else args.prompt
            llm.add_request(prompt, params)
            out = None
            while llm.has_unfinished_requests():
                for out in llm.step():
                    if not args.no_stream:
                        print(out.delta_text, end="", flush=True)
            assert out is not None
            print(out.text if args.no_stream else "")
    except (ValueError, TypeError, FileNotFoundError, TensorParallelError) as e:
        print(f"llmlib generate: error: {e}", file=sys.stderr)
        return 2
    if not args.quiet:
        m = out.metrics
        decode_s = (m.finished_time or 0.0) - (m.first_token_time or 0.0)
        rate = (len(out.token_ids) - 1) / decode_s if decode_s > 0 else float("nan")
        print(
            f"[{len(out.prompt_token_ids)} prompt tokens, {len(out.token_ids)} new, "
            f"finish={out.finish_reason}; tensor-parallel over {n} ranks; "
            f"time to first token {(m.time_to_first_token or 0) * 1e3:.0f} ms, "
            f"decode {rate:.1f} tokens/s]",
            file=sys.stderr,
        )
    return 0
