"""Batch-invariant mode: a request's logits bitwise the same in every situation the engine puts it in.

Tiny random models (float32 and bfloat16, each stored as the loader stores it on this CPU:
oneDNN's layouts where the flags choose them) through :func:`llmlib.analysis.invariance.measure`: batches of 4 and 16,
chunked prefill at two budgets, preemption with recompute, a prefix-cache hit. Every case must
be bitwise identical to the request run alone in batch-invariant mode; the same cases in the
default mode must show a difference somewhere (else these tests could not tell the modes apart).
"""

from __future__ import annotations

import math
import random
from functools import partial

import pytest
import torch

from llmlib.analysis.invariance import measure
from llmlib.config import ModelConfig
from llmlib.engine import LLM
from llmlib.engine.fixed_step import engine_forward
from llmlib.engine.invariant import InvariantStep
from llmlib.kernels import paged_attention
from llmlib.kernels.flags import forced
from llmlib.kernels.prepare import prepare
from llmlib.kernels.weights import Float32Weight, RowTiles
from llmlib.model import random_model
from llmlib.sampling import SamplingParams

CFG = ModelConfig(
    "tiny", vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128
)
CASES = ("batch-4", "batch-16", "chunk-7", "chunk-32", "preempted", "prefix-hit")


def tiny(dtype: torch.dtype, cfg: ModelConfig = CFG) -> torch.nn.Module:
    return prepare(random_model(cfg, "cpu", dtype, std=0.05))  # as the loader stores it


def prompts(n: int = 16, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(CFG.vocab_size) for _ in range(rng.randint(5, 90))] for _ in range(n)]


def engine(model, invariant: bool):
    def make(**kw):
        kw.setdefault("num_blocks", 256)
        return LLM(model, batch_invariant=invariant, **kw)

    return make


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def model(request):
    return tiny(request.param)


@pytest.fixture(params=[True, False], ids=["kernel", "tiles"])
def attention(request):
    """The invariant attention under each forced path: the paged kernel (one query per row, its
    keys in an order fixed by its position) and the tiled PyTorch loop used where it cannot run."""
    if request.param and not paged_attention.available():
        pytest.skip("the paged attention kernel cannot run on this machine")
    with forced(paged_kernel=request.param):
        yield request.param


def test_every_case_is_bitwise_identical_in_batch_invariant_mode(model, attention):
    res = measure(engine(model, True), prompts(), max_tokens=12, cases=CASES)
    for case, r in res.items():
        assert r.requests > 0, case  # the preemption case really preempted someone
        assert r.identical_share == 1.0 and r.max_abs_diff == 0.0, (case, r)
        assert not r.divergences


def test_the_default_mode_differs_somewhere(model):
    # the check above can fail: without the mode, the same comparison finds differences
    res = measure(engine(model, False), prompts(), max_tokens=12, cases=("chunk-7", "batch-16"))
    assert any(r.identical_share < 1.0 for r in res.values())


def test_batch_invariant_logits_match_the_default_mode_closely(attention):
    # the invariant attention is attention: same numbers as the default path up to rounding
    _same_as_default_mode(tiny(torch.float32), prompts(6), max_tokens=6, logprobs=3)


