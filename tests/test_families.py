"""Every family llmlib reads, against transformers on random weights, through every path.

For each family a random checkpoint is saved by transformers in a shape unlike the real models'
(another GQA ratio, odd widths where the family allows them, several layer types where it has
them: sliding and full, dense and routed). llmlib must load it to the same logits (1e-4, float32),
load the same weights from a sharded save, and generate the same greedy tokens one request at a
time (``Generator``, static cache) as batched (``LLM``: paged cache, chunked prefill, the
fixed-shape steps a CUDA graph replays). Windows are shorter than the prompts, so a cache or an
attention function that ignored one would fail here. The last part: config fields llmlib does not
implement are refused by name, the shape table covers the new tensors, bf16 and fp16 checkpoints
keep their dtype, and Qwen2/Qwen3 GGUF files written with the ``gguf`` package load too.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch

import llmlib
from llmlib.config import ModelConfig
from llmlib.families import FAMILIES, differences
from llmlib.model.kv_cache import KVCache

transformers = pytest.importorskip("transformers")

TOL = 1e-4
T_PROMPT = 40  # longer than every window below

COMMON = dict(
    vocab_size=97,
    max_position_embeddings=256,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)

#: family -> (config class, model class, config fields). Real models' GQA ratios for contrast:
#: Qwen2.5 7, Qwen3 2-8, Mistral 4, Phi-3-mini 1, Gemma 2 2, Gemma 3 1b 4.
CASES: dict[str, tuple[str, str, dict]] = {
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        # ratio 5; the top layer slides (max_window_layers), the bottom one does not
        dict(
            hidden_size=30,
            num_attention_heads=5,
            num_key_value_heads=1,
            intermediate_size=45,
            num_hidden_layers=2,
            use_sliding_window=True,
            sliding_window=9,
            max_window_layers=1,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        # ratio 3, odd d_model, head_dim unrelated to it, tied head
        dict(
            hidden_size=33,
            head_dim=10,
            num_attention_heads=6,
            num_key_value_heads=2,
            intermediate_size=41,
            num_hidden_layers=2,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        # ratio 4; layer 1 dense (mlp_only_layers), 0 and 2 routed; narrow odd experts
        dict(
            hidden_size=32,
            head_dim=8,
            num_attention_heads=4,
            num_key_value_heads=1,
            intermediate_size=30,
            moe_intermediate_size=11,
            num_experts=5,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            num_hidden_layers=3,
            tie_word_embeddings=False,
        ),
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        # ratio 2; the window (16) is shorter than the prompt (40): the silent error
        dict(
            hidden_size=36,
            num_attention_heads=6,
            num_key_value_heads=3,
            intermediate_size=50,
            num_hidden_layers=2,
            sliding_window=16,
            tie_word_embeddings=False,
        ),
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        # ratio 5 (Phi-3-mini has none); fused qkv_proj and gate_up_proj; a window of 12
        dict(
            hidden_size=40,
            num_attention_heads=5,
            num_key_value_heads=1,
            intermediate_size=44,
            num_hidden_layers=2,
            sliding_window=12,
            tie_word_embeddings=False,
        ),
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        # ratio 4, head_dim 12 with a query scale of 20 ** -0.5; caps low enough to bite
        dict(
            hidden_size=32,
            head_dim=12,
            num_attention_heads=4,
            num_key_value_heads=1,
            intermediate_size=47,
            num_hidden_layers=3,
            query_pre_attn_scalar=20,
            sliding_window=8,
            attn_logit_softcapping=1.5,
            final_logit_softcapping=12.0,
            tie_word_embeddings=True,
        ),
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        # ratio 3; two local layers then a global one; global RoPE linearly scaled
        dict(
            hidden_size=30,
            head_dim=10,
            num_attention_heads=6,
            num_key_value_heads=2,
            intermediate_size=39,
            num_hidden_layers=3,
            query_pre_attn_scalar=14,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
            final_logit_softcapping=10.0,
            tie_word_embeddings=True,
        ),
    ),
}


def _perturb(hf: torch.nn.Module) -> None:
    """Random norm gains (HF starts them at 1, Gemma's at 0), biases and routers: otherwise a norm
    applied to the wrong tensor, a bias dropped or a router ignored could go unnoticed."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) - 0.5 + p.mean())  # gains 0.5..1.5
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("mlp.gate.weight"):  # Qwen3-MoE's router starts at zero
                p.copy_(torch.randn(p.shape, generator=g))


def _hf_model(family: str, **over) -> torch.nn.Module:
    cfg_cls, model_cls, fields = CASES[family]
    cfg = getattr(transformers, cfg_cls)(**{**COMMON, **fields, **over})
    if family == "gemma2":
        cfg._attn_implementation = "eager"  # the one that soft-caps scores
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(cfg).eval()
    hf.config._experts_implementation = "eager"  # the grouped-GEMM one wants aligned widths
    _perturb(hf)
    return hf


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, Path]]:
    """Every family's random model, saved once by transformers (one file, and sharded)."""
    out = {}
    for family in CASES:
        hf = _hf_model(family)
        folder = tmp_path_factory.mktemp(family)
        hf.save_pretrained(folder)
        hf.save_pretrained(folder / "sharded", max_shard_size="20KB")
        out[family] = (hf, folder)
    return out


