"""Tensor parallelism without processes: the shard rules, the lazy readers, and the sharded
forward pass of every family, each rank in a thread of this process on a real gloo group.

Threads make these fast (no process start-up); the engine's multi-process path, with the same
shards and hooks, is tests/test_tp_engine.py.
"""

from __future__ import annotations

import socket
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from llmlib.analysis.capacity import weight_bytes_per_gpu
from llmlib.checkpoints.build import read_checkpoint
from llmlib.checkpoints.lazy import LazyTensor, read_checkpoint_lazy
from llmlib.checkpoints.save import save_hf_folder
from llmlib.config import ModelConfig, get_config
from llmlib.model import random_model
from llmlib.parallel.comm import Comm, parallelize
from llmlib.parallel.load import load_shard, shard_model, weight_bytes
from llmlib.parallel.shard import (
    check_engine_tp,
    shard_config,
    shard_specs,
    shard_state,
    vocab_range,
)
from llmlib.shapes import numel, param_shapes

BASE = ModelConfig(
    name="tiny",
    vocab_size=101,  # not a multiple of 2 or 4: the last rank's vocabulary rows are padding
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=64,
    max_seq_len=64,
)
FAMILIES = {
    "llama-gqa": (BASE, 2),
    "llama-tied": (BASE.replace(tie_embeddings=True), 2),
    "kv-replicated": (BASE, 4),  # 4 ranks, 2 KV heads: each KV head on two ranks
    "mha": (BASE.replace(n_kv_heads=4), 4),
    "moe": (BASE.replace(n_experts=4, n_experts_per_token=2), 2),
    "qwen-biases-qk-norm": (BASE.replace(qkv_bias=True, out_bias=True, qk_norm=True), 2),
    "gemma-like": (
        BASE.replace(
            post_norms=True,
            scale_embeddings=True,
            attn_softcap=50.0,
            final_softcap=30.0,
            activation="gelu_tanh",
            norm_offset=1.0,
            tie_embeddings=True,
            sliding_window=4,
        ),
        2,
    ),
}


