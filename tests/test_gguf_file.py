"""llmlib's own GGUF container reader agrees with the `gguf` package's GGUFReader, and fails clearly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from llmlib.gguf_file import GGUFFormatError, read_gguf_file


@pytest.mark.model
def test_smollm2_header_matches_ggufreader(smollm2_path: Path) -> None:
    import gguf

    ours = read_gguf_file(smollm2_path)
    ref = gguf.GGUFReader(smollm2_path)
    fields = {f.name: f.contents() for f in ref.fields.values() if not f.name.startswith("GGUF.")}
    assert set(fields) == set(ours.metadata)
    for key, value in fields.items():
        if isinstance(value, float):
            assert ours.metadata[key] == pytest.approx(value), key
        else:
            assert ours.metadata[key] == value, key
    assert len(ref.tensors) == len(ours.tensors)
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert (
            mine.offset == t.data_offset
            and mine.nbytes == t.n_bytes
            and mine.ggml_type == int(t.tensor_type)
        )
        assert mine.shape == tuple(int(d) for d in reversed(t.shape))
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "output_norm.weight"):
        ref_t = next(t for t in ref.tensors if t.name == name)
        assert np.array_equal(ours.raw(name), np.asarray(ref_t.data).view(np.uint8).reshape(-1))


def _write_small(path: Path) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("test.answer", 42)
    w.add_array("test.list", [1, 2, 3])
    w.add_array("test.words", ["a", "bé", "c"])
    w.add_tensor("x", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_small_file_round_trip(tmp_path: Path) -> None:
    p = tmp_path / "small.gguf"
    _write_small(p)
    g = read_gguf_file(p)
    assert g.architecture == "llama"
    assert (
        g.metadata["test.answer"] == 42
        and g.metadata["test.list"] == [1, 2, 3]
        and g.metadata["test.words"] == ["a", "bé", "c"]
    )
    assert g.tensors["x"].shape == (2, 32)
    assert np.array_equal(g.raw("x").view(np.float32), np.arange(64, dtype=np.float32))


def test_truncated_file_names_the_tensor(tmp_path: Path) -> None:
    p = tmp_path / "small.gguf"
    _write_small(p)
    data = p.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:-100])
    g = read_gguf_file(tmp_path / "cut.gguf")
    with pytest.raises(GGUFFormatError, match="'x'.*truncated"):
        g.raw("x")
    (tmp_path / "head.gguf").write_bytes(data[:40])
    with pytest.raises(GGUFFormatError, match="truncated"):
        read_gguf_file(tmp_path / "head.gguf")


def test_not_gguf(tmp_path: Path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"PK\x03\x04 this is a zip")
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        read_gguf_file(tmp_path / "a.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFFormatError):
        read_gguf_file(tmp_path / "empty.gguf")


def test_an_unchanged_file_is_parsed_once(tmp_path: Path, monkeypatch) -> None:
    """Loading a model opens its file for the config, the tensors and the tokenizer: the header
    is parsed the first time only, unless the file changed since."""
    from llmlib import gguf_file

    parses = []
    parse = gguf_file.GGUFFile._parse
    monkeypatch.setattr(gguf_file.GGUFFile, "_parse", lambda self: parses.append(1) or parse(self))
    p = tmp_path / "small.gguf"
    _write_small(p)
    first, second = read_gguf_file(p), read_gguf_file(p)
    assert len(parses) == 1 and second.metadata == first.metadata
    assert np.array_equal(second.raw("x").view(np.float32), np.arange(64, dtype=np.float32))
    data = p.read_bytes()
    p.write_bytes(data[:-100])  # changed: parsed again, and its truncation is seen
    with pytest.raises(GGUFFormatError, match="'x'.*truncated"):
        read_gguf_file(p).raw("x")
    assert len(parses) == 2