def _ids(B: int = 2, T: int = T_PROMPT) -> torch.Tensor:
    return torch.randint(
        1, COMMON["vocab_size"], (B, T), generator=torch.Generator().manual_seed(2)
    )


def _max_diff(model: torch.nn.Module, hf: torch.nn.Module, ids: torch.Tensor) -> float:
    with torch.no_grad():
        ref = hf(ids).logits
        got = model(ids)
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert ref.std() > 0.1  # not two near-constant outputs
    return (got - ref).abs().max().item()


@pytest.mark.parametrize("family", sorted(CASES))
def test_logits_match_transformers(saved, family: str) -> None:
    hf, folder = saved[family]
    model = llmlib.load_model(folder, device="cpu", dtype=torch.float32)
    assert model.config.family == family
    assert _max_diff(model, hf, _ids()) < TOL
    # every backend: the tiled one skips whole tiles outside a window
    for backend in ("naive", "tiled"):
        model.set_attention_backend(backend)
        assert _max_diff(model, hf, _ids(1)) < TOL, backend


@pytest.mark.parametrize("family", sorted(CASES))
def test_sharded_save_loads_to_the_same_logits(saved, family: str) -> None:
    hf, folder = saved[family]
    shards = folder / "sharded"
    assert (shards / "model.safetensors.index.json").is_file()
    assert len(list(shards.glob("model-*.safetensors"))) > 1
    one = llmlib.load_model(folder, device="cpu")
    many = llmlib.load_model(shards, device="cpu")
    ids = _ids(1)
    with torch.no_grad():
        assert torch.equal(one(ids), many(ids))
    assert _max_diff(many, hf, ids) < TOL


@pytest.mark.parametrize("T,S", [(37, 37), (5, 37), (1, 37), (20, 29)])
@pytest.mark.parametrize("window", [1, 7, 16, 100])
def test_attention_functions_agree_on_windows_caps_and_scales(T: int, S: int, window: int) -> None:
    """The three attention functions with a sliding window, a soft cap and a scale: the tiled one,
    in tiles small enough that whole tiles fall outside the window and are skipped."""
    from llmlib.model.attention import causal_mask, naive_attention, sdpa_attention, tiled_attention

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, n, L, 8, generator=g) for n, L in ((6, T), (2, S), (2, S)))
    opts = dict(window=window, scale=0.3)
    ref = naive_attention(q, k, v, **opts)
    # the window means what HF means: query at position p sees keys p - window + 1 .. p
    p = S - T + torch.arange(T)[:, None]
    j = torch.arange(S)[None, :]
    assert torch.equal(causal_mask(T, S, window=window), (j <= p) & (j > p - window))
    torch.testing.assert_close(sdpa_attention(q, k, v, **opts), ref, atol=1e-5, rtol=0)
    for bq, bk in ((4, 4), (8, 3), (64, 64)):
        got = tiled_attention(q, k, v, block_q=bq, block_k=bk, **opts)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    capped = naive_attention(q, k, v, softcap=0.7, **opts)
    torch.testing.assert_close(sdpa_attention(q, k, v, softcap=0.7, **opts), capped)
    got = tiled_attention(q, k, v, block_q=4, block_k=4, softcap=0.7, **opts)
    torch.testing.assert_close(got, capped, atol=1e-5, rtol=0)
    if window > 1:  # (one key per query: a softmax of one is 1, capped or not)
        assert (capped - ref).abs().max() > 1e-3  # the cap changes the result


def test_windows_matter_here(saved) -> None:
    """The checks above have teeth: the same Mistral model without its window is far off."""
    hf, folder = saved["mistral"]
    model = llmlib.load_model(folder, device="cpu")
    assert [layer.attn.window for layer in model.layers] == [16, 16]
    for layer in model.layers:
        layer.attn.spec = dataclasses.replace(layer.attn.spec, window=None)
    assert _max_diff(model, hf, _ids()) > 1e-2


