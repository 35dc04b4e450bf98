"""What to speculate with: one dataclass, and the command line's short spelling of it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "early_exit", "draft")

#: The ``--speculative`` spelling, for every command's ``--help``.
SPEC_HELP = (
    "speculative decoding: ngram:K (prompt lookup, K tokens, n-grams of 1..4), "
    "ngram:K:NMIN:NMAX, early_exit:L:K (the model's own first L layers draft K tokens), "
    "draft:K:PATH (a smaller model with the same vocabulary drafts K tokens)"
)


@dataclass
class SpeculativeConfig:
    """Speculative decoding: a cheap proposer guesses ``num_speculative_tokens`` tokens and the
    model checks them all in one forward pass, keeping the longest prefix it agrees with.

    method: ``"ngram"`` (prompt lookup: copy what followed the latest earlier occurrence of the
        sequence's last n tokens, n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, as
        vLLM's ``prompt_lookup_min``/``max``), ``"early_exit"`` (the model's own first
        ``exit_layer`` layers, final norm and LM head as the draft, LayerSkip's self-speculation)
        or ``"draft"`` (``draft_model``: a model from :func:`llmlib.load_model`, or its path, with
        the same vocabulary).
    num_speculative_tokens: the most tokens proposed per verification (k).

    The output is the model's own either way: greedy decoding keeps exactly the tokens plain
    greedy decoding would, and sampling keeps the model's distribution exactly (rejection
    sampling, :mod:`llmlib.speculative.verify`); only the speed depends on the proposer.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    exit_layer: int | None = None
    draft_model: Any = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"SpeculativeConfig.method must be one of {METHODS}, got {self.method!r}"
            )
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 64:
            raise ValueError(
                f"SpeculativeConfig.num_speculative_tokens must be in 1..64, got {k!r}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "SpeculativeConfig needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min}, {self.prompt_lookup_max}"
            )
        if self.method == "early_exit" and (
            isinstance(self.exit_layer, bool)
            or not isinstance(self.exit_layer, int)
            or self.exit_layer < 1
        ):
            raise ValueError(
                f"early_exit needs exit_layer, a positive int (layers kept), got {self.exit_layer!r}"
            )
        if self.method == "draft" and self.draft_model is None:
            raise ValueError("the draft method needs draft_model (a model or a path)")

    @classmethod
    def parse(cls, spec: str) -> SpeculativeConfig:
        """``ngram:4``, ``ngram:4:2:5``, ``early_exit:8:4``, ``draft:4:/path/model.gguf``."""
        method, _, rest = spec.partition(":")
        try:
            if method == "ngram":
                parts = [int(x) for x in rest.split(":")] if rest else [4]
                if len(parts) not in (1, 3):
                    raise ValueError
                lo, hi = parts[1:] if len(parts) == 3 else (1, 4)
                return cls("ngram", parts[0], prompt_lookup_min=lo, prompt_lookup_max=hi)
            if method == "early_exit":
                layer, k = (int(x) for x in rest.split(":"))
                return cls("early_exit", k, exit_layer=layer)
            if method == "draft":
                k, path = rest.split(":", 1)
                return cls("draft", int(k), draft_model=path)
        except ValueError:
            pass
        raise ValueError(f"cannot read --speculative {spec!r}; {SPEC_HELP}")