def _same_as_default_mode(m, ps, max_tokens: int, logprobs: int) -> None:
    """Greedy tokens equal, log-probabilities within 1e-4, default mode against invariant."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs, ignore_eos=True)
    a = LLM(m, num_blocks=128).generate(ps, sp, use_tqdm=False)
    b = LLM(m, num_blocks=128, batch_invariant=True).generate(ps, sp, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert abs(lx.logprob - ly.logprob) < 1e-4


@pytest.mark.parametrize(
    "extra",
    [{"sliding_window": 24}, {"attn_softcap": 5.0, "attn_scale": 0.2}],
    ids=["window", "softcap"],
)
def test_family_options_in_the_invariant_attention(extra, attention):
    cfg = ModelConfig(**{**CFG.__dict__, **extra})
    m = tiny(torch.float32, cfg)
    ps = prompts(4)
    _same_as_default_mode(m, ps, max_tokens=8, logprobs=2)
    res = measure(engine(m, True), ps, max_tokens=8, cases=("batch-4", "chunk-7"))
    assert all(r.identical_share == 1.0 for r in res.values())


def test_seeded_sampling_and_logprobs_reproduce_in_any_batch(model):
    ps = prompts(8, seed=1)
    sp = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=7, logprobs=4)
    alone = LLM(model, num_blocks=256, batch_invariant=True)
    one = alone.generate([ps[2]], sp, use_tqdm=False)[0]
    many = LLM(model, num_blocks=256, batch_invariant=True, max_num_batched_tokens=16)
    got = many.generate(ps, [sp] * len(ps), use_tqdm=False)[2]
    assert got.token_ids == one.token_ids
    assert [e.logprob for e in got.outputs[0].logprobs] == [
        e.logprob for e in one.outputs[0].logprobs
    ]


@pytest.mark.parametrize("stored", ["plain", "float32"])
def test_row_tiles_make_a_row_independent_of_the_row_count(stored):
    torch.manual_seed(0)
    w = torch.randn(300, 96)
    inner = w if stored == "plain" else Float32Weight(w, blocked=True)
    tiles = RowTiles(inner, 32)
    x = torch.randn(70, 96)
    ref = tiles.linear(x[:1])[0]
    for n in (2, 5, 31, 32, 33, 64, 70):
        assert torch.equal(tiles.linear(x[:n])[0], ref)
    assert tiles.linear(x[:5].view(1, 5, 96)).shape == (1, 5, 300)
    assert torch.allclose(tiles.linear(x), x @ w.T, atol=1e-5)
    with pytest.raises(ValueError):
        RowTiles(w, 0)


def test_tensor_parallel_is_refused():
    with pytest.raises(ValueError, match="batch_invariant=True with tensor_parallel_size=2"):
        LLM(tiny(torch.float32), batch_invariant=True, tensor_parallel_size=2)


def _serve_kwargs(kwargs_of, argv: list[str]) -> dict:
    """The keywords ``llmlib serve ARGV`` hands the engine."""
    import llmlib.serve.launch as launch

    return kwargs_of(launch, "build_engine", lambda: launch.main(argv))


def _serve_compiles(kwargs_of, argv: list[str]) -> bool:
    """Whether the engine ``llmlib serve ARGV`` starts compiles its steps (its config resolved
    for a checkpoint on this CPU, :func:`test_compile_default.resolved_compile`)."""
    from test_compile_default import resolved_compile

    seen = _serve_kwargs(kwargs_of, argv)
    keys = ("compile", "batch_invariant", "speculative_config")
    return resolved_compile(**{k: seen[k] for k in keys})


def test_serve_compiles_by_default_on_a_cpu_except_with_speculation(kwargs_of):
    with forced(compile_default=False):  # LLMLIB_COMPILE=0
        assert _serve_compiles(kwargs_of, []) is False
        assert _serve_compiles(kwargs_of, ["--compile"]) is True
    with forced(compile_default=True, invariant_compile=True):
        _serves_compiled_by_default(kwargs_of)
    with forced(compile_default=True, invariant_compile=False):  # an AVX2-only CPU
        assert _serve_compiles(kwargs_of, ["--batch-invariant"]) is False
        assert _serve_compiles(kwargs_of, ["--batch-invariant", "--compile"]) is True
        assert _serve_compiles(kwargs_of, []) is True


def _serves_compiled_by_default(kwargs_of):
    assert _serve_compiles(kwargs_of, []) is True
    assert _serve_compiles(kwargs_of, ["--no-compile"]) is False
    # the batch-invariant mode compiles its fixed-shape groups (engine.invariant.InvariantRows)
    assert _serve_compiles(kwargs_of, ["--batch-invariant"]) is True
    assert _serve_compiles(kwargs_of, ["--batch-invariant", "--no-compile"]) is False
    other = ["--speculative=ngram:4"]  # speculation runs steps of its own, eagerly
    assert _serve_compiles(kwargs_of, other) is False
    assert _serve_compiles(kwargs_of, [*other, "--compile"]) is True


@pytest.mark.parametrize(
    "flag, key",
    [("--batch-invariant", "batch_invariant"), ("--speculative=ngram:4", "speculative_config")],
)
def test_serve_flag_reaches_the_engine(kwargs_of, flag, key):
    """``llmlib serve --batch-invariant`` / ``--speculative`` reach the engine's keyword (only
    when given)."""
    for argv, want in (([flag], True), ([], False)):
        seen = _serve_kwargs(kwargs_of, argv)
        if key == "speculative_config":
            assert (seen.get(key) is not None) is want
            if want:
                assert seen[key].method == "ngram" and seen[key].num_speculative_tokens == 4
        else:
            assert seen[key] is want


def test_the_forced_path_is_the_one_that_runs(attention):
    """Under the kernel, a step plans one query per row (flat index, block table, key count);
    under the tiles, it plans tiles: so each parametrization above tests the path it names."""
    from llmlib.engine.paged_cache import PagedKVCache, SeqChunk

    cache = PagedKVCache(1, 8, 2, 4, 16)
    step = InvariantStep(cache, [[SeqChunk([0, 3], 2, 5)], [SeqChunk([1], 0, 1)]])
    if attention:
        index, table, lens = step.rows_plan
        assert index.tolist() == [0, 1, 2, 3, 4, 5] and lens.tolist() == [3, 4, 5, 6, 7, 1]
        assert table.tolist() == [[0, 3]] * 5 + [[1, 0]]
        assert step.tiles is None
    else:
        assert step.rows_plan is None and step.tiles is not None


# ---- compiled: every token a row of a group of fixed size (engine.invariant.InvariantRows) ----


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_groups_compute_what_the_eager_invariant_step_does(dtype):
    """InvariantRows run eagerly, with both kinds of group at 32 rows, over a step of prompt
    chunks, a recomputed sequence (prompt and generated tokens in one chunk) and a decode token,
    spread over several groups: the same logits, bit for bit, as the eager mode's InvariantStep,
    which takes every product in 32-row tiles and attends with the same kernel. So routing the
    tokens into groups, generated ones after prompts, loses no key a token must see."""
    if not paged_attention.available():
        pytest.skip("the paged attention kernel cannot run on this machine")
    from llmlib.engine.invariant import InvariantRows
    from llmlib.engine.paged_cache import SeqChunk
    from llmlib.engine.runner import ModelRunner

    torch.manual_seed(0)
    runner = ModelRunner(tiny(dtype), num_blocks=40, block_size=4, mode="invariant")
    chunks = [  # a prompt in two chunks (the second generated), a recompute, a decode token
        SeqChunk(list(range(0, 10)), 0, 23, 23),
        SeqChunk(list(range(10, 20)), 0, 30, 25),
        SeqChunk(list(range(0, 10)), 23, 12, 23),
        SeqChunk(list(range(20, 30)), 3, 1, 3),
    ]
    ids = torch.randint(CFG.vocab_size, (66,)).tolist()
    runner.forward_packed([SeqChunk(list(range(20, 30)), 0, 3)], ids[-4:-1], [2])  # 3 in pool
    ids = ids[:65] + ids[-1:]
    select = [22, 52, 64, 65]  # the end of each chunk
    ref = runner.forward_packed(chunks[:2] + chunks[3:], ids[:53] + ids[65:], [22, 52, 53])
    ref_2nd = runner.forward_packed(chunks[2:3], ids[53:65], [11])
    rows = InvariantRows(
        partial(engine_forward, runner.model),
        runner.cache,
        scratch_block=39,
        max_blocks=10,
        prompt_rows=32,
    )
    got = rows.run(chunks, ids, select)
    assert torch.equal(got[[0, 1, 3]], ref) and torch.equal(got[2:3], ref_2nd)
    assert len(rows._steps) == 2  # tables of 8 and 16 blocks: rounded up to powers of two
    # by default a prompt's tokens go in 128-row groups: other sums, near the same logits
    both = InvariantRows(
        partial(engine_forward, runner.model), runner.cache, scratch_block=39, max_blocks=10
    )
    near = both.run(chunks, ids, select)
    assert sorted({key[0] for key in both._steps}) == [32, 128]
    torch.testing.assert_close(near, got, atol=0.05, rtol=0.02)
    # the LM head on 2 rows a group: a group closes before its third sampled token, and every
    # token asked for (prompt ones too, as prompt log-probabilities ask) gets the same logits
    many = [5, 10, 15, 22, 30, 40, 52, 60, 64, 65]
    calls = []

    def counted(*args):
        calls.append(args[2].num_rows)
        return partial(engine_forward, runner.model)(*args)

    two = InvariantRows(counted, runner.cache, 39, 10, rows=2, prompt_rows=32)
    assert torch.equal(two.run(chunks, ids, many)[[3, 6, 8, 9]], got)
    assert torch.equal(two.run(chunks, ids, many), rows.run(chunks, ids, many))
    assert calls[:5] == [32, 32, 32, 2, 2] and {key[2] for key in two._steps} == {2}


def test_the_groups_take_sizes_whose_rows_the_graph_computes_alike():
    """A graph that computes some rows of a 32-row group with other code (as MKL's float32
    kernel for AVX2 does, rows 30 and 31) is caught by one token copied into every row: the
    generated tokens then go in groups of the next size that passes; a graph fine at every size
    keeps the preferred ones."""
    if not paged_attention.available():
        pytest.skip("the paged attention kernel cannot run on this machine")
    from llmlib.engine.invariant import PROMPT_TILE, ROW_TILE, InvariantRows
    from llmlib.engine.runner import ModelRunner

    runner = ModelRunner(tiny(torch.float32), num_blocks=40, block_size=4, mode="invariant")
    seen = []

    def skewed(ids, positions, step):
        out = partial(engine_forward, runner.model)(ids, positions, step)
        seen.append(out.shape[0])
        if out.shape[0] == 32:
            out[30:] = out[30:] * (1 + 2**-20)  # the last two rows' sums in another order
        return out

    def rows_of(forward):
        rows = InvariantRows(forward, runner.cache, scratch_block=39, max_blocks=10)
        return rows.settle(), rows.rows, rows.prompt_rows

    assert rows_of(partial(engine_forward, runner.model)) == (None, ROW_TILE, PROMPT_TILE)
    assert rows_of(skewed) == (None, 48, PROMPT_TILE)
    assert seen == [32, 48, 128, 48]  # a prompt group, with the LM head on all rows and on 48
    broken = rows_of(lambda *a: skewed(*a) * (1 + 2**-20 * torch.arange(len(a[0][0]))[:, None]))
    assert broken[0].startswith("no group of (32, 48, 64) or (128, 192, 256) rows")


def test_where_no_group_size_works_the_invariant_mode_stays_eager(monkeypatch):
    from llmlib.engine.invariant import InvariantRows

    if not paged_attention.available():
        pytest.skip("the paged attention kernel cannot run on this machine")
    monkeypatch.setattr(InvariantRows, "alike", lambda self, *args: False)
    llm = LLM(tiny(torch.float32), num_blocks=64, batch_invariant=True, compile=True)
    assert llm.runner.rows is None and llm.block_manager.outputs_apart is False
    assert llm.runner.decode_path.startswith("eager (no group of (32, 48, 64)")
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert len(llm.generate(prompts(2), sp, use_tqdm=False)[1].token_ids) == 4


def test_the_view_takes_a_tile_whose_rows_the_kernel_computes_alike(monkeypatch):
    """The eager mode's view checks each kind of matrix once: where the kernel computes rows 30
    and 31 of a 32-row tile another way (as MKL's float32 kernel for AVX2 does), it takes 48-row
    tiles; where every tile fails, loading the engine fails, naming a matrix."""
    from llmlib.kernels.prepare import row_tiled, weight_matrices

    m = tiny(torch.float32)
    plain = Float32Weight.linear
    probed = []

    def skewed(self, x, bias=None):
        y = plain(self, x, bias)
        probed.append(len(x))
        return torch.cat([y[:30], y[30:] * (1 + 2**-20)]) if len(y) == 32 else y

    monkeypatch.setattr(Float32Weight, "linear", skewed)
    view = row_tiled(m, 32, (48, 64))
    tiles = [mod.weight for mod in weight_matrices(view).values()]
    assert tiles and all(isinstance(t, RowTiles) for t in tiles)
    inner = [t for t in tiles if isinstance(t.inner, Float32Weight)]
    assert inner and {t.tile for t in inner} == {48}
    # once per shape: 32, then 48; then each tail against a whole tile (32 rows: skewed)
    assert len(probed) == 12 * len({t.shape for t in inner})
    # which small products give a whole tile's bits depends on the kernel (not 32: skewed)
    assert all(t.sizes[-1] == 48 and set(t.sizes[:-1]) <= {2, 4, 8, 16} for t in inner)
    # 53 rows: a whole tile, then 5 padded to 8, not 48; the same bits as inside a whole tile
    t = next(t for t in inner if 8 in t.sizes)
    x = torch.randn(53, t.shape[1])
    del probed[:]
    assert torch.equal(t.linear(x[:5]), t.linear(x)[:5]) and probed == [8, 48, 8]
    monkeypatch.setattr(Float32Weight, "linear", lambda self, x, bias=None: torch.rand(len(x), 3))
    with pytest.raises(ValueError, match=r"no tile of \(32, 48, 64\) rows multiplies"):
        row_tiled(m, 32, (48, 64))


def test_without_the_kernel_the_invariant_mode_stays_eager():
    with forced(paged_kernel=False):
        llm = LLM(tiny(torch.float32), num_blocks=64, batch_invariant=True, compile=True)
    assert llm.runner.rows is None
    assert llm.runner.decode_path.startswith("eager (the paged attention kernel")


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
def test_every_case_is_bitwise_identical_compiled(dtype):
    """The compiled groups (one graph, in memory here; from its package for a file) keep every
    case bitwise identical, and stay close to the eager invariant mode."""
    if not paged_attention.available():
        pytest.skip("the paged attention kernel cannot run on this machine")
    m = tiny(dtype)  # a model of its own: compiling re-stores its matrices for the graph
    eager = LLM(tiny(dtype), num_blocks=128, batch_invariant=True)
    sp = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)
    want = eager.generate(prompts(4), sp, use_tqdm=False)

    def make(**kw):
        kw.setdefault("num_blocks", 256)
        llm = LLM(m, batch_invariant=True, compile=True, **kw)
        assert llm.runner.rows is not None and llm.runner.decode_path.startswith("compiled")
        return llm

    res = measure(make, prompts(), max_tokens=12, cases=CASES)
    for case, r in res.items():
        assert r.requests > 0, case
        assert r.identical_share == 1.0 and r.max_abs_diff == 0.0, (case, r)
    got = make(num_blocks=128).generate(prompts(4), sp, use_tqdm=False)
    for x, y in zip(want, got):  # compiled against eager: the same sums, fused otherwise
        a, b = x.outputs[0], y.outputs[0]
        for tx, ty, lx, ly in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
            assert abs(lx.logprob - ly.logprob) < 0.05
            if tx != ty:  # a near tie (bfloat16 logits tie exactly) broken the other way
                assert dict(lx.top).get(ty, -math.inf) > lx.logprob - 0.05, (lx, ly)
                break