class IdTokenizer:
    """Token i is the byte i: all the engine and the Generator need to turn tokens into text."""

    eos_id = bos_id = None
    vocab_size = COMMON["vocab_size"]
    special_tokens: dict = {}

    def id_to_bytes(self, i: int) -> bytes:
        return bytes([i])


def _peaked(folder: Path) -> llmlib.Transformer:
    """The saved model with its LM head scaled up, so greedy choices have clear winners: batched
    and one-at-a-time float32 products differ in the last bits, and a near-tie must not flip."""
    from llmlib.checkpoints import build_model, read_checkpoint

    cfg, state, _ = read_checkpoint(folder)
    head = "embed.weight" if cfg.tie_embeddings else "lm_head.weight"
    state[head] = state[head] * 8.0  # before the loader stores it for this machine's kernels
    return build_model(cfg, state, "cpu")


@pytest.mark.parametrize("family", sorted(CASES))
def test_engine_generates_what_the_generator_does(saved, family: str) -> None:
    model, tok = _peaked(saved[family][1]), IdTokenizer()
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 97) for _ in range(rng.randint(1, 30))] for _ in range(10)]
    lengths = [rng.randint(1, 14) for _ in prompts]
    gen = llmlib.Generator(model, tok)
    ref = [gen.generate(p, max_new_tokens=n).token_ids for p, n in zip(prompts, lengths)]
    assert sum(len(p) + n for p, n in zip(prompts, lengths)) > 10 * T_PROMPT // 2
    params = [llmlib.SamplingParams(max_tokens=n, temperature=0.0) for n in lengths]
    for graphs in (False, True):  # True: the fixed-shape decode steps of the CUDA-graph path
        llm = llmlib.LLM(
            model, tok, num_blocks=256, block_size=4, max_num_batched_tokens=24, cuda_graphs=graphs
        )
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outs] == ref, f"cuda_graphs={graphs}"
        if graphs:
            assert llm.runner.graphs is not None and llm.runner.graphs.static_steps > 0


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3_text", "qwen2"])
def test_caches_with_windows_equal_recomputation(saved, family: str) -> None:
    """Prefill then decode through the static cache, the engine's fixed-shape step (every token
    a row, as a CUDA graph or a compiled step runs it) and the paged cache's contract path
    (``update``): the logits of a full forward pass at every position."""
    from llmlib.engine.fixed_step import FixedStep
    from llmlib.engine.paged_cache import PagedKVCache, SeqChunk
    from llmlib.model.attention import KVCacheLike

    model = llmlib.load_model(saved[family][1], device="cpu")
    cfg = model.config
    ids = _ids(1, 30)
    split = 19
    with torch.no_grad():
        full = model(ids)
        static = KVCache.from_config(cfg, max_len=64)
        pool = PagedKVCache(cfg.n_layers, 16, cfg.n_kv_heads, 4, cfg.head_dim)
        fixed_pool = PagedKVCache(cfg.n_layers, 17, cfg.n_kv_heads, 4, cfg.head_dim)
        table = list(range(15, 7, -1))

        def fixed(t0: int, t1: int) -> torch.Tensor:  # block 16: the scratch block
            step = FixedStep(fixed_pool, t1 - t0 + 1, 8, 16)  # and one padding row
            step.fill([SeqChunk(table, t0, t1 - t0)], ids[0, t0:t1].tolist())
            return model(step.ids, step.positions, step)[:, : t1 - t0]

        class UpdateOnly(
            KVCacheLike
        ):  # the paged step without its attend(): the contract's default
            def __init__(self, step):
                self.update = step.update

        outs = {"static": [], "graph": [], "paged": []}
        for t0, t1 in [(0, split)] + [(t, t + 1) for t in range(split, 30)]:
            pos = torch.arange(t0, t1)[None]
            step = pool.step([[SeqChunk(table, t0, t1 - t0)]])
            outs["static"].append(model(ids[:, t0:t1], pos, static))
            outs["graph"].append(fixed(t0, t1))
            outs["paged"].append(model(ids[:, t0:t1], pos, UpdateOnly(step)))
    for name, parts in outs.items():
        torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=0, msg=name)


