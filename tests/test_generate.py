"""The generate loop: token-for-token equal to transformers' greedy generate, stops, streaming, errors."""

from __future__ import annotations

import tempfile

import pytest
import torch
from torch import nn

import llmlib
from llmlib.config import ModelConfig
from llmlib.generate import Generator
from llmlib.prompts import render_chat

# ---- doubles: a byte tokenizer and a model that follows a script -----------------------------


class ByteTokenizer:
    """Token i < 256 is the byte i; 256 is the end-of-sequence token. Enough for the generator."""

    eos_id = 256
    bos_id = None
    vocab_size = 257
    chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )

    def encode(self, text, allowed_special=()):
        return list(text.encode("utf-8"))

    def id_to_bytes(self, i):
        return b"<eos>" if i == 256 else bytes([i % 256])

    def decode(self, ids):
        return b"".join(self.id_to_bytes(i) for i in ids).decode("utf-8", errors="replace")


class ScriptedModel(nn.Module):
    """Whatever the prompt, answers ``script`` one token per call (a prefill, T > 1, starts over)."""

    def __init__(self, script: list[int], max_seq_len: int = 256):
        super().__init__()
        self.config = ModelConfig(
            name="scripted",
            vocab_size=257,
            d_model=4,
            n_layers=1,
            n_heads=1,
            n_kv_heads=1,
            ffn_dim=4,
            max_seq_len=max_seq_len,
            eos_token_ids=(256,),
        )
        self.script, self.i = script, 0
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, ids, positions=None, cache=None, last_only=False):
        if ids.shape[1] > 1:
            self.i = 0
        logits = torch.zeros(ids.shape[0], 1 if last_only else ids.shape[1], 257)
        logits[:, -1, self.script[min(self.i, len(self.script) - 1)]] = 10.0
        self.i += 1
        return logits


class ScriptedEngineModel(ScriptedModel):
    """The scripted model as the batching engine calls it (``hidden`` then ``logits``), for the
    commands, which run the engine: one sequence at a time, it answers the script in order and
    keeps the last prompt it was given (``prompts``)."""

    weight_format = "scripted"
    dtype = torch.float32

    def __init__(self, script: list[int], max_seq_len: int = 256):
        super().__init__(script, max_seq_len)
        self.prompts: list[list[int]] = []

    def hidden(self, ids, positions=None, cache=None):
        if ids.shape[1] > 1 or not self.prompts:
            self.i = 0
            self.prompts.append(ids[0].tolist())
        return torch.zeros(ids.shape[0], ids.shape[1], 4)

    def logits(self, h):
        out = torch.zeros(*h.shape[:-1], 257)
        out[..., self.script[min(self.i, len(self.script) - 1)]] = 10.0
        self.i += 1
        return out


def scripted_engine(monkeypatch, text: str, eos: bool = False, **kw) -> ScriptedEngineModel:
    """The commands' engine loads the scripted model (and the byte tokenizer) whatever the path."""
    import llmlib.engine.llm

    model = ScriptedEngineModel(list(text.encode("utf-8")) + ([256] if eos else [46] * 4), **kw)
    monkeypatch.setattr(
        llmlib.engine.llm, "load_engine_model", lambda *a, **k: (model, ByteTokenizer())
    )
    monkeypatch.setattr("llmlib.checkpoints.resolve_model_path", lambda p: "scripted.gguf")
    return model


def scripted(text: str, prompt: str = "Q:", eos: bool = False, **kw) -> tuple[Generator, str]:
    script = list(text.encode("utf-8")) + ([256] if eos else [ord(".")] * 4)
    return Generator(ScriptedModel(script, **kw), ByteTokenizer()), prompt


# ---- streaming, stops, finish reasons --------------------------------------------------------

TEXT = "héllo, wörld 😀 — 日本語!"


def test_stream_reassembles_text_without_splitting_characters():
    gen, prompt = scripted(TEXT, eos=True)
    pieces = list(gen.stream(prompt, max_new_tokens=100))
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in p for p in pieces)  # no half characters
    assert "😀" in pieces  # the 4-byte emoji arrives as one piece, after its last byte
    assert len(pieces) == len(TEXT)  # one piece per character (each byte is a token here)
    out = gen.generate(prompt, max_new_tokens=100)
    assert out.text == TEXT and out.finish_reason == "stop"
    assert out.token_ids[-1] == 256 and len(out.token_ids) == len(TEXT.encode()) + 1


def test_length_finish_and_timing():
    gen, prompt = scripted(TEXT)
    out = gen.generate(prompt, max_new_tokens=5)
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.text == "héll"  # 5 bytes: é is two of them
    assert out.timing.prefill_s > 0 and len(out.timing.step_s) == 4 and out.timing.tokens_per_s > 0
    assert out.token_texts[:2] == ["h", "\ufffd"]  # the first byte of é alone is not a character


