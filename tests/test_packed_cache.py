"""Packed weights kept on disk (llmlib.checkpoints.packed): the first load of a quantized model
writes its layouts, a later one maps them instead of packing, and the model is the same."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_gguf import WIDE, random_hf_weights, write_gguf
from test_quantize import Q4_K_M

import llmlib
from llmlib.checkpoints import packed
from llmlib.kernels import integer
from llmlib.kernels.flags import flags, forced
from llmlib.kernels.prepare import weight_matrices

pytestmark = pytest.mark.skipif(
    not integer.available(), reason="no integer kernels here: nothing is kept"
)


@pytest.fixture
def q4_k_m(tmp_path):
    return write_gguf(
        tmp_path / "m.gguf", WIDE, random_hf_weights(WIDE, seed=5), T.Q4_K, types=Q4_K_M
    )


def _buffers(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items()}


def test_a_second_load_maps_what_the_first_packed(tmp_path, q4_k_m) -> None:
    with forced(packed_cache=True, cache=tmp_path / "cache"):
        first = llmlib.load_model(q4_k_m, "cpu", None, "gguf")
        kept = list((tmp_path / "cache" / "packed").glob("*.safetensors"))
        assert len(kept) == 1 and not hasattr(first, "packed_weights")
        second = llmlib.load_model(q4_k_m, "cpu", None, "gguf")
    assert second.packed_weights == kept[0]
    assert second.weight_format == first.weight_format
    a, b = _buffers(first), _buffers(second)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the matrices are views of the file's pages, not copies
    w = second.get_submodule("layers.0.ffn.w_gate_up").weight.w
    assert not w.untyped_storage().resizable()
    ids = torch.tensor([[5, 9, 11, 3, 7, 60]])
    with torch.no_grad():
        assert torch.equal(first(ids), second(ids))
    # stacked parts (q/k in Q4_K, v in Q6_K) come back stacked
    qkv = second.get_submodule("layers.0.attn.wqkv").weight
    assert [type(p) for p in qkv.parts] == [integer.VnniInt4Weight] * 2 + [integer.VnniInt6Weight]


def test_another_choice_packs_again_and_a_broken_file_is_replaced(tmp_path, q4_k_m) -> None:
    cache = tmp_path / "cache"
    with forced(packed_cache=True, cache=cache):
        llmlib.load_model(q4_k_m, "cpu", None, "gguf")
        with forced(six_bit=not flags().six_bit):  # another layout: another file
            other = llmlib.load_model(q4_k_m, "cpu", None, "gguf")
        assert not hasattr(other, "packed_weights")
        files = sorted((cache / "packed").glob("*.safetensors"))
        assert len(files) == 2
        for f in files:
            f.write_bytes(f.read_bytes()[:100])  # cut short
        again = llmlib.load_model(q4_k_m, "cpu", None, "gguf")
        assert not hasattr(again, "packed_weights")  # packed again, and kept again
        assert llmlib.load_model(q4_k_m, "cpu", None, "gguf").packed_weights.exists()


def test_off_by_default_in_tests_and_never_for_float_models(tmp_path, q4_k_m) -> None:
    assert not flags().packed_cache  # conftest: the tests leave no files behind
    with forced(packed_cache=True, cache=tmp_path / "cache"):
        model = llmlib.load_model(q4_k_m, "cpu", torch.float32)  # dense: nothing to keep
        assert not any(
            isinstance(m.weight, integer.VnniWeight) for m in weight_matrices(model).values()
        )
    assert not (tmp_path / "cache" / "packed").exists()
    assert packed.save({"x": torch.zeros(2, 2)}, tmp_path / "f.safetensors") is False