def test_llm_reads_a_folder_itself(saved) -> None:
    """``LLM(path)``: the engine's own load_model call, prompts as token ids (no tokenizer)."""
    folder = saved["gemma3_text"][1]
    gen = llmlib.Generator(llmlib.load_model(folder), IdTokenizer())
    prompts = [[5, 6, 7] * 4, list(range(1, 30))]
    ref = [gen.generate(p, max_new_tokens=12).token_ids for p in prompts]
    llm = llmlib.LLM(folder, num_blocks=64, block_size=4)
    outs = llm.generate(prompts, llmlib.SamplingParams(max_tokens=12, temperature=0.0))
    assert [o.token_ids for o in outs] == ref


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_attention_bias_on_every_projection(tmp_path: Path, family: str) -> None:
    """attention_bias=true (Llama-style configs, Qwen3): biases on q, k, v and o."""
    hf = _hf_model(family, attention_bias=True)
    if family == "mistral":  # MistralConfig has no such field: write it as a Llama config
        cfg = transformers.LlamaConfig(**{**COMMON, **CASES[family][2], "attention_bias": True})
        cfg.sliding_window = None
        torch.manual_seed(0)
        hf = transformers.LlamaForCausalLM(cfg).eval()
        _perturb(hf)
    hf.save_pretrained(tmp_path)
    model = llmlib.load_model(tmp_path, device="cpu")
    assert model.config.qkv_bias and model.config.out_bias
    assert _max_diff(model, hf, _ids()) < TOL


def test_a_cache_without_windows_is_refused(saved) -> None:
    from llmlib.model.attention import KVCacheLike

    class OldCache(KVCacheLike):
        def update(self, layer, k, v, positions):
            return k, v, None

    model = llmlib.load_model(saved["mistral"][1], device="cpu")
    with pytest.raises(TypeError, match="window"):
        model(_ids(1, 5), cache=OldCache())


# ---- configs --------------------------------------------------------------------------------


def _config_json(saved, family: str) -> dict:
    return json.loads((saved[family][1] / "config.json").read_text())


def test_config_fields_per_family(saved) -> None:
    """What each family sets, read from the config.json transformers wrote."""
    got = {f: differences(llmlib.load_model(saved[f][1]).config) for f in CASES}
    assert got["qwen2"] == {
        "qkv_bias": True,
        "sliding_window": 9,
        "layer_types": ("full_attention", "sliding_attention"),
    }
    assert got["qwen3"] == {"qk_norm": True}
    assert got["qwen3_moe"] == {
        "qk_norm": True,
        "expert_ffn_dim": 11,
        "norm_topk_prob": False,
        "dense_layers": (1,),
        "n_experts": 5,
        "n_experts_per_token": 2,
    }
    assert got["mistral"] == {"sliding_window": 16}
    assert got["phi3"] == {"sliding_window": 12}
    assert set(got["gemma2"]) == set(FAMILIES["gemma2"].fields)
    assert got["gemma2"]["layer_types"][:2] == ("sliding_attention", "full_attention")
    assert got["gemma2"]["attn_scale"] == 20**-0.5
    assert set(got["gemma3_text"]) == set(FAMILIES["gemma3_text"].fields) | {"final_softcap"}
    assert got["gemma3_text"]["rope_local_theta"] == 1e4
    for f, fields in got.items():  # the table in llmlib.families names what each one sets
        assert set(fields) - {"n_experts_per_token", "final_softcap"} <= set(FAMILIES[f].fields) | {
            "layer_types"
        }, f


BAD = {
    "unknown model_type": ({"model_type": "gpt_neox"}, r"model_type 'gpt_neox'.*supports .*qwen3"),
    "multimodal gemma3": ({"model_type": "gemma3"}, r"gemma3_text"),
    "rope_scaling yarn": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
    "rope_parameters dynamic": (
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
        "dynamic",
    ),
    "partial rotary": ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    "activation": ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    "mlp bias": ({"mlp_bias": True}, "mlp_bias"),
    "quantized": ({"quantization_config": {"quant_method": "awq"}}, "quantization_config='awq'"),
    "chunked layers": (
        {
            "model_type": "qwen2",
            "use_sliding_window": True,
            "sliding_window": 4,
            "layer_types": ["chunked_attention", "full_attention"],
        },
        "chunked_attention",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_what_is_not_implemented_fails_by_name(saved, case: str) -> None:
    edit, message = BAD[case]
    d = {**_config_json(saved, "mistral"), **edit}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(d)


def test_gemma_fields_not_implemented_fail(saved) -> None:
    d = _config_json(saved, "gemma3_text")
    for edit, message in (
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"hidden_activation": "gelu"}, "hidden_activation"),
    ):
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_hf_dict({**d, **edit})