def test_partial_character_at_the_end_is_replaced():
    gen, prompt = scripted("a😀")
    out = gen.generate(prompt, max_new_tokens=3)  # 'a' and two of the emoji's four bytes
    assert out.text == "a\ufffd" and "".join(gen.stream(prompt, max_new_tokens=3)) == out.text


@pytest.mark.parametrize(
    "stop, expected", [("STOP", "abc "), (["xyz", "P d"], "abc STO"), ("\n\n", "one\ntwo")]
)
def test_stop_strings(stop, expected):
    text = {"STOP": "abc STOP def", "\n\n": "one\ntwo\n\nthree"}.get(
        stop if isinstance(stop, str) else "STOP"
    )
    gen, prompt = scripted(text)
    out = gen.generate(prompt, max_new_tokens=50, stop=stop)
    assert out.text == expected and out.finish_reason == "stop"
    pieces = list(gen.stream(prompt, max_new_tokens=50, stop=stop))
    assert "".join(pieces) == expected
    # the first newline is held back until we know it does not start the stop string
    if stop == "\n\n":
        assert "".join(pieces[:-1]) + pieces[-1] == expected and not any(
            p.endswith("\n") for p in pieces
        )


def test_ignore_eos_and_eos_from_config():
    gen, prompt = scripted("hi", eos=True)
    out = gen.generate(prompt, max_new_tokens=6, ignore_eos=True)
    assert out.finish_reason == "length" and len(out.token_ids) == 6 and 256 in out.token_ids


def test_context_limits():
    """The engine's own check (llmlib.engine.stopping.check_length): a request must fit."""
    gen, _ = scripted("abc", max_seq_len=16)
    with pytest.raises(ValueError, match="the prompt is 16 tokens, which leaves no room"):
        gen.generate("x" * 16)
    with pytest.raises(
        ValueError, match="max_tokens is 50, but the prompt .12 tokens. leaves only 4"
    ):
        gen.generate("x" * 12, max_new_tokens=50)
    out = gen.generate("x" * 12, max_new_tokens=4)  # room for 4 new tokens
    assert out.finish_reason == "length" and len(out.token_ids) == 4


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=2.5), "max_new_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_k=0), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(min_p=2.0), "min_p"),
        (dict(seed=-5), "seed"),
        (dict(stop=[""]), "stop"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
    ],
)
def test_invalid_arguments(kwargs, match):
    gen, prompt = scripted("abc")
    with pytest.raises(ValueError, match=match):
        gen.generate(prompt, **kwargs)
    with pytest.raises(ValueError, match=match):
        list(gen.stream(prompt, **kwargs))


def test_empty_prompt_and_bad_prompt_type():
    gen, _ = scripted("abc")
    with pytest.raises(ValueError, match="empty"):
        gen.generate("")
    with pytest.raises(TypeError, match="prompt"):
        gen.generate(3.5)
    with pytest.raises(ValueError, match="token ids"):
        gen.generate([5, 300])


def test_chat_uses_the_template():
    gen, _ = scripted("ok", eos=True)
    out = gen.generate("hello", chat=True)
    assert out.prompt == "<user>hello\n<assistant>" and out.text == "ok"
    gen.tokenizer.chat_template = None
    try:
        with pytest.raises(ValueError, match="chat template"):
            gen.generate("hello", chat=True)
    finally:
        del gen.tokenizer.chat_template  # back to the class attribute


def test_render_chat_matches_hugging_face():
    tr = pytest.importorskip("transformers.utils.chat_template_utils")
    template = (
        "{{ bos_token }}\n{% for m in messages %}\n"
        "    {% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}\n"
        "    {{ '<|' + m['role'] + '|>\\n' + m['content'] | trim }}\n"
        "    {% if loop.last and m['role'] == 'user' %}{% break %}{% endif %}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}{{ '<|assistant|>' }}{{ {'k': 'é'} | tojson }}{% endif %}"
    )
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Hi! "}]
    for agp in (True, False):
        ref = tr.render_jinja_template(
            conversations=[msgs], chat_template=template, add_generation_prompt=agp, bos_token="<s>"
        )[0][0]
        assert render_chat(template, msgs, add_generation_prompt=agp, bos_token="<s>") == ref
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role"):
        render_chat(template, [{"role": "robot", "content": "x"}])
    # the sandbox: templates cannot reach Python internals
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat("{{ messages.__class__.__mro__ }}", msgs)
    with pytest.raises(ValueError, match="role"):
        render_chat(template, [{"content": "no role"}])


