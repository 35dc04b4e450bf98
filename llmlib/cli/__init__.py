"""The ``llmlib`` command: a thin dispatcher; each subcommand is a ``main(argv)`` in its own module."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module with a ``main(argv) -> int``, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": (
        "llmlib.cli.generate",
        "generate text from a prompt with one model (streams by default)",
    ),
    "chat": ("llmlib.cli.chat", "an interactive chat that keeps the conversation"),
    "serve": ("llmlib.serve.launch", "an OpenAI-compatible HTTP server on the batching engine"),
    "bench": ("llmlib.bench", "benchmarks: bpe, generate, roofline, batching, serve"),
    "costs": (
        "llmlib.cli.costs",
        "parameters, bytes, KV cache and the decode floor of a model on a GPU",
    ),
    "perplexity": ("llmlib.cli.perplexity", "perplexity of a text file in any weight format"),
    "fetch": ("llmlib.checkpoints.fetch", "fetch SmolLM2-135M-Instruct (GGUF) into the cache"),
}


def _usage() -> str:
    lines = ["usage: llmlib COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<9} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`llmlib COMMAND --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"llmlib: unknown command {cmd!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[cmd][0])
    return int(module.main(rest) or 0)
