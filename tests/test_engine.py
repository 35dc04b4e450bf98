"""The batching engine against the one-request Generator: same tokens, whatever the batching does.

The model is a small random Llama built with transformers, saved, and loaded by llmlib (fast).
Its LM head is scaled up so the next-token distribution is peaked: batched float32 matmuls may
differ from batch-1 ones in the last bits, and a random model with nearly flat logits could flip
a greedy near-tie on that alone. With gaps of several logits between the top tokens, any
difference in tokens means a real bug (a wrong position, a wrong block, a wrong mask).
"""

from __future__ import annotations

import asyncio
import contextlib
import random

import pytest
import torch

from llmlib.engine import LLM, AsyncLLM, QueueFull
from llmlib.generate import Generator
from llmlib.sampling import SamplingParams


class ByteTokenizer:
    """Token i is byte i: enough to exercise text, UTF-8 holding back and stop strings."""

    eos_id = None
    bos_id = None
    vocab_size = 256
    special_tokens: dict = {}

    def encode(self, text, allowed_special=None):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids):
        return bytes(ids)

    def id_to_bytes(self, i):
        return bytes([i])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    import llmlib

    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg)
    with torch.no_grad():
        hf.lm_head.weight.mul_(10.0)  # peaked logits: see the module docstring
    folder = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(folder)
    return llmlib.load_model(folder)


@pytest.fixture(scope="module")
def tok():
    return ByteTokenizer()


@pytest.fixture(scope="module")
def workload():
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 48))] for _ in range(64)]
    max_tokens = [rng.randint(1, 24) for _ in range(64)]
    return prompts, max_tokens


@pytest.fixture(scope="module")
def reference(model, tok, workload):
    """Every prompt alone through the Generator (static cache, batch 1)."""
    gen = Generator(model, tok)
    prompts, max_tokens = workload
    return [gen.generate(p, max_new_tokens=n, temperature=0.0) for p, n in zip(prompts, max_tokens)]


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n)


def check_against_reference(outs, reference, workload):
    prompts, _ = workload
    diffs = [i for i, (o, r) in enumerate(zip(outs, reference)) if o.token_ids != r.token_ids]
    assert not diffs, (
        f"{len(diffs)} of {len(outs)} requests differ from the Generator, first: {diffs[0]}"
    )
    for o, r, p in zip(outs, reference, prompts):
        assert o.prompt_token_ids == p
        assert o.text == r.text
        assert o.finish_reason == r.finish_reason


def test_64_mixed_prompts_match_the_generator(model, tok, workload, reference):
    prompts, max_tokens = workload
    llm = LLM(model, tok, num_blocks=1024, block_size=4, max_num_batched_tokens=256)
    outs = llm.generate(prompts, [greedy(n) for n in max_tokens], use_tqdm=False)
    check_against_reference(outs, reference, workload)
    st = llm.stats()
    assert st.preemptions == 0
    assert llm.block_manager.num_free_blocks == 1024  # every block back on the free list
    llm.block_manager.check_consistency([])
    assert st.decode_tokens > 0 and st.prefill_tokens > 0
    assert all(o.metrics.num_generated_tokens == len(o.token_ids) for o in outs)


def test_small_pool_forces_preemption_and_still_matches(model, tok, workload, reference):
    prompts, max_tokens = workload
    # 48 blocks of 4 slots = 192 tokens, against a workload whose sequences total ~2,300 tokens
    llm = LLM(model, tok, num_blocks=48, block_size=4, max_num_batched_tokens=256)
    outs = llm.generate(prompts, [greedy(n) for n in max_tokens], use_tqdm=False)
    st = llm.stats()
    assert st.preemptions > 0, "the pool was meant to be too small to avoid preemption"
    assert any(o.metrics.num_preemptions > 0 for o in outs)
    check_against_reference(outs, reference, workload)
    assert llm.block_manager.num_free_blocks == 48
    llm.block_manager.check_consistency([])
    assert st.peak_used_blocks <= 48