def test_chat_repl_keeps_the_conversation(monkeypatch):
    import io

    from llmlib.cli.chat import repl
    from llmlib.engine import LLM

    model = scripted_engine(monkeypatch, "fine", eos=True)
    llm = LLM("scripted.gguf", compile=False, max_num_seqs=1)
    lines = iter(["hello", "", "/reset", "how are you?", "and you?"])

    def read(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    out = io.StringIO()
    history = repl(llm, read=read, out=out, system="Be nice.")
    assert [m["role"] for m in history] == ["system", "user", "assistant", "user", "assistant"]
    assert history[1]["content"] == "how are you?" and history[2]["content"] == "fine"
    # the second turn's prompt held the whole conversation, rendered by the template; what it
    # shares with the first turn came from the engine's prefix cache, the rest was prefilled
    whole = "<system>Be nice.\n<user>how are you?\n<assistant>fine\n<user>and you?\n<assistant>"
    seen = ByteTokenizer().decode(model.prompts[-1])
    assert whole.endswith(seen) and len(seen) < len(whole) and llm.stats().cached_tokens > 0
    assert out.getvalue().count("fine\n") == 3 and "cleared" in out.getvalue()


def test_chat_command_speculates_and_says_what_it_loaded(smollm2_path, monkeypatch, capsys):
    """``llmlib chat --speculative``: the flags reach the engine; a bad spec is a clear error."""
    import io

    from llmlib.cli.chat import main

    monkeypatch.setattr("sys.stdin", io.StringIO("Name a colour.\n/exit\n"))
    args = ["--model", str(smollm2_path), "--dtype", "float32", "--max-new-tokens", "6"]
    assert main([*args, "--speculative", "ngram:3"]) == 0
    out = capsys.readouterr()
    assert "(weights float32" in out.err and "steps eager" in out.err and ">>> " in out.out
    assert main([*args, "--speculative", "ngram:x"]) == 2
    assert "llmlib chat: error:" in capsys.readouterr().err


def test_chat_drops_old_turns_when_the_context_is_full(monkeypatch):
    import io

    from llmlib.cli.chat import chat_turn
    from llmlib.engine import LLM

    model = scripted_engine(monkeypatch, "ok", eos=True, max_seq_len=64)
    llm = LLM("scripted.gguf", compile=False, max_num_seqs=1)
    history = []
    params = llmlib.SamplingParams(max_tokens=4, temperature=0.0)
    for _ in range(6):
        chat_turn(llm, history, "x" * 12, out=io.StringIO(), params=params)
    assert len(model.prompts[-1]) < 64 and len(history) < 12 and history[-1]["content"] == "ok"


@pytest.mark.parametrize(
    "extra",
    [[], ["--no-stream"], ["--no-chat"], ["--chat", "--temperature", "0.7", "--top-p", "0.9"]],
)
def test_cli(monkeypatch, capsys, extra):
    """``llmlib generate`` runs the batching engine with one sequence, and says what ran."""
    import llmlib.cli.generate as G

    model = scripted_engine(monkeypatch, "Hi 😀", eos=True)
    assert G.main(["hello", "--max-new-tokens", "20", "--no-compile", *extra]) == 0
    out = capsys.readouterr()
    assert out.out == "Hi 😀\n" and "finish=stop" in out.err
    assert "engine: cpu" in out.err and "up to 1 sequences" in out.err
    chat = "--no-chat" not in extra  # the default is the chat template when the tokenizer has one
    seen = ByteTokenizer().decode(model.prompts[-1])
    assert seen == ("<user>hello\n<assistant>" if chat else "hello")


@pytest.mark.parametrize(
    "bad", [["--temperature", "-1"], ["--top-p", "0"], ["--max-new-tokens", "0"], ["--top-k", "0"]]
)
def test_cli_rejects_bad_parameters(monkeypatch, capsys, bad):
    import llmlib.cli.generate as G
    import llmlib.engine.llm

    monkeypatch.setattr(
        llmlib.engine.llm,
        "load_engine_model",
        lambda *a, **k: pytest.fail("must fail before loading the model"),
    )
    assert G.main(["hello", *bad]) == 2
    assert "error" in capsys.readouterr().err


# ---- against transformers on random-weight Llama models ---------------------------------------


def _hf_llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10_000.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    cfg.update(overrides)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    # larger weights than the default init, so the greedy path is not a trivial loop
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    return model


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # grouped-query attention, untied head
        # multi-head, tied
        dict(num_key_value_heads=8, tie_word_embeddings=True, rope_theta=500_000.0),
    ],
)
def test_greedy_matches_transformers_on_random_llama(overrides):
    pytest.importorskip("transformers")
    hf = _hf_llama(**overrides)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = llmlib.load_model(d, device="cpu", dtype=torch.float32)
    gen = Generator(ours, ByteTokenizer())
    g = torch.Generator().manual_seed(5)
    distinct = set()
    for n in (1, 23):
        prompt = torch.randint(0, 320, (n,), generator=g).tolist()
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False)[
                0, n:
            ].tolist()
        out = gen.generate(prompt, max_new_tokens=64, ignore_eos=True)
        assert out.token_ids == ref
        distinct |= set(ref)
    assert len(distinct) > 3  # real continuations, not one token repeated


