"""The Triton kernels of the paged pool (:mod:`llmlib.kernels.paged_triton`) equal the reference
attention over the gathered keys, and ``index_copy_``, on a CPU under Triton's interpreter and on
a GPU compiled.

Without a GPU the kernels run under Triton's interpreter, which ``TRITON_INTERPRET=1`` selects
when triton is *imported* (its own library functions are decorated then): so this module sets it
before importing triton, takes it out of the environment again (no later test, and no process a
test starts, sees it), and puts it back only while its own tests run (the interpreter reads it
again when it first launches). No other test imports triton on a CPU, so nothing else runs
interpreted. On a machine with CUDA the variable is never set, the kernels compile, and the
``cuda`` cases (marked ``gpu``: ``benchmarks/gpu_check.py`` runs them) check the compiled kernels,
CUDA graph capture and the engine on the GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from llmlib.model.attention import AttentionSpec

CUDA = torch.cuda.is_available()
if not CUDA and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
try:
    triton = pytest.importorskip("triton", reason="triton is not installed (the test extra has it)")
    from llmlib.kernels import paged_triton
finally:
    if not CUDA:
        os.environ.pop("TRITON_INTERPRET", None)

if not CUDA:
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(paged_triton._decode_kernel, InterpretedFunction):
        raise RuntimeError(
            "triton was imported before tests/test_paged_triton.py set TRITON_INTERPRET=1, so its "
            "kernels cannot run on this CPU: import triton lazily in the module that did"
        )


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


# the kernels on each device: the interpreter where there is no GPU, compiled where there is
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(CUDA, reason="compiled on this machine: cuda")),
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]
    ),
]
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def _tol(dtype: torch.dtype) -> dict:
    # 16-bit pools: the result is rounded to the pool's dtype (and a GPU multiplies in tf32)
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}


def _pool(lens, hkv, hd, bs, dtype, device, pad_rows=0, seed=0):
    """Pools of randomly placed blocks holding ``len(lens)`` sequences, then ``pad_rows`` padding
    rows as a fixed-shape step makes them (``lens = 1``, every table entry the scratch block)."""
    g = torch.Generator().manual_seed(seed)
    nb = max(-(-x // bs) for x in lens)
    blocks = len(lens) * nb + 2  # the last one is the scratch block
    k = torch.randn(blocks, bs, hkv, hd, generator=g).to(dtype)
    v = torch.randn(blocks, bs, hkv, hd, generator=g).to(dtype)
    table = torch.randperm(blocks - 1, generator=g)[: len(lens) * nb].view(len(lens), nb)
    table = torch.cat([table, torch.full((pad_rows, nb), blocks - 1)])
    lens = torch.tensor(list(lens) + [1] * pad_rows)
    return k.to(device), v.to(device), table.to(device), lens.to(device)


def _reference(q, k, v, table, lens, scale=None, softcap=None, window=None):
    """Gather each row's blocks, then the book's naive attention in float64 under a mask: key ``j``
    visible where ``j < lens`` (and ``j >= lens - window``)."""
    n, H, hd = q.shape
    bs, hkv = k.shape[1], k.shape[2]
    S = table.shape[1] * bs
    kd = k[table.reshape(-1)].view(n, S, hkv, hd).transpose(1, 2).double()
    vd = v[table.reshape(-1)].view(n, S, hkv, hd).transpose(1, 2).double()
    pos = torch.arange(S, device=q.device)[None, :]
    mask = pos < lens[:, None]
    if window is not None:
        mask &= pos >= lens[:, None] - window
    spec = AttentionSpec("naive", scale=scale, softcap=softcap, window=window)
    return spec(q.double()[:, :, None], kd, vd, mask[:, None, None, :])[:, :, 0]


CASES = [  # query heads, KV heads, head size, block size, pool dtype
    (4, 4, 64, 16, torch.float32),  # one query head per KV head
    (9, 3, 64, 16, torch.bfloat16),  # SmolLM2's shape: 3 per KV head
    (16, 4, 128, 32, torch.bfloat16),  # 4 per KV head
    (32, 4, 128, 16, torch.float32),  # 8 per KV head
    (8, 1, 80, 32, torch.float16),  # a head of 80, padded to 128 and masked
    (4, 2, 256, 16, torch.bfloat16),  # a head of 256: the smaller tile of keys
    (40, 2, 64, 1, torch.float32),  # 20 per KV head (two programs each), blocks of one key
]
OPTIONS = [{}, {"window": 5}, {"window": 1000}, {"scale": 0.3, "softcap": 5.0}]


def _case_id(case) -> str:
    heads, hkv, hd, bs, dtype = case
    return f"gqa{heads // hkv}-hd{hd}-bs{bs}-{str(dtype).removeprefix('torch.')}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads,hkv,hd,bs,dtype", CASES, ids=[_case_id(c) for c in CASES])
def test_decode_equals_attention_over_gathered_keys(device, heads, hkv, hd, bs, dtype) -> None:
    # one key, part of a block, exactly one and two blocks, a long row; two padding rows
    lens = [1, 7, bs, 2 * bs, 3 * bs + 5, 100]
    k, v, table, lens = _pool(lens, hkv, hd, bs, dtype, device, pad_rows=2)
    q = torch.randn(len(lens), heads, hd).to(dtype).to(device)
    for opts in OPTIONS:  # a window shorter and longer than the rows; a scale and a soft cap
        out = paged_triton.decode_attention(q, k, v, table, lens, **opts)
        assert out.dtype == dtype and out.shape == q.shape
        ref = _reference(q, k, v, table, lens, **opts)
        torch.testing.assert_close(
            out.double(), ref, **_tol(dtype), msg=lambda m, o=opts: f"{o}: {m}"
        )


@pytest.mark.parametrize("device", DEVICES)
def test_decode_reads_only_the_keys_a_query_sees(device) -> None:
    """Every slot a query must not see (past its length, before its window, the table's padding
    entries, blocks of other rows) holds NaN: one read of any of them would spread into the
    output."""
    lens, hkv, hd, bs = [3, 20, 45], 2, 64, 16
    k, v, table, lens_t = _pool(lens, hkv, hd, bs, torch.float32, device)
    q = torch.randn(3, 6, hd, device=device)
    for window in (None, 9):
        ref = _reference(q, k, v, table, lens_t, window=window)
        kp, vp = k.clone(), v.clone()
        seen = torch.zeros(kp.shape[0] * bs, dtype=torch.bool, device=device)
        for i, n in enumerate(lens):
            t = torch.arange(n if window is None else min(n, window), device=device) + max(
                0, n - (window or n)
            )
            seen[table[i, t // bs] * bs + t % bs] = True
            table[i, -(-n // bs) :] = kp.shape[0] - 1  # padding entries: a block of NaN
        kp.view(-1, hkv, hd)[~seen] = float("nan")
        vp.view(-1, hkv, hd)[~seen] = float("nan")
        out = paged_triton.decode_attention(q, kp, vp, table, lens_t, window=window)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_a_wrong_block_table_fails_the_comparison(device) -> None:
    """The comparison can fail: a row's table naming another row's block in place of its own (as
    a kernel that walked the table wrongly would read), or the row's lengths off by one."""
    k, v, table, lens = _pool([40, 40], 2, 64, 16, torch.float32, device)
    q = torch.randn(2, 4, 64, device=device)
    ref = _reference(q, k, v, table, lens)
    wrong = table.clone()
    wrong[0, 1] = table[1, 1]
    for t, n in ((wrong, lens), (table, lens - 1), (table, lens + 1)):
        out = paged_triton.decode_attention(q, k, v, t, n)
        with pytest.raises(AssertionError):
            torch.testing.assert_close(out.double(), ref, **_tol(torch.bfloat16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [None, 21])
def test_a_querys_sums_do_not_depend_on_the_block_size_or_the_batch(device, window) -> None:
    """The same keys in pools of 4-, 16- and 7-key blocks, and each row alone, give bitwise the
    same output: tiles of keys follow the query's position, never the blocks or the other rows
    (the batch-invariant mode relies on it)."""
    g = torch.Generator().manual_seed(3)
    n, H, hkv, D, L = 3, 6, 2, 32, 70
    keys, vals = (torch.randn(n, L, hkv, D, generator=g) for _ in range(2))
    q = torch.randn(n, H, D, generator=g).to(device)
    lens = torch.tensor([70, 33, 5], device=device)
    outs = []
    for bs in (4, 16, 7):
        nb = -(-L // bs)
        table = torch.randperm(n * nb, generator=g).view(n, nb)
        pad = torch.zeros(n, nb * bs - L, hkv, D)
        k, v = (torch.empty(n * nb, bs, hkv, D) for _ in range(2))
        k[table.view(-1)] = torch.cat([keys, pad], 1).view(n * nb, bs, hkv, D)
        v[table.view(-1)] = torch.cat([vals, pad], 1).view(n * nb, bs, hkv, D)
        k, v, table = k.to(device), v.to(device), table.to(device)
        outs.append(paged_triton.decode_attention(q, k, v, table, lens, window=window))
    alone = [  # each row in a batch of its own
        paged_triton.decode_attention(
            q[i : i + 1], k, v, table[i : i + 1], lens[i : i + 1], window=window
        )
        for i in range(n)
    ]
    outs.append(torch.cat(alone))
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    ref = _reference(q, k, v, table, lens, window=window)
    torch.testing.assert_close(outs[0].double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "pool_dtype,new_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ],
    ids=["float32", "bfloat16", "float32-into-bfloat16"],
)
def test_write_kv_equals_index_copy(device, pool_dtype, new_dtype) -> None:
    """Each new token's keys and values land at its slot, in the pool's dtype (rounded as
    PyTorch rounds); a negative slot (a padding row) writes nothing. The new keys may be a
    strided view, as the model's q/k/v split hands them over."""
    g = torch.Generator().manual_seed(1)
    blocks, bs, hkv, hd = 6, 16, 3, 80
    # each pool a view between two guard blocks: a write out of the pool lands there
    k_buf = torch.randn(blocks + 2, bs, hkv, hd, generator=g).to(pool_dtype).to(device)
    v_buf = torch.randn(blocks + 2, bs, hkv, hd, generator=g).to(pool_dtype).to(device)
    k_pool, v_pool = k_buf[1:-1], v_buf[1:-1]
    slots = torch.tensor([5, 17, 95, 0, -1, 40], device=device)
    # a slice of heads, as of the model's fused q/k/v; a transpose (copied first)
    k_new = torch.randn(6, hkv + 3, hd, generator=g).to(new_dtype).to(device)[:, 1 : 1 + hkv]
    v_new = torch.randn(6, hd, hkv, generator=g).to(new_dtype).to(device).transpose(1, 2)
    want_k, want_v = k_buf.clone(), v_buf.clone()
    real = slots >= 0
    want_k[1:-1].view(-1, hkv, hd).index_copy_(0, slots[real], k_new[real].to(pool_dtype))
    want_v[1:-1].view(-1, hkv, hd).index_copy_(0, slots[real], v_new[real].to(pool_dtype))
    paged_triton.write_kv(k_pool, v_pool, slots, k_new, v_new)
    assert torch.equal(k_buf, want_k) and torch.equal(v_buf, want_v)


def test_meta_tensors_give_shapes_without_running() -> None:
    """On the meta device (a trace of a step's shapes) the ops answer without a kernel."""
    meta = {"device": "meta"}
    q = torch.empty(5, 8, 64, dtype=torch.bfloat16, **meta)
    pool = torch.empty(10, 16, 2, 64, dtype=torch.bfloat16, **meta)
    table = torch.empty(5, 3, dtype=torch.long, **meta)
    lens = torch.empty(5, dtype=torch.long, **meta)
    out = paged_triton.decode_attention(q, pool, pool, table, lens, window=4, softcap=2.0)
    assert (out.shape, out.dtype, out.device.type) == (q.shape, q.dtype, "meta")
    paged_triton.write_kv(pool, pool, lens, q[:, :2], q[:, 2:4])


def test_the_ops_trace_into_their_triton_kernels(tmp_path) -> None:
    """What ``torch.compile`` sees on a GPU: AOTAutograd's trace of a step calling both ops holds
    the Triton kernels themselves (``torch.library.triton_op``), not opaque calls. Traced on meta
    tensors in a process without the interpreter (its kernels cannot be traced)."""
    script = textwrap.dedent(
        """
        import logging, torch
        logging.disable(logging.WARNING)  # no GPU here: torch cannot analyse what they mutate
        from torch._functorch.aot_autograd import aot_function
        from llmlib.kernels import paged_triton as pt
        m = {"device": "meta"}
        q, new = torch.empty(4, 8, 64, **m), torch.empty(4, 2, 64, **m)
        k, v = (torch.empty(10, 16, 2, 64, **m) for _ in range(2))
        t, n = torch.empty(4, 3, dtype=torch.long, **m), torch.empty(4, dtype=torch.long, **m)
        def step(q, k, v, t, n, new):
            pt.write_kv(k, v, n, new, new)
            return pt.decode_attention(q, k, v, t, n, window=8)
        graphs = []
        aot_function(step, fw_compiler=lambda gm, _: graphs.append(gm.code) or gm)(q, k, v, t, n, new)
        print(graphs[0])
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("triton_kernel_wrapper_functional(") == 2, run.stdout


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [None, 6])
def test_the_engine_step_through_the_kernel(device, window, monkeypatch) -> None:
    """The engine's paged step with the Triton kernel as its decode attention (on a CPU, in the
    C++ kernel's place) equals its gather path: a row of one prefill and four decodes, then a
    fixed-shape step of the CUDA graphs with padding rows on the scratch block."""
    from llmlib.engine import paged_cache
    from llmlib.engine.fixed_step import FixedStep
    from llmlib.engine.paged_cache import PagedKVCache, SeqChunk
    from llmlib.kernels import paged_attention

    calls = []
    # on a CPU the interpreted kernel takes the C++ kernel's place; on CUDA it is already there
    kernel_fn = paged_triton.decode_attention if device == "cpu" else paged_cache.decode_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel_fn(*args, **kwargs)

    from llmlib.engine import fixed_step

    monkeypatch.setattr(paged_cache, "decode_attention", counted)
    monkeypatch.setattr(fixed_step, "decode_attention", counted)
    torch.manual_seed(0)
    H, HKV, D, BS = 6, 2, 64, 4
    seqs = [(9, 0), (13, 12), (7, 6), (30, 29), (5, 4)]  # one prefill, four decodes
    cache = PagedKVCache(1, 41, HKV, BS, D, device=device)
    perm = torch.randperm(40).tolist()
    tables, p = [], 0
    for n, _ in seqs:
        tables.append(perm[p : p + -(-n // BS)])
        p += -(-n // BS)
    for (n, done), t in zip(seqs, tables):
        if done:
            kv = torch.randn(1, HKV, done, D, device=device)
            cache.step([[SeqChunk(t, 0, done)]]).update(0, kv, kv.flip(-1))
    T = sum(n - done for n, done in seqs)
    q, k, v = (torch.randn(1, h, T, D, device=device) for h in (H, HKV, HKV))
    spec = AttentionSpec(window=window)
    chunks = [[SeqChunk(t, done, n - done) for (n, done), t in zip(seqs, tables)]]
    outs = []
    for kernel in (True, False):
        cache.kernel = kernel
        if device == "cuda":
            assert paged_attention.serves_pool(cache.k[0])
        outs.append(cache.step(chunks).attend(0, q, k, v, spec))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)

    decodes = [(t, done) for (n, done), t in zip(seqs, tables) if n - done == 1]
    step = FixedStep(cache, rows=8, blocks=8, scratch_block=40)
    step.fill([SeqChunk(t, done, 1) for t, done in decodes], [0] * len(decodes))
    q, k, v = (torch.randn(1, h, 8, D, device=device) for h in (H, HKV, HKV))  # one row of 8
    outs = []
    for kernel in (True, False):
        cache.kernel = kernel
        outs.append(step.attend(0, q, k, v, spec)[:, :, : len(decodes)])
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    assert len(calls) == 2  # once per step with the kernel on, never with it off


# ---- on a GPU only -------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
def test_cuda_graphs_capture_the_kernels_and_replay_new_values() -> None:
    """A graph captured over both kernels replays with new slots, tables and lengths written
    into its buffers: nothing was read back to the host while capturing."""
    dev, bs, hkv, hd, H = "cuda", 16, 2, 128, 8
    k_pool = torch.zeros(64, bs, hkv, hd, device=dev, dtype=torch.bfloat16)
    v_pool = torch.zeros_like(k_pool)
    g = torch.Generator(device=dev).manual_seed(0)
    k_pool.normal_(generator=g)
    v_pool.normal_(generator=g)
    table = torch.zeros(4, 8, dtype=torch.long, device=dev)
    lens = torch.ones(4, dtype=torch.long, device=dev)
    slots = torch.zeros(4, dtype=torch.long, device=dev)
    q = torch.zeros(4, H, hd, device=dev, dtype=torch.bfloat16)
    new = torch.zeros(4, hkv, hd, device=dev, dtype=torch.bfloat16)

    def step():
        paged_triton.write_kv(k_pool, v_pool, slots, new, new)
        return paged_triton.decode_attention(q, k_pool, v_pool, table, lens, softcap=30.0)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compile before capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for trial in range(3):
        table.copy_(torch.randperm(64, device=dev)[:32].view(4, 8))
        lens.copy_(torch.tensor([1, 17, 64 + trial, 128], device=dev))
        slots.copy_(table.gather(1, ((lens - 1) // bs)[:, None])[:, 0] * bs + (lens - 1) % bs)
        q.normal_(generator=g)
        new.normal_(generator=g)
        graph.replay()
        ref = _reference(q, k_pool, v_pool, table, lens, softcap=30.0)
        torch.testing.assert_close(out.double(), ref, **_tol(torch.bfloat16))


@pytest.mark.gpu
@gpu
def test_a_decode_step_on_cuda_copies_no_cache() -> None:
    """The issue's point: at a real shape the engine's decode attention on CUDA allocates
    nothing near the size of the keys it reads (the gather path copies them all)."""
    from llmlib.engine.paged_cache import PagedKVCache, SeqChunk

    H, HKV, D, BS, rows, nb = 32, 8, 128, 16, 64, 64
    cache = PagedKVCache(1, rows * nb + 1, HKV, BS, D, device="cuda", dtype=torch.bfloat16)
    assert cache.kernel
    chunks = [[SeqChunk(list(range(i * nb, (i + 1) * nb)), nb * BS - 1, 1)] for i in range(rows)]
    q = torch.randn(rows, H, 1, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(rows, HKV, 1, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    spec = AttentionSpec()
    peaks = []
    for kernel in (True, False):
        cache.kernel = kernel
        step = cache.step(chunks)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step.attend(0, q, k, v, spec)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
    keys = rows * nb * BS * HKV * D * 2  # bytes of the keys the step reads
    assert peaks[0] < keys / 20 and peaks[1] > keys, peaks


@pytest.mark.gpu
@gpu
def test_torch_compile_on_cuda_runs_the_kernels() -> None:
    k, v, table, lens = _pool([5, 40, 77], 2, 64, 16, torch.bfloat16, "cuda")
    q = torch.randn(3, 8, 64, device="cuda", dtype=torch.bfloat16)

    def attend(q, k, v, table, lens):
        return paged_triton.decode_attention(q, k, v, table, lens, window=30) * 2

    compiled = torch.compile(attend, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, table, lens), attend(q, k, v, table, lens))
