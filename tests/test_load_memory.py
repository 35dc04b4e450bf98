"""Loading packs each matrix once, straight from the file into its final layout: no float copy of
a quantized model, and no second copy of a big matrix's codes on the way. Each load runs in a
fresh process (:func:`llmlib.bench.memory.load_memory`), which reports the resident growth after
the load, its peak during the load, and the bytes the format stores."""

from __future__ import annotations

import pytest

from llmlib.bench.gguf_synth import write_random_gguf
from llmlib.bench.memory import load_memory

#: peak while loading, against what the loaded model holds (the issue's bound)
PEAK = 1.3
#: what the process holds after loading, against the bytes the format stores: within 5%, plus
#: what any load keeps besides the weights (the file's metadata and vocabulary as Python objects,
#: the allocator's free lists), a few MB whatever the model's size
RESIDENT, FIXED = 1.05, 24 << 20


@pytest.mark.model
@pytest.mark.parametrize("quantization", ["gguf", "int8"])
def test_smollm2_loads_within_its_bound(quantization) -> None:
    """The book's model from its GGUF file: its own blocks (gguf), or rounded to int8 here."""
    from llmlib.checkpoints.fetch import fetch_model

    r = load_memory(fetch_model(quiet=True), "float32", quantization, threads=2)
    assert r["rss"] <= RESIDENT * r["stored"] + FIXED, r
    assert r["peak"] <= PEAK * r["rss"], r


def test_an_8b_models_shapes_stream_in(tmp_path) -> None:
    """Two layers of Llama-3.1-8B's shapes, with its 128,256-row table and LM head, in random
    Q4_K/Q6_K blocks (about 1 GB): the table and the head, each half a billion weights, are
    packed a slice of rows at a time, so the load never holds one of them twice."""
    path = write_random_gguf(tmp_path / "8b-2-layers.gguf", "llama-3.1-8b", n_layers=2)
    try:
        r = load_memory(path, "float32", "gguf", threads=2)
    finally:
        path.unlink()
    assert r["rss"] <= RESIDENT * r["stored"] + FIXED, r
    assert r["peak"] <= PEAK * r["rss"], r