def test_seed_reproduces_sampling_on_random_llama():
    pytest.importorskip("transformers")
    hf = _hf_llama()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        gen = Generator(llmlib.load_model(d, device="cpu"), ByteTokenizer())
    kw = dict(max_new_tokens=24, temperature=1.2, top_p=0.95, ignore_eos=True)
    a = gen.generate([1, 2, 3], seed=11, **kw).token_ids
    assert gen.generate([1, 2, 3], seed=11, **kw).token_ids == a
    assert gen.generate([1, 2, 3], seed=12, **kw).token_ids != a
    assert gen.generate([1, 2, 3], **{**kw, "temperature": 0.0}).token_ids != a  # it really sampled


# ---- the real model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    from llmlib.checkpoints.fetch import resolve_model_path

    path = resolve_model_path(None)
    return path, Generator(
        llmlib.load_model(path, device="cpu", dtype=torch.float32), llmlib.load_tokenizer(path)
    )


@pytest.mark.model
def test_smollm2_greedy_matches_transformers(smollm2, hf_smollm2):
    path, gen = smollm2
    hf = hf_smollm2
    for chat in (False, True):
        out = gen.generate("What is a quadratic equation?", max_new_tokens=64, chat=chat)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([out.prompt_ids]), max_new_tokens=64, do_sample=False)
        assert out.token_ids == ref[0, len(out.prompt_ids) :].tolist()
    assert "quadratic" in out.text.lower()


@pytest.mark.model
def test_smollm2_chat_template_matches_hugging_face(smollm2):
    tr = pytest.importorskip("transformers.utils.chat_template_utils")
    _, gen = smollm2
    msgs = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
    ]
    ref = tr.render_jinja_template(
        conversations=[msgs], chat_template=gen.tokenizer.chat_template, add_generation_prompt=True
    )[0][0]
    assert gen.chat_prompt(msgs) == ref
    assert ref.endswith("<|im_start|>assistant\n")


@pytest.mark.model
def test_smollm2_stream_equals_generate(smollm2):
    _, gen = smollm2
    kw = dict(max_new_tokens=24, temperature=0.9, seed=3, chat=True)
    text = gen.generate("Write a word in Japanese, then an emoji.", **kw).text
    assert "".join(gen.stream("Write a word in Japanese, then an emoji.", **kw)) == text


def test_decode_layout_keeps_values_and_outputs():
    """A built model is stored for this machine when a Generator first runs it (the decode
    layout: one buffer, each matrix in the layout its one-row product streams fastest): the
    same names, values and tokens; ``decode_layout=False`` leaves it alone."""
    from llmlib.kernels.layout import matvec_layout_is_column_major
    from llmlib.kernels.matvec import available
    from llmlib.kernels.prepare import weight_matrices
    from llmlib.model import random_model

    cfg = ModelConfig(
        name="t",
        vocab_size=300,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=64,
        max_seq_len=64,
    )
    model = random_model(cfg, device="cpu", dtype=torch.float32, seed=0, std=0.3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ref = Generator(model, ByteTokenizer(), decode_layout=False).generate(
        [1, 2, 3], max_new_tokens=16, ignore_eos=True
    )
    # decode_layout=False leaves the model alone
    assert not hasattr(model, "weight_format")
    assert all(p.is_contiguous() for p in model.parameters())
    out = Generator(model, ByteTokenizer()).generate([1, 2, 3], max_new_tokens=16, ignore_eos=True)
    after = model.state_dict()
    assert sorted(after) == sorted(before)
    assert all(torch.equal(before[k], after[k]) for k in before)  # same names, shapes and values
    mats = [m.weight.w for m in weight_matrices(model).values()]
    column = [matvec_layout_is_column_major(w.shape, available()) for w in mats]
    assert [w.stride() == (1, w.shape[0]) for w in mats] == column
    assert len({w.untyped_storage().data_ptr() for w in mats}) == 1  # one buffer
    assert out.token_ids == ref.token_ids