@pytest.mark.parametrize("num_blocks", [1024, 48])
def test_fixed_shape_decode_steps_match_the_generator(model, tok, workload, reference, num_blocks):
    """The CUDA-graph path (fixed-shape decode steps, padded rows writing a scratch block) run
    eagerly on the CPU: the same tokens, with and without preemption, and every block comes back.
    The steps that carry prompt chunks ran through the same fixed-shape step, every token a row
    (where the attention kernel runs)."""
    prompts, max_tokens = workload
    llm = LLM(
        model,
        tok,
        num_blocks=num_blocks,
        block_size=4,
        max_num_batched_tokens=256,
        cuda_graphs=True,
        max_num_seqs=48,
    )
    outs = llm.generate(prompts, [greedy(n) for n in max_tokens], use_tqdm=False)
    check_against_reference(outs, reference, workload)
    graphs = llm.runner.graphs
    # no CUDA here: nothing captured
    assert graphs is not None and not graphs.steps.enabled and graphs.replays == 0
    assert graphs.static_steps > 0, "no step went through the fixed-shape path"
    assert len(graphs.steps.entries) > 1  # several (rows, blocks) buckets were used
    if not graphs.masked:  # the kernel serves this model's attention: prompt steps as rows
        assert graphs.token_steps > 0 and graphs.static_steps == llm.stats().forward_passes
    assert llm.block_manager.num_free_blocks == num_blocks
    assert llm.runner.cache.num_blocks == num_blocks + 1  # the scratch block, never handed out
    assert llm.stats().preemptions > 0 if num_blocks == 48 else llm.stats().preemptions == 0


