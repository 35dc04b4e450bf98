"""``llmlib generate "prompt"``: one answer from one model, streamed to the terminal.

It runs the batching engine with one sequence (:func:`llmlib.cli.common.cli_engine`), the same
fixed-shape step that serves a batch, in the format that decodes one request fastest here."""

from __future__ import annotations

import argparse
import sys

from llmlib.cli.common import (
    add_decode_args,
    add_model_args,
    add_sampling_args,
    cli_engine,
    engine_note,
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
        from llmlib.parallel.group import DistEnv

        env = DistEnv.from_env()
        if env is not None and env.rank != 0:  # under torchrun: rank 0 drives, the others serve
            from llmlib.parallel.worker import main as worker_main

            return worker_main()
    from llmlib.parallel.group import TensorParallelError

    llm = None
    try:
        params = sampling_params(args)
        llm = cli_engine(args)
        # An instruction-tuned model answers a bare question badly (SmolLM2's first greedy token
        # after one is its end-of-turn token), so chat is the default whenever a template exists.
        chat = (
            args.chat
            if args.chat is not None
            else bool(getattr(llm.tokenizer, "chat_template", None))
        )
        prompt = [{"role": "user", "content": args.prompt}] if chat else args.prompt
        out = None
        for out in llm.stream(prompt, params):
            if not args.no_stream:
                print(out.outputs[0].delta_text, end="", flush=True)
        assert out is not None
        print(out.outputs[0].text if args.no_stream else "")
    except (ValueError, TypeError, FileNotFoundError, TensorParallelError) as e:
        print(f"llmlib generate: error: {e}", file=sys.stderr)
        return 2
    finally:
        if llm is not None:
            llm.shutdown()  # a sharded engine's ranks stop
    if not args.quiet:
        print(_timing_line(out, llm), file=sys.stderr)
    return 0


def _timing_line(out, llm) -> str:
    """The line on standard error after an answer: tokens, why it ended, prefill (the time to
    the first token) and decode speed, and what ran."""
    m, choice = out.metrics, out.outputs[0]
    n = len(choice.token_ids)
    decode_s = (m.finished_time or 0.0) - (m.first_token_time or 0.0)
    # nan after one token: prefill made it, no step was timed
    rate = (n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan")
    rate_s = "no step" if rate != rate else f"{rate:.1f} tokens/s"
    stats = llm.stats()
    spec = ""
    if stats.spec_proposed:
        spec = (
            f"; speculative: {stats.spec_accepted}/{stats.spec_proposed} proposed tokens accepted"
        )
    if llm.tensor_parallel_size > 1:
        spec += f"; tensor-parallel over {llm.tensor_parallel_size} ranks"
    return (
        f"[{len(out.prompt_token_ids)} prompt tokens, {n} new, finish={choice.finish_reason}; "
        f"prefill {(m.time_to_first_token or 0.0) * 1e3:.0f} ms, decode {rate_s}; "
        f"{engine_note(llm)}{spec}]"
    )
