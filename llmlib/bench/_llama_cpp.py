"""llama.cpp as the peer of ``llmlib bench generate --formats``: each format against llama.cpp at
the same number of bits per weight, on the same weights.

The book's model comes as one Q4_1 file, and llmlib's float32, bfloat16 and int8 formats are that
file's weights widened or re-rounded. llama.cpp's own quantizer (``llama_model_quantize``, in
``llama-cpp-python``) does the same to the file: F32, BF16 and Q8_0 copies of it, every tensor in
the one type (``pure``), cached beside the model. Comparing llmlib int8 with llama.cpp Q4_1, or
bfloat16 with it, would compare different byte counts.

Decoding runs with ``n_batch=1``: this machine's build crashed on prompts processed with
``n_batch > 1``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from time import perf_counter

#: llmlib format -> the llama.cpp type it is measured against (None: the file as it is)
PEER_TYPES: dict[str, str | None] = {
    "float32": "F32",
    "bfloat16": "BF16",
    "int8": "Q8_0",
    "int4": None,  # the file's own Q4_1: 4 bits in groups of 32, with a scale and a minimum
    "gguf": None,
}


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def label(kind: str | None) -> str:
    """The row name of llama.cpp on ``kind`` (``llama.cpp``: the file itself)."""
    return "llama.cpp" if kind is None else f"llama.cpp {kind}"


def copy_of(path: Path, kind: str | None, threads: int = 2) -> Path:
    """``path`` requantized by llama.cpp to ``kind`` (F32, BF16, Q8_0), made once and cached
    next to it; ``path`` itself for None."""
    if kind is None:
        return path
    import llama_cpp as L

    out = path.with_name(f"{path.stem}.llama-cpp-{kind}.gguf")
    if out.exists():
        return out
    ftype = {
        "F32": L.LLAMA_FTYPE_ALL_F32,
        "BF16": L.LLAMA_FTYPE_MOSTLY_BF16,
        "Q8_0": L.LLAMA_FTYPE_MOSTLY_Q8_0,
    }[kind]
    params = L.llama_model_quantize_default_params()
    params.ftype, params.nthread = ftype, threads
    params.allow_requantize, params.pure = True, True
    tmp = out.with_suffix(".part")
    rc = L.llama_model_quantize(str(path).encode(), str(tmp).encode(), params)
    if rc != 0 or not tmp.exists():
        raise RuntimeError(f"llama.cpp could not requantize {path.name} to {kind} (code {rc})")
    tmp.rename(out)
    return out


def decoder(
    path: Path, threads: int, prompt_ids: list[int], new_tokens: int
) -> Callable[[], tuple[list[int], float]]:
    """A function that decodes ``new_tokens`` greedily after ``prompt_ids`` with llama.cpp on
    ``path`` and returns the tokens and the seconds the decode steps took."""
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(path),
        n_ctx=len(prompt_ids) + new_tokens + 8,
        n_batch=1,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    n_vocab = llm.n_vocab()

    def last_argmax() -> int:  # the newest token's logits, straight from the context
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))))

    def run() -> tuple[list[int], float]:
        llm.reset()
        llm.eval(prompt_ids)
        toks: list[int] = []
        tok = last_argmax()
        t0 = perf_counter()
        for _ in range(new_tokens - 1):
            toks.append(tok)
            llm.eval([tok])
            tok = last_argmax()
        toks.append(tok)
        return toks, perf_counter() - t0

    return run