def test_compiled_decode_steps_match_the_generator(model, tok, workload, reference, monkeypatch):
    """``LLM(compile=True)`` on a model with no file behind it (so no package on disk: see
    tests/test_aot.py): the fixed-shape decode steps through one torch.compile graph with
    symbolic sizes, compiled when the engine starts. The same greedy tokens; no second graph for
    the other batch sizes and history lengths; a second engine on the same model reuses the graph;
    and the modes it does not serve say so."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(model, "source_path", None)
    prompts, max_tokens = (x[:24] for x in workload)
    counters.clear()
    kw = dict(num_blocks=512, block_size=4, max_num_batched_tokens=256, max_num_seqs=24)
    llm = LLM(model, tok, compile=True, **kw)
    assert llm.runner.decode_path == "compiled (in memory)"
    assert llm.compile_s is not None and llm.compile_s > 0
    outs = llm.generate(prompts, [greedy(n) for n in max_tokens], use_tqdm=False)
    check_against_reference(outs, reference[:24], (prompts, max_tokens))
    graphs = llm.runner.graphs
    assert graphs.static_steps > 0 and len(graphs.steps.entries) > 2  # buckets, one graph
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    again = LLM(model, tok, compile=True, **kw)
    assert again.compile_s < llm.compile_s / 10 and counters["stats"]["unique_graphs"] == 1
    # the batch-invariant mode's groups (two fixed row counts) run through the same graph
    inv = LLM(model, tok, compile=True, batch_invariant=True, **kw)
    inv.generate(prompts[:4], [greedy(n) for n in max_tokens[:4]], use_tqdm=False)
    assert inv.runner.rows is not None and counters["stats"]["unique_graphs"] == 1
    groups = inv.runner.rows  # 32 and 128 rows, unless a size failed the check at start
    ran = {key[0] for key in groups._steps}
    assert {groups.rows, groups.prompt_rows} <= ran and 32 in ran and 128 in ran


def test_fixed_step_padding_touches_only_the_scratch_block():
    from llmlib.engine.fixed_step import FixedStep
    from llmlib.engine.paged_cache import PagedKVCache, SeqChunk
    from llmlib.model.attention import AttentionSpec

    torch.manual_seed(0)
    cache = PagedKVCache(1, 6, 2, 4, 8)  # block 5 is the scratch block
    step = FixedStep(cache, rows=4, blocks=2, scratch_block=5)
    step.fill([SeqChunk([3, 1], 5, 1), SeqChunk([2], 0, 1)], [7, 9])  # two real rows, two padding
    assert step.ids.tolist() == [[7, 9, 0, 0]] and step.positions.tolist() == [[5, 0, 0, 0]]
    q, k, v = torch.randn(1, 4, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    out = step.attend(0, q, k, v, AttentionSpec())
    assert torch.isfinite(out).all()
    # row 0: position 5 = block table[1] = 1, slot 1
    assert torch.equal(cache.k[0][1][1], k[0, :, 0])
    assert torch.equal(cache.k[0][2][0], k[0, :, 1])  # row 1: position 0 of block 2
    untouched = [b for b in range(5) if b not in (1, 2)]
    assert all((cache.k[0][b] == 0).all() for b in untouched)
    with pytest.raises(ValueError, match="does not fit a step of 4 x 2 blocks"):
        step.fill([SeqChunk([0], 0, 1)] * 5, [1] * 5)
    with pytest.raises(ValueError, match="does not fit a step of 4 x 2 blocks"):
        step.fill([SeqChunk([0, 1, 2], 9, 1)], [1])


def test_shared_prefix_is_computed_once(model, tok):
    rng = random.Random(1)
    system = [rng.randrange(256) for _ in range(40)]  # 10 full blocks of 4
    suffixes = [[rng.randrange(256) for _ in range(rng.randint(1, 9))] for _ in range(12)]
    prompts = [system + s for s in suffixes]
    llm = LLM(model, tok, num_blocks=512, block_size=4)
    outs = llm.generate(prompts, greedy(6), use_tqdm=False)
    st = llm.stats()
    assert st.preemptions == 0
    # the 40 shared tokens once, then only each prompt's own tail
    assert st.prefill_tokens == len(system) + sum(len(s) for s in suffixes)
    assert st.cached_tokens == len(system) * (len(prompts) - 1)
    assert [o.metrics.num_cached_tokens for o in outs] == [0] + [40] * 11
    gen = Generator(model, tok)
    for p, o in zip(prompts, outs):
        assert o.token_ids == gen.generate(p, max_new_tokens=6).token_ids
    assert llm.block_manager.num_free_blocks == 512
    # A later request with the same prefix still finds it (freed blocks keep their contents).
    llm.reset_stats()
    llm.generate([system + [1, 2, 3]], greedy(2), use_tqdm=False)
    assert llm.stats().prefill_tokens == 3


def test_stop_strings_and_streaming_deltas(model, tok, workload, reference):
    prompts, _ = workload
    llm = LLM(model, tok, num_blocks=256, block_size=4)
    # Take a stop string from the middle of what the model really writes.
    i = next(
        k for k, r in enumerate(reference) if len(r.text) >= 12 and "\ufffd" not in r.text[4:7]
    )
    stop = reference[i].text[4:7]
    gen = Generator(model, tok)
    want = gen.generate(prompts[i], max_new_tokens=24, stop=[stop])
    rid = llm.add_request(prompts[i], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]))
    other = llm.add_request(prompts[0], greedy(5))
    pieces, final = [], None
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.request_id == rid:
                pieces.append(out.delta_text)
                assert out.text == "".join(pieces)
                final = out if out.finished else final
                assert stop not in out.text
    assert final is not None and final.finish_reason == "stop"
    assert final.text == want.text and final.token_ids == want.token_ids
    assert other != rid


def test_abort_frees_blocks(model, tok):
    llm = LLM(model, tok, num_blocks=64, block_size=4)
    a = llm.add_request([5] * 30, greedy(20))
    b = llm.add_request([6] * 10, greedy(3))
    llm.step()
    llm.step()
    assert llm.block_manager.num_used_blocks > 0
    assert llm.abort(a) is True
    assert llm.abort(a) is False  # already gone
    while llm.has_unfinished_requests():
        llm.step()
    assert llm.block_manager.num_free_blocks == 64
    assert b != a


def test_bad_requests_are_refused_clearly(model, tok):
    llm = LLM(model, tok, num_blocks=64, block_size=4, max_model_len=100)
    with pytest.raises(ValueError, match="max_tokens is 20, but the prompt .90 tokens. leaves"):
        llm.add_request([1] * 90, greedy(20))
    with pytest.raises(ValueError, match="leaves no room in the model's context of 100"):
        llm.add_request([1] * 100, greedy(1))
    with pytest.raises(ValueError, match="empty"):
        llm.add_request([], greedy(2))
    with pytest.raises(ValueError, match="vocabulary"):
        llm.add_request([1, 999], greedy(2))
    with pytest.raises(TypeError):
        llm.add_request(3.5, greedy(2))
    with pytest.raises(ValueError, match="already in use"):
        llm.add_request([1], greedy(2), request_id="x")
        llm.add_request([1], greedy(2), request_id="x")
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate([[1], [2]], [greedy(1)])


def test_seeded_sampling_does_not_depend_on_the_batch(model, tok, workload):
    prompts, _ = workload
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_tokens=12)
    alone = LLM(model, tok, num_blocks=128, block_size=4).generate([prompts[3]], p, use_tqdm=False)[
        0
    ]
    batch = LLM(model, tok, num_blocks=512, block_size=4).generate(
        prompts[:8],
        [SamplingParams(temperature=1.0, seed=i, max_tokens=12) for i in range(8)][:3]
        + [p]
        + [greedy(12)] * 4,
        use_tqdm=False,
    )
    assert batch[3].token_ids == alone.token_ids


def test_async_streams_cancel_and_queue_full(model, tok, workload, reference):
    prompts, max_tokens = workload

    async def main():
        engine = AsyncLLM(model, tok, max_queue=12, num_blocks=256, block_size=4)
        try:

            async def collect(i):
                text, ids, last = "", [], None
                async for out in engine.stream(prompts[i], greedy(max_tokens[i])):
                    text += out.delta_text
                    ids += out.delta_token_ids
                    last = out
                assert text == last.text and ids == last.token_ids
                return last

            outs = await asyncio.gather(*(collect(i) for i in range(10)))
            for i, o in enumerate(outs):
                assert o.token_ids == reference[i].token_ids and o.finish_reason is not None

            # a client that goes away mid-stream: its request is aborted and its blocks freed
            async def leave_early():
                async with contextlib.aclosing(engine.stream([9] * 40, greedy(200))) as events:
                    async for out in events:
                        if len(out.token_ids) >= 3:
                            break  # leaving the `async with` closes the stream: the request is aborted

            await leave_early()
            streams = [engine.submit([7] * 20, greedy(100)) for _ in range(12)]
            with pytest.raises(QueueFull):
                engine.submit([7] * 20, greedy(100))
            for s in streams:
                s.abort()
            for _ in range(200):
                await asyncio.sleep(0.02)
                if (
                    engine.llm.block_manager.num_free_blocks == 256
                    and not engine.llm.has_unfinished_requests()
                ):
                    break
            assert engine.llm.block_manager.num_free_blocks == 256
            assert engine.num_in_flight == 0
            with pytest.raises(ValueError, match="leaves only 502 of the model's context of 512"):
                engine.submit([1] * 10, greedy(10_000))
        finally:
            engine.shutdown()

    asyncio.run(main())


@pytest.mark.model
def test_smollm2_batched_equals_generator():
    import llmlib
    from llmlib.checkpoints.fetch import fetch_model

    path = fetch_model(quiet=True)
    # float32: equal tokens batched and one at a time (bfloat16 rounds differently per shape)
    llm = LLM(path, dtype="float32", num_blocks=256, max_num_batched_tokens=256)
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time",
        "1, 2, 3, 4,",
        "The quick brown fox",
        "Water boils at",
        "In 1969, the first",
        "My favourite colour is",
    ]
    outs = llm.generate(texts, greedy(16), use_tqdm=False)
    gen = Generator(llm.model, llm.tokenizer)
    for t, o in zip(texts, outs):
        ref = gen.generate(t, max_new_tokens=16)
        assert o.token_ids == ref.token_ids, t
        assert o.text == ref.text
    assert llm.block_manager.num_free_blocks == 256
    assert isinstance(llmlib.LLM, type)


def test_bench_static_baseline_is_honest(model, tok, workload, reference):
    """The static-batching baseline of `llmlib bench batching` computes the same tokens (padding masked)."""
    from llmlib.bench.batching import Request, run_static

    prompts, max_tokens = workload
    reqs = [Request(p, n) for p, n in zip(prompts[:12], max_tokens[:12])]
    res = run_static(model, reqs, batch_size=5)
    # the tiny model has no EOS, so the Generator's tokens are exactly max_tokens long too
    assert res["outputs"] == [r.token_ids for r in reference[:12]]
    assert 0.0 < res["waste"] < 1.0
