"""llama.cpp as the decode bench's peer, at each format's bits per weight (here a stand-in
``llama_cpp`` module: llama-cpp-python is an optional extra that CI does not install)."""

from __future__ import annotations

import ctypes
import sys
import types
from pathlib import Path

import pytest

from llmlib.bench import _llama_cpp
from llmlib.bench import formats as F

#: seconds the stand-in takes per decode step, by the file it was opened on
STEP_S = {"F32": 0.04, "BF16": 0.02, "Q8_0": 0.01, None: 0.005}


def _kind_of(path: str) -> str | None:
    return next((k for k in ("F32", "BF16", "Q8_0") if path.endswith(f"-{k}.gguf")), None)


@pytest.fixture
def fake_llama_cpp(monkeypatch):
    calls: list[dict] = []
    mod = types.ModuleType("llama_cpp")
    mod.LLAMA_FTYPE_ALL_F32, mod.LLAMA_FTYPE_MOSTLY_BF16, mod.LLAMA_FTYPE_MOSTLY_Q8_0 = 0, 32, 7

    def default_params():
        return types.SimpleNamespace(ftype=None, nthread=0, allow_requantize=False, pure=False)

    def quantize(src: bytes, dst: bytes, params) -> int:
        calls.append(dict(src=src.decode(), dst=dst.decode(), **vars(params)))
        Path(dst.decode()).write_bytes(b"GGUF")
        return 0

    class Llama:
        def __init__(self, model_path: str, n_batch: int, **kw) -> None:
            assert n_batch == (1 if "AMX_INT8 = 1" in SYSTEM[0] else 512)
            self.step = STEP_S[_kind_of(model_path)]
            self.logits = (ctypes.c_float * 7)(*[0, 0, 1, 0, 0, 0, 0])
            self._ctx = types.SimpleNamespace(get_logits=lambda: self.logits)

        def n_vocab(self) -> int:
            return 7

        def reset(self) -> None:
            pass

        def eval(self, ids: list[int]) -> None:
            _CLOCK[0] += self.step if len(ids) == 1 else PREFILL_S_PER_TOKEN * len(ids)

    mod.llama_model_quantize_default_params = default_params
    mod.llama_model_quantize = quantize
    mod.Llama = Llama
    mod.llama_print_system_info = lambda: SYSTEM[0].encode()
    SYSTEM[0] = AMX
    monkeypatch.setitem(sys.modules, "llama_cpp", mod)
    monkeypatch.setattr(_llama_cpp, "perf_counter", lambda: _CLOCK[0])
    return calls


_CLOCK = [0.0]
#: the stand-in build's system line (llama.cpp prints one per instruction set it was built for)
AMX = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | OPENMP = 1 | "
AVX2 = "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | AVX512 = 0 | OPENMP = 1 | "
SYSTEM = [AMX]
PREFILL_S_PER_TOKEN = 0.003


def test_copies_are_made_once_pure_and_from_the_same_file(tmp_path, fake_llama_cpp) -> None:
    src = tmp_path / "model.Q4_1.gguf"
    src.write_bytes(b"GGUF")
    assert _llama_cpp.copy_of(src, None) == src
    out = _llama_cpp.copy_of(src, "Q8_0", threads=2)
    assert out.name == "model.Q4_1.llama-cpp-Q8_0.gguf" and out.exists()
    (call,) = fake_llama_cpp
    assert call["src"] == str(src) and call["ftype"] == 7 and call["nthread"] == 2
    assert call["allow_requantize"] and call["pure"]  # every tensor in the one type
    _llama_cpp.copy_of(src, "Q8_0")
    assert len(fake_llama_cpp) == 1  # cached


def test_each_format_is_compared_with_llama_cpp_at_its_own_bits(
    smollm2_path: Path, tmp_path, fake_llama_cpp, monkeypatch
) -> None:
    """``llmlib bench generate --formats``: one row per format from the same run, ratios against
    that run's float32 and against llama.cpp at the format's bits, bytes per token from the
    stored weights, and a compile-memory field only on compiled rows."""
    model = tmp_path / smollm2_path.name
    model.symlink_to(smollm2_path)  # the copies land beside it, not in the shared cache
    monkeypatch.setattr(F.torch, "set_num_threads", lambda n: None)
    res = F.run(
        model,
        [("float32", False), ("int8", False)],
        new_tokens=4,
        runs=1,
        memory=False,
        log=lambda *_: None,
    )
    rows = {r["name"]: r for r in res["formats"]}
    assert {"llama.cpp F32", "llama.cpp Q8_0"} <= set(rows) and "llama.cpp BF16" not in rows
    assert rows["llama.cpp Q8_0"]["tokens_per_s"] == pytest.approx(1 / STEP_S["Q8_0"])
    for name, peer in (("float32", "llama.cpp F32"), ("int8", "llama.cpp Q8_0")):
        r = rows[name]
        assert r["llama_cpp_peer"] == peer
        assert r["vs_llama_cpp"] == round(r["tokens_per_s"] / rows[peer]["tokens_per_s"], 2)
    assert "vs_llama_cpp" not in rows["llama.cpp F32"]
    # prefill: the prompt's seconds, llmlib's from its own timing, llama.cpp's from eval
    n = res["prompt_tokens"]
    assert rows["llama.cpp F32"]["prefill_s"] == pytest.approx(n * PREFILL_S_PER_TOKEN, abs=1e-4)
    assert rows["llama.cpp F32"]["prefill_n_batch"] == 1
    assert res["llama_cpp_build"] == "SSE3 AVX2 AVX512 AMX_INT8 OPENMP"
    assert rows["float32"]["prefill_s"] > 0 and rows["int8"]["prefill_s"] > 0
    f32, i8 = rows["float32"], rows["int8"]
    assert f32["vs_float32"] == 1.0
    assert i8["vs_float32"] == round(i8["tokens_per_s"] / f32["tokens_per_s"], 2)
    # int8 stores a byte per weight (plus scales) where float32 stores four
    assert 3.5 < f32["weight_bytes_per_token"] / i8["weight_bytes_per_token"] < 4.1
    assert f32["compile_resident_bytes"] is None and i8["compile_resident_bytes"] is None
    assert 0 < i8["same_tokens_as_float32"] <= 1 and f32["same_tokens_as_float32"] == 1


def test_prompts_go_in_one_batch_unless_the_build_has_amx(fake_llama_cpp, monkeypatch) -> None:
    """Builds with AMX kernels crashed on batched prompts, so they read one token per call; any
    other build reads the prompt as llama.cpp does by default, so its prefill is a fair figure."""
    assert _llama_cpp.n_batch() == 1
    SYSTEM[0] = AVX2  # the fixture puts the AMX build back for the next test
    assert _llama_cpp.n_batch() == 512
    assert _llama_cpp.build() == "SSE3 AVX AVX2 F16C FMA OPENMP"  # not AVX512 = 0