def test_hub_style_windows_that_are_off() -> None:
    """Qwen2.5 on the hub: sliding_window is set but use_sliding_window is false; Mistral v0.3:
    sliding_window null. Neither model slides."""
    base = {
        "vocab_size": 50,
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    }
    qwen = {"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 32768}
    c = ModelConfig.from_hf_dict({**base, **qwen, "max_window_layers": 2})
    assert c.qkv_bias and [c.window(i) for i in range(4)] == [None] * 4
    c = ModelConfig.from_hf_dict({**base, "model_type": "mistral", "sliding_window": None})
    assert c.sliding_window is None and not c.tie_embeddings
    c = ModelConfig.from_hf_dict({**base, "model_type": "mistral", "sliding_window": 4096})
    assert [c.window(i) for i in range(4)] == [4096] * 4


def test_hub_style_gemma3_config() -> None:
    """Configs on the hub carry rope_theta, rope_local_base_freq and rope_scaling at top level."""
    d = {
        "model_type": "gemma3_text",
        "vocab_size": 50,
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 7,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 8,
    }
    c = ModelConfig.from_hf_dict(d)
    assert c.rope_theta == 1e6 and c.rope_local_theta == 1e4 and c.tie_embeddings
    assert c.rope_scaling is not None and c.rope_scaling.rope_type == "linear"
    assert [c.window(i) for i in range(7)] == [512] * 5 + [None] + [512]
    assert [c.local_rope(i) for i in range(7)] == [True] * 5 + [False, True]


def test_shape_table_covers_every_family(saved) -> None:
    """The meta-device model of each family has exactly the shape table's tensors, and the cost
    model's parameter count is the table's sum (biases, q/k norms, post-norms, dense layers)."""
    from llmlib.analysis.costs import param_counts
    from llmlib.shapes import numel, param_shapes

    for family, (hf, folder) in saved.items():
        cfg = llmlib.load_model(folder).config
        table = param_shapes(cfg)
        meta = llmlib.Transformer(cfg, device="meta")
        assert {k: tuple(v.shape) for k, v in meta.state_dict().items()} == table, family
        total = sum(numel(s) for s in table.values())
        assert param_counts(cfg).total == total, family
        hf_total = sum(p.numel() for p in hf.parameters())
        assert total == hf_total, family  # tied heads counted once on both sides


# ---- checkpoint forms -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["qwen2", "gemma3_text"])
def test_half_precision_checkpoints_keep_their_dtype(
    tmp_path: Path, dtype: torch.dtype, family: str
) -> None:
    from safetensors.torch import load_file

    hf = _hf_model(family).to(dtype)
    hf.save_pretrained(tmp_path)
    on_disk = load_file(tmp_path / "model.safetensors")
    assert {t.dtype for t in on_disk.values()} == {dtype}
    model = llmlib.load_model(tmp_path, device="cpu", dtype=dtype)
    sd = model.state_dict()
    assert {t.dtype for t in sd.values()} == {dtype}
    for ours, theirs in (
        ("embed.weight", "model.embed_tokens.weight"),
        ("layers.1.attn.wk.weight", "model.layers.1.self_attn.k_proj.weight"),
        ("layers.1.ffn_norm.weight", "model.layers.1.pre_feedforward_layernorm.weight")
        if family == "gemma3_text"
        else ("layers.1.attn.wk.bias", "model.layers.1.self_attn.k_proj.bias"),
    ):
        assert torch.equal(sd[ours], on_disk[theirs]), ours  # the file's own numbers
    wide = llmlib.load_model(tmp_path, device="cpu", dtype=torch.float32)
    assert torch.equal(wide.state_dict()["embed.weight"], sd["embed.weight"].float())
    ids = _ids(1)
    with torch.no_grad():
        ref, got = hf(ids).logits.float(), model(ids).float()
    assert got.dtype == torch.float32 and (got - ref).abs().max() < 0.05 * ref.abs().max()


def _write_gguf(path: Path, arch: str, cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> Path:
    """What llama.cpp's converter writes: GGUF names, and for ``llama`` the rows of W_q and W_k
    permuted for its interleaved RoPE (:func:`~llmlib.checkpoints.gguf.permute_qk`). ``qwen2`` and
    ``qwen3`` rotate split halves in llama.cpp too, so their rows are written as they are."""
    import gguf

    from llmlib.checkpoints.gguf import permute_qk

    names = {
        "attn_norm": "attn_norm",
        "attn.wq": "attn_q",
        "attn.wk": "attn_k",
        "attn.wv": "attn_v",
        "attn.wo": "attn_output",
        "attn.q_norm": "attn_q_norm",
        "attn.k_norm": "attn_k_norm",
        "ffn_norm": "ffn_norm",
        "ffn.w_gate": "ffn_gate",
        "ffn.w_up": "ffn_up",
        "ffn.w_down": "ffn_down",
    }
    top = {"embed": "token_embd", "norm": "output_norm", "lm_head": "output"}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.d_model)
    w.add_feed_forward_length(cfg.ffn_dim)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    for key, t in sd.items():
        stem, kind = key.rsplit(".", 1)
        if stem in top:
            name = f"{top[stem]}.{kind}"
        else:
            _, i, rest = stem.split(".", 2)
            name = f"blk.{i}.{names[rest]}.{kind}"
            if arch == "llama" and rest in ("attn.wq", "attn.wk"):
                t = permute_qk(t, cfg.n_heads if rest == "attn.wq" else cfg.n_kv_heads)
        w.add_tensor(name, t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_gguf_files_load_to_transformers_logits(saved, tmp_path: Path, family: str) -> None:
    """Qwen2 and Qwen3 GGUF files (and, for contrast, a Llama one with its Q/K rows permuted)
    written from random transformers checkpoints load to transformers' logits."""
    from llmlib.checkpoints.hf import read_hf_folder

    if family == "llama":
        fields = {**COMMON, **CASES["mistral"][2], "sliding_window": None}
        torch.manual_seed(0)
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).eval()
        _perturb(hf)
        hf.save_pretrained(folder := tmp_path / "hf")
        hf_full = hf
    else:
        hf, folder = saved[family]
        hf_full = _hf_model(family, use_sliding_window=False)  # GGUF metadata has no window
        hf_full.load_state_dict(hf.state_dict())
    cfg = llmlib.load_model(folder).config.replace(sliding_window=None, layer_types=())
    _, sd = read_hf_folder(folder)
    path = _write_gguf(tmp_path / f"{family}.gguf", family, cfg, sd)
    model = llmlib.load_model(path, device="cpu")
    got = model.config
    assert (got.family, got.qkv_bias, got.qk_norm) == (family, family == "qwen2", family == "qwen3")
    assert got.head_dim == cfg.head_dim and got.tie_embeddings == cfg.tie_embeddings
    assert _max_diff(model, hf_full, _ids()) < TOL


@pytest.mark.parametrize("family", sorted(CASES))
def test_every_family_runs_weight_only_int8(saved, family: str) -> None:
    """Issue 13's formats on issue 19's families: int8 weights (bfloat16 activations) on odd
    widths, biases, fused checkpoints and a quantized MoE router, close to transformers' float32;
    int4 either runs or is refused naming a tensor (these widths are not multiples of 32)."""
    hf, folder = saved[family]
    ids = _ids(1)
    model = llmlib.load_model(folder, device="cpu", dtype=torch.bfloat16, quantization="int8")
    assert "int8" in model.weight_format
    with torch.no_grad():
        ref, got = hf(ids).logits, model(ids).float()
    assert ((got - ref).norm() / ref.norm()).item() < 0.06
    try:
        llmlib.load_model(folder, device="cpu", dtype=torch.bfloat16, quantization="int4")
    except ValueError as e:
        assert "weight" in str(e) and family in str(e)


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe", "gemma3_text"])
def test_families_split_over_two_ranks(tmp_path: Path, family: str) -> None:
    """Issue 14's tensor parallelism on issue 19's families (Q/K/V biases, routed experts,
    per-head norms with local/global layers): TP = 2 gives TP = 1's greedy tokens in float32.
    Widths are overridden so heads, KV heads and FFNs divide by two."""
    over = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        head_dim=8,
    )
    if family == "qwen3_moe":
        over["moe_intermediate_size"] = 24
    _hf_model(family, **over).save_pretrained(tmp_path)
    params = llmlib.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [3, 4]]
    kw = dict(dtype="float32", num_blocks=32, block_size=4)
    one = [
        o.token_ids for o in llmlib.LLM(tmp_path, **kw).generate(prompts, params, use_tqdm=False)
    ]
    with llmlib.LLM(tmp_path, tensor_parallel_size=2, **kw) as two:
        got = [o.token_ids for o in two.generate(prompts, params, use_tqdm=False)]
    assert got == one
