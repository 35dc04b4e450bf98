"""llama.cpp as the peer of ``llmlib bench generate --formats`` (each format against llama.cpp
at the same number of bits per weight, on the same weights) and of ``bench depth`` (long prompts,
and the KV cache in llama.cpp's matching type: :data:`KV_CACHE_TYPES`).

The book's model comes as one Q4_1 file, and llmlib's float32, bfloat16 and int8 formats are that
file's weights widened or re-rounded. llama.cpp's own quantizer (``llama_model_quantize``, in
``llama-cpp-python``) does the same to the file: F32, BF16 and Q8_0 copies of it, every tensor in
the one type (``pure``), cached beside the model. Comparing llmlib int8 with llama.cpp Q4_1, or
bfloat16 with it, would compare different byte counts.

Prompts are evaluated with ``n_batch`` tokens per call (:func:`n_batch`): llama.cpp's default of
512 where its build has no AMX kernels, and 1, one token at a time, where it has them, since such
builds crashed on prompts processed with ``n_batch > 1``. With 1, llama.cpp's prefill is a floor
on its speed, not its best; its decode is the same either way.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from time import perf_counter
from typing import Any

#: llmlib format -> the llama.cpp type it is measured against (None: the file as it is)
PEER_TYPES: dict[str, str | None] = {
    "float32": "F32",
    "bfloat16": "BF16",
    "int8": "Q8_0",
    "int4": None,  # the file's own Q4_1: 4 bits in groups of 32, with a scale and a minimum
    "gguf": None,
}


#: tokens per llama.cpp evaluation call while reading the prompt: with AMX kernels, and without
N_BATCH_AMX, N_BATCH = 1, 512


def build() -> str:
    """What this build of llama.cpp was compiled with (``AVX2 F16C FMA ... OPENMP``: its
    instruction sets and features), from its own system line: a record must say which llama.cpp
    it ran against."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode()
    return " ".join(dict.fromkeys(re.findall(r"(\w+) = 1", info)))


def n_batch() -> int:
    """Tokens per evaluation call for this build of llama.cpp (see the module's docstring)."""
    return N_BATCH_AMX if "AMX_INT8" in build().split() else N_BATCH


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def label(kind: str | None) -> str:
    """The row name of llama.cpp on ``kind`` (``llama.cpp``: the file itself)."""
    return "llama.cpp" if kind is None else f"llama.cpp {kind}"


#: llama.cpp's mixes: the type most tensors get, with some kept in more bits (Q4_K_M keeps the
#: value projection and the FFN's down projection of half the layers, and the head, in Q6_K)
MIXES = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q5_K_S", "Q3_K_M", "Q2_K")


def copy_of(path: Path, kind: str | None, threads: int = 2) -> Path:
    """``path`` requantized by llama.cpp to ``kind`` (F32, BF16, Q8_0 and the other single
    types, every tensor in it; or a mix such as Q4_K_M, as llama.cpp makes the files people
    download), made once and cached next to it; ``path`` itself for None."""
    if kind is None:
        return path
    import llama_cpp as L

    out = path.with_name(f"{path.stem}.llama-cpp-{kind}.gguf")
    if out.exists():
        return out
    name = {"F32": "ALL_F32"}.get(kind, f"MOSTLY_{kind}")
    ftype = getattr(L, f"LLAMA_FTYPE_{name}", None)
    if ftype is None:
        raise KeyError(f"llama.cpp has no file type {kind!r}")
    params = L.llama_model_quantize_default_params()
    params.ftype, params.nthread = ftype, threads
    params.allow_requantize, params.pure = True, kind not in MIXES
    tmp = out.with_suffix(".part")
    rc = L.llama_model_quantize(str(path).encode(), str(tmp).encode(), params)
    if rc != 0 or not tmp.exists():
        raise RuntimeError(f"llama.cpp could not requantize {path.name} to {kind} (code {rc})")
    tmp.rename(out)
    return out


#: llmlib's KV cache type -> llama.cpp's type of its keys and values (a ggml type number; None:
#: its default, F16), that type's name and its bytes a value (q8_0: 32 values and a float16 scale)
KV_CACHE_TYPES: dict[str, tuple[int | None, str, float]] = {
    "auto": (None, "f16", 2.0),
    "int8": (8, "q8_0", 34 / 32),  # GGML_TYPE_Q8_0
}


def llama(path: Path, kv: str, threads: int, n_ctx: int, logits_all: bool = False) -> Any:
    """llama.cpp on ``path`` with ``kv``'s cache type (:data:`KV_CACHE_TYPES`) for keys and
    values, and flash attention on for every type (a quantized value cache needs it)."""
    from llama_cpp import Llama

    ggml_type = KV_CACHE_TYPES[kv][0]
    return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_batch(), n_threads=threads,
                 n_threads_batch=threads, flash_attn=True, type_k=ggml_type, type_v=ggml_type,
                 logits_all=logits_all, verbose=False)  # fmt: skip


def greedy(llm: Any, ids: list[int], new_tokens: int) -> tuple[list[int], float, float]:
    """``new_tokens`` greedy tokens after ``ids``: the tokens, the seconds a decode step took
    (the mean after the first token) and the prompt's seconds."""
    import numpy as np

    n_vocab = llm.n_vocab()

    def last_argmax() -> int:  # the newest token's logits, straight from the context
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))))

    llm.reset()
    t0 = perf_counter()
    llm.eval(ids)
    tok = last_argmax()
    prefill = perf_counter() - t0
    toks = [tok]
    t0 = perf_counter()
    for _ in range(new_tokens - 1):
        llm.eval([tok])
        tok = last_argmax()
        toks.append(tok)
    return toks, (perf_counter() - t0) / max(new_tokens - 1, 1), prefill


def decoder(
    path: Path, threads: int, prompt_ids: list[int], new_tokens: int
) -> Callable[[], tuple[list[int], float, float]]:
    """A function that decodes ``new_tokens`` greedily after ``prompt_ids`` with llama.cpp on
    ``path`` and returns the tokens, the seconds the decode steps took and the prompt's."""
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(path),
        n_ctx=len(prompt_ids) + new_tokens + 8,
        n_batch=n_batch(),
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )

    def run() -> tuple[list[int], float, float]:
        toks, step, prefill = greedy(llm, prompt_ids, new_tokens)
        return toks, step * max(new_tokens - 1, 1), prefill

    return run


def window_nll(logits: Any, ids: Sequence[int], begin: int, end: int, first: int) -> float:
    """The summed negative log-likelihood of ``ids[first:end]`` from one window's logits
    (``logits[i]``: the scores after ``ids[begin + i]``, a row per token of ``ids[begin:end]``),
    log-softmaxed in float64."""
    import numpy as np

    x = np.asarray(logits, dtype=np.float64)[first - begin - 1 : end - begin - 1]
    m = x.max(axis=1, keepdims=True)
    logz = (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))[:, 0]
    targets = np.asarray(ids[first:end], dtype=np.int64)
    return float((logz - x[np.arange(len(targets)), targets]).sum())


def perplexity(llm: Any, ids: list[int], context: int, stride: int) -> Any:
    """Perplexity from llama.cpp's logits of every position (a ``logits_all`` instance) over
    :func:`llmlib.perplexity.windows`, as llmlib scores the same windows."""
    from llmlib.perplexity import over_windows

    def nll(begin: int, end: int, first: int) -> float:
        llm.reset()
        llm.eval(ids[begin:end])
        return window_nll(llm.scores[: end - begin], ids, begin, end, first)

    return over_windows(nll, len(ids), context, stride)
