"""``llmlib chat``: an interactive conversation with a chat model in the terminal.

The whole conversation is kept as a list of messages and re-rendered with the model's chat template
every turn, so the model always sees the history in the format it was trained on. Each turn is one
request to the batching engine with one sequence (:func:`llmlib.cli.common.cli_engine`); the history
it shares with the last turn is found in the engine's prefix cache, so only the new messages are
prefilled.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TextIO

from llmlib.cli.common import (
    add_decode_args,
    add_model_args,
    add_sampling_args,
    cli_engine,
    engine_note,
    sampling_params,
)
from llmlib.prompts import Message
from llmlib.sampling import SamplingParams

HELP = "commands: /reset (forget the conversation), /exit (or Ctrl-D)"


def chat_turn(
    llm: Any,
    history: list[Message],
    user_text: str,
    out: TextIO = sys.stdout,
    params: SamplingParams | None = None,
) -> str:
    """Add the user's message, stream the reply to ``out``, add the reply; return it.

    ``llm`` is an :class:`llmlib.LLM`; ``params`` says how to sample (default: greedy, 64 new
    tokens). If the history leaves too little room for a reply (``max_tokens``, at most half the
    context), the oldest exchanges are dropped; a system message, if any, stays.
    """
    params = params if params is not None else SamplingParams(max_tokens=64, temperature=0.0)
    history.append({"role": "user", "content": user_text})
    context = llm.max_model_len
    room = min(params.max_tokens, context // 2)
    first = 1 if history[0]["role"] == "system" else 0
    while len(llm.encode(history)[1]) + room > context:
        if len(history) - first <= 1:  # only the new message is left and it is still too long
            history.pop()
            raise ValueError(f"the message is too long for the model's context of {context} tokens")
        del history[first : first + 2]  # the oldest user/assistant exchange
    if room < params.max_tokens:
        params = replace(params, max_tokens=room)
    reply = []
    for step in llm.stream(history, params):
        piece = step.outputs[0].delta_text
        out.write(piece)
        out.flush()
        reply.append(piece)
    out.write("\n")
    text = "".join(reply)
    history.append({"role": "assistant", "content": text})
    return text


def repl(
    llm: Any,
    read: Callable[[str], str] = input,
    out: TextIO = sys.stdout,
    system: str | None = None,
    params: SamplingParams | None = None,
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
            chat_turn(llm, history, text, out=out, params=params)
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
        llm = cli_engine(args)
        print(f"({engine_note(llm)})", file=sys.stderr)
    except (ValueError, FileNotFoundError) as e:
        print(f"llmlib chat: error: {e}", file=sys.stderr)
        return 2
    if not getattr(llm.tokenizer, "chat_template", None):
        print("llmlib chat: error: this model's tokenizer has no chat template", file=sys.stderr)
        return 2
    repl(llm, system=args.system, params=params)
    return 0