def run_ranks(tp: int, fn, timeout_s: float = 60.0) -> list:
    """``fn(rank, comm)`` on ``tp`` threads joined in one gloo group; their results by rank."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    td = timedelta(seconds=timeout_s)
    master = dist.TCPStore(
        "127.0.0.1", port, tp, True, td, wait_for_workers=False, master_listen_fd=sock.fileno()
    )
    sock.detach()  # the store's server owns the socket now
    results: list = [None] * tp
    errors: list = []

    def rank(r: int) -> None:
        try:
            store = dist.PrefixStore("tp", dist.TCPStore("127.0.0.1", port, tp, False, td))
            group = dist.ProcessGroupGloo(store, r, tp, td)
            results[r] = fn(r, Comm(group, r, tp))
        except Exception as e:  # surfaced below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 5)
    del master
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


def sharded_logits(model, tp: int, ids: torch.Tensor) -> torch.Tensor:
    cfg = model.config

    def rank(r: int, comm: Comm) -> torch.Tensor | None:
        shard = parallelize(shard_model(model, tp, r), comm, vocab_range(cfg, tp, r))
        with torch.no_grad():
            return comm.gather_logits(shard.logits(shard.hidden(ids)), cfg.vocab_size)

    return run_ranks(tp, rank)[0]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sharded_forward_equals_the_whole_model(family: str) -> None:
    cfg, tp = FAMILIES[family]
    model = random_model(cfg, device="cpu", dtype=torch.float32, seed=1, std=0.2)
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(ids)
    got = sharded_logits(model, tp, ids)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() < 1e-5


def test_shards_come_from_the_shape_table_and_cover_the_model() -> None:
    """Every rank's tensor has its shard_config's shape; the split tensors' slices tile the whole
    (rows or columns, no overlap, nothing missing), and the rest is held whole."""
    cfg, tp = FAMILIES["moe"][0].replace(qkv_bias=True, out_bias=True), 2
    full = param_shapes(cfg)
    local = param_shapes(shard_config(cfg, tp))
    specs = [shard_specs(cfg, tp, r) for r in range(tp)]
    for name, shape in full.items():
        assert all(s[name].shape == local[name] for s in specs), name
        kinds = {s[name].kind for s in specs}
        assert len(kinds) == 1, name
        kind = kinds.pop()
        if kind in ("rows", "cols"):
            d = specs[0][name].dim
            ranges = sorted((s[name].start, s[name].stop) for s in specs)
            assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert ranges[-1][1] == shape[d], name
        else:
            assert local[name] == shape, name
    assert specs[0]["layers.0.ffn.router.weight"].kind == "whole"
    assert specs[1]["layers.0.attn.wo.bias"].kind == "first_rank"


def test_bytes_per_rank_match_the_cost_model() -> None:
    """The engine's shards and llmlib.analysis.capacity's arithmetic are the same split: Llama-3-70B's
    rank on 8 GPUs, from the shape table, is weight_bytes_per_gpu to within the vocabulary
    padding."""
    cfg = get_config("llama-3-70b")
    for tp in (2, 4, 8):
        rank_params = sum(numel(s) for s in param_shapes(shard_config(cfg, tp)).values())
        assert rank_params * 2 == pytest.approx(weight_bytes_per_gpu(cfg, tp, "bf16"), rel=1e-6)


def test_refusals_name_the_reason(smollm2_path: Path) -> None:
    cfg = read_checkpoint_lazy(smollm2_path)[0]
    with pytest.raises(ValueError, match="9 query heads do not split over 2"):
        check_engine_tp(cfg, 2)
    check_engine_tp(cfg, 3)  # 9 query and 3 KV heads: three each, one KV head each
    with pytest.raises(ValueError, match="FFN width of 1536 does not split over 9"):
        check_engine_tp(cfg.replace(n_kv_heads=9), 9)  # 1536 = 9 * 170.7
    with pytest.raises(ValueError, match="KV heads neither split"):
        check_engine_tp(BASE.replace(n_heads=6, n_kv_heads=2), 3)


# ---- the lazy readers ------------------------------------------------------------------------------


def test_lazy_tensor_slices_compose() -> None:
    full = torch.arange(2 * 6 * 8, dtype=torch.float32).view(2, 6, 8)
    reads = []

    def read(index):
        reads.append(index)
        return full[index].clone()

    t = LazyTensor(read, full.shape, torch.float32)
    assert t.shape == full.shape and t.dim() == 3 and not reads
    assert torch.equal(t[1, 2:5].narrow(1, 3, 4).load(), full[1, 2:5, 3:7])
    assert reads[-1] == (1, slice(2, 5), slice(3, 7))  # one read of exactly that part
    parts = t[0].split([2, 4], dim=0)
    assert [tuple(p.shape) for p in parts] == [(2, 8), (4, 8)]
    assert torch.equal(parts[1].load(), full[0, 2:])
    assert torch.equal(t, LazyTensor(read, full.shape, torch.float32))  # torch functions read it


def test_lazy_gguf_equals_the_reader_and_reads_slices(smollm2_path: Path) -> None:
    """Every GGUF tensor read whole through the lazy path equals read_gguf's; a slice of rows or
    of whole blocks of columns (q and k un-permuted per head) equals the same slice of it."""
    cfg, state, _ = read_checkpoint(smollm2_path)
    cfg2, lazy, _ = read_checkpoint_lazy(smollm2_path)
    assert cfg2 == cfg and lazy.keys() == state.keys()
    for name in ["embed.weight", "layers.0.attn.wq.weight", "layers.0.attn.wk.weight"]:
        assert torch.equal(lazy[name].load(), state[name]), name
    for name in ["layers.29.attn_norm.weight", "layers.7.ffn.w_down.weight"]:
        assert torch.equal(lazy[name].load(), state[name]), name
    hd = cfg.head_dim
    q = lazy["layers.3.attn.wq.weight"]
    assert torch.equal(q[3 * hd : 6 * hd].load(), state["layers.3.attn.wq.weight"][3 * hd : 6 * hd])
    assert torch.equal(q[70:75, 5:9].load(), state["layers.3.attn.wq.weight"][70:75, 5:9])
    down = lazy["layers.3.ffn.w_down.weight"]
    assert torch.equal(down[:, 512:1024].load(), state["layers.3.ffn.w_down.weight"][:, 512:1024])
    assert torch.equal(down[:, 500:600].load(), state["layers.3.ffn.w_down.weight"][:, 500:600])


@pytest.mark.parametrize("sharded_files", [False, True])
def test_lazy_safetensors_and_the_hf_writer(tmp_path: Path, sharded_files: bool) -> None:
    model = random_model(BASE, device="cpu", dtype=torch.float32, seed=2)
    save_hf_folder(model, tmp_path, max_shard_bytes=20_000 if sharded_files else None)
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded_files
    cfg, state, _ = read_checkpoint(tmp_path)
    _, lazy, _ = read_checkpoint_lazy(tmp_path)
    assert lazy.keys() == state.keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        assert torch.equal(lazy[k].load(), v) and torch.equal(state[k], v), k
    wo = lazy["layers.1.attn.wo.weight"]
    assert torch.equal(wo[:, 16:32].load(), model.state_dict()["layers.1.attn.wo.weight"][:, 16:32])


def test_hf_writer_loads_in_transformers(tmp_path: Path) -> None:
    """The folder save_hf_folder writes is a real Hugging Face checkpoint: transformers reads it
    and computes the same logits."""
    transformers = pytest.importorskip("transformers")
    model = random_model(BASE, device="cpu", dtype=torch.float32, seed=4, std=0.2)
    save_hf_folder(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, BASE.vocab_size, (1, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert (hf(ids).logits - model(ids)).abs().max().item() < 1e-4


def test_a_rank_loads_only_its_slice(smollm2_path: Path) -> None:
    """Rank 1 of 3 on the real GGUF: the lazily read shard is the whole model's shard, and it
    holds its shape table's bytes, about a third of the model's plus the replicated norms."""
    tp, rank = 3, 1
    shard, cfg = load_shard(smollm2_path, tp, rank, "cpu", torch.float32)
    _, state, _ = read_checkpoint(smollm2_path)
    want = shard_state(state, cfg, tp, rank)
    got = shard.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    w = weight_bytes(shard, cfg, tp)
    assert w.held == w.expected
    assert w.held <= 1.1 * w.full / tp + w.replicated
    assert w.held >= 0.9 * w.full / tp
