"""``llmlib chat``: an interactive conversation with a chat model in the terminal.

The whole conversation is kept as a list of messages and re-rendered with the model's chat template
every turn, so the model always sees the history in the format it was trained on. Each turn is a
fresh prefill of the full history (the generator's static cache is reused, not its contents): simple,
and cheap for the short conversations a 135M model can hold.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, TextIO

from llmlib.cli.common import (
    add_decode_args,
    add_model_args,
    add_sampling_args,
    cli_generator,
    decode_note,
    sampling_params,
)
from llmlib.generate import Generator
from llmlib.prompts import Message
from llmlib.sampling import SamplingParams

HELP = "commands: /reset (forget the conversation), /exit (or Ctrl-D)"


def chat_turn(
    gen: Generator,
    history: list[Message],
    user_text: str,
    out: TextIO = sys.stdout,
    params: SamplingParams | None = None,
    **kw: Any,
) -> str:
    """Add the user's message, stream the reply to ``out``, add the reply; return it.

    ``params`` (or the Generator's keyword convenience) says how to sample. If the history leaves
    too little room for a reply (``max_tokens``, at most half the context), the oldest exchanges
    are dropped; a system message, if any, stays.
    """
    history.append({"role": "user", "content": user_text})
    wanted = params.max_tokens if params is not None else int(kw.get("max_new_tokens", 64))
    room = min(wanted, gen.max_len // 2)
    first = 1 if history[0]["role"] == "system" else 0
    while len(gen.encode_prompt(history)[1]) + room > gen.max_len:
        if len(history) - first <= 1:  # only the new message is left and it is still too long
            history.pop()
            raise ValueError(
                f"the message is too long for the model's context of {gen.max_len} tokens"
            )
        del history[first : first + 2]  # the oldest user/assistant exchange
    pieces = gen.stream(history, params, **kw)
    reply = []
    for piece in pieces:
        out.write(piece)
        out.flush()
        reply.append(piece)
    out.write("\n")
    text = "".join(reply)
    history.append({"role": "assistant", "content": text})
    return text


def repl(
    gen: Generator,
    read: Callable[[str], str] = input,
    out: TextIO = sys.stdout,
    system: str | None = None,
    params: SamplingParams | None = None,
    **kw: Any,
) -> list[Message]:
    """The read-eval-print loop. Ends on /exit, EOF (Ctrl-D) or Ctrl-C at the prompt; Ctrl-C while
    the model is answering stops that answer only. Returns the conversation."""
    history: list[Message] = [{"role": "system", "content": system}] if system else []
    out.write(HELP + "\n")
    while True:
        try:
            line = read(">>> ")
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            return history
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return history
        if text == "/reset":
            history = history[:1] if system else []
            out.write("(conversation cleared)\n")
            continue
        try:
            chat_turn(gen, history, text, out=out, params=params, **kw)
        except KeyboardInterrupt:
            out.write("\n(interrupted)\n")
            if history and history[-1]["role"] == "user":
                history.pop()
        except ValueError as e:
            out.write(f"error: {e}\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="llmlib chat", description="Chat with a model (keeps the conversation)."
    )
    ap.add_argument(
        "--system", default=None, help="a system message to start the conversation with"
    )
    add_decode_args(ap, "compile the decode step (once per machine; kept on disk)")
    add_model_args(ap)
    add_sampling_args(ap)
    args = ap.parse_args(argv)
    try:
        params = sampling_params(args)
        gen = cli_generator(args)
        print(f"(weights: {gen.weight_format}{decode_note(gen)})", file=sys.stderr)
    except (ValueError, FileNotFoundError) as e:
        print(f"llmlib chat: error: {e}", file=sys.stderr)
        return 2
    if not getattr(gen.tokenizer, "chat_template", None):
        print("llmlib chat: error: this model's tokenizer has no chat template", file=sys.stderr)
        return 2
    repl(gen, system=args.system, params=params)
    return 0
