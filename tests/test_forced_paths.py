"""Every fast path this machine can execute, forced one choice at a time, against its reference.

A choice that depends on the CPU (which C++ build runs, integer products on or off, the one-row
kernel, oneDNN's float32 copy, bfloat16 layouts, the fused norm, the paged decode kernel) is made
once, in :mod:`llmlib.kernels.flags`. :func:`llmlib.kernels.flags.paths` lists each choice this
machine can run, flipped from its default one at a time; here each is forced in turn and every
format runs under it: the batch-1 generator, the batching engine, and their compiled steps. So a
path another class of CPU takes by default (an AVX2 EPYC runs the ``isa="avx2"`` build, the
integer products by AVX2 and oneDNN's float32 copy) is checked here too.

The model is small and random (weights of a trained model's scale, its LM head scaled up so the
next token wins by a clear margin). Each path's logits must lie within its format's rounding of
the plain path's; float formats must give the plain path's greedy tokens; and under each path the
engine, the compiled generator and the compiled engine must give the eager generator's tokens
(the same kernels, called another way: the AVX2 machine's compiled float32 garbage was that).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_gguf import random_hf_weights, write_gguf

import llmlib
from llmlib.config import ModelConfig
from llmlib.kernels.flags import CLASSES, class_env, flags, forced, paths, read

CFG = ModelConfig(
    name="forced",
    vocab_size=256,
    d_model=128,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=256,
    max_seq_len=256,
    rope_theta=10_000.0,
    norm_eps=1e-6,
    tie_embeddings=False,
    bos_token_id=1,
    eos_token_ids=(2,),
)
#: format -> (dtype, quantization, which file)
FORMATS = {
    "float32": ("float32", None, "f32"),
    "bfloat16": ("bfloat16", None, "f32"),
    "int8": (None, "int8", "f32"),
    "int4": (None, "int4", "f32"),
    "gguf": (None, "gguf", "q4"),
}
PROMPTS = [[5, 9, 11, 3, 7], [40, 41, 42] * 5, [200, 17], [9] * 23]
NEW = 10

#: a child process (below) runs as another class, whose own list differs: it takes its parent's
PATHS = json.loads(os.environ.get("FORCED_PATHS_CHILD") or "null") or paths()


def _name(p: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in p.items()) or "default"


_APART: dict[str, str] = {}  # a build's name -> what its child process printed


def _ran_apart(request, path: dict) -> bool:
    """Another C++ build registers the same operators under the same names, and a process can
    hold only one: a path that changes the build runs in a process of its own, forced there by
    the environment (``Flags.as_env``). One child runs every test of that path (the first of
    them starts it); each test then checks its own line. True where this call ran apart."""
    if "isa" not in path or os.environ.get("FORCED_PATHS_CHILD"):
        return False
    key = _name(path)
    if key not in _APART:
        ids = [
            item.nodeid
            for item in request.session.items
            if item.module is request.module
            and getattr(item, "callspec", None)
            and item.callspec.params.get("path") == path
        ]
        flags_env = dataclasses.replace(flags(), **path).as_env()
        if path["isa"] == "avx2":  # PyTorch, inductor and oneDNN held to AVX2 as well
            flags_env = {**class_env("avx2"), **flags_env}
        env = {**os.environ, **flags_env, "FORCED_PATHS_CHILD": json.dumps(PATHS)}
        cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *ids]
        root = Path(__file__).parents[1]
        run = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True)
        _APART[key] = run.stdout + run.stderr[-2000:]
    out = _APART[key]
    assert f"PASSED {request.node.nodeid}" in out, out[-4000:]
    return True


class Tok:
    """Token i is the byte i."""

    eos_id = bos_id = None
    vocab_size = CFG.vocab_size
    special_tokens: dict = {}

    def id_to_bytes(self, i: int) -> bytes:
        return bytes([i])


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("forced")
    w = {k: v * (0.1 if v.ndim == 2 else 1.0) for k, v in random_hf_weights(CFG, seed=11).items()}
    w["lm_head.weight"] = (w["lm_head.weight"] * 40.0).astype(np.float32)  # peaked: see above
    return {
        "f32": write_gguf(d / "f32.gguf", CFG, w),
        # 4-bit blocks with an 8-bit LM head: one file of mixed types, as Q4_K_M files are
        "q4": write_gguf(d / "q4.gguf", CFG, w, T.Q4_1, types={"output.weight": T.Q8_0}),
    }


def _load(files: dict[str, Path], fmt: str):
    dtype, q, which = FORMATS[fmt]
    return llmlib.load_model(files[which], "cpu", dtype, q)


def _tokens(model) -> list[list[int]]:
    gen = llmlib.Generator(model, Tok())
    return [gen.generate(p, max_new_tokens=NEW, ignore_eos=True).token_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(files) -> dict[str, tuple[list[list[int]], torch.Tensor]]:
    """Each format's greedy tokens and logits on the plainest path (quantized formats compute in
    float32 throughout this file: bfloat16 activations would add rounding that batched and
    one-row products do differently, and hide nothing the checks here look for): PyTorch's own operators
    (no C++ build, weight-only integer kernels with float activations, no oneDNN copies)."""
    out = {}
    plain = dict(isa="none", integer="off", matvec=False, fused_norm=False, paged_kernel=False)
    with forced(**plain, onednn_float32=False, onednn_bfloat16=False, activations="float32"):
        for fmt in FORMATS:
            m = _load(files, fmt)
            out[fmt] = (_tokens(m), m(torch.tensor([PROMPTS[1]])).float())
    return out


#: how far a fast path's logits may be from the plain path's, as a share of the logits' spread
#: (the integer kernels also round the activations to int8, in blocks of 32, as llama.cpp does)
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.05, "int8": 0.15, "int4": 0.15, "gguf": 0.15}
FLOAT = ("float32", "bfloat16")


def _engine_tokens(m, **kw):
    llm = llmlib.LLM(m, Tok(), num_blocks=64, block_size=4, max_num_seqs=4, **kw)
    params = llmlib.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)], llm


def _invariant_logprobs(m, prompts, llm=None) -> list[list[float]]:
    """The batch-invariant engine's greedy logprobs, every prompt prefilled in one step."""
    if llm is None:
        llm = llmlib.LLM(
            m, Tok(), num_blocks=64, block_size=4, max_num_seqs=4, batch_invariant=True
        )
    params = llmlib.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[e.logprob for e in o.outputs[0].logprobs] for o in outs]


#: enough sequences decoding at once to fill a group of generated rows (ROW_TILE, 32) and more
MANY = [[(7 * i + j) % 250 + 3 for j in range(3 + i % 5)] for i in range(40)]


@pytest.mark.parametrize("path", PATHS, ids=_name)
def test_every_format_under_a_forced_path(request, files, reference, path) -> None:
    """Eager, in every format: logits within the format's rounding of the plain path's, a float
    format's greedy tokens equal to the plain path's, and the batching engine's tokens equal to
    the batch-1 generator's under the same path."""
    if _ran_apart(request, path):
        return
    with forced(**path, activations="float32"):
        for fmt in FORMATS:
            m = _load(files, fmt)
            tokens, logits = reference[fmt]
            got = m(torch.tensor([PROMPTS[1]])).float()
            err = (got - logits).abs().max().item() / logits.std().item()
            assert err < TOLERANCE[fmt], (fmt, _name(path), err)
            mine = _tokens(m)
            if fmt in FLOAT:
                assert mine == tokens, (fmt, _name(path), "generator")
            assert _engine_tokens(m)[0] == mine, (fmt, _name(path), "engine")
            if fmt == "float32":  # its row-tiled view shares every matrix, opaque ones too
                got = _engine_tokens(m, batch_invariant=True)[0]
                assert got == mine, (fmt, _name(path), "batch-invariant engine")
            if fmt in FLOAT:  # bitwise: batched, a prompt's rows land anywhere in a tile
                alone = [_invariant_logprobs(m, [p])[0] for p in PROMPTS]
                together = _invariant_logprobs(m, PROMPTS)
                assert together == alone, (fmt, _name(path), "batch-invariant logprobs")


#: the compiled steps, where their code differs from the default's (tests/test_aot.py compiles the
#: default float32 steps): another C++ build (the AVX2 machine's), oneDNN's float32 copy (the
#: AVX2 machine's default, and its compiled float32 garbage), PyTorch's integer kernels, the
#: AVX2 machine's bfloat16 matrices (widened for prompts, plain in the graph)
COMPILED = [
    (fmt, p)
    for p in PATHS
    for fmt in ("float32", "gguf", "bfloat16")
    if (fmt == "float32" and (p.get("isa") == "avx2" or "onednn_float32" in p))
    or (fmt == "gguf" and (not p or p.get("isa") == "avx2" or p == {"integer": "off"}))
    or (fmt == "bfloat16" and (not p or "onednn_bfloat16" in p or "bfloat16_widen" in p))
]


@pytest.fixture(scope="module")
def package_cache() -> Path:
    """Where the compiled packages go: kept between runs (a package is found again by the key
    of its file, which the fixture writes the same each time), so a second run loads them."""
    return flags().cache / "test-forced-paths"


@pytest.mark.parametrize(
    ("fmt", "path"), COMPILED, ids=lambda v: v if isinstance(v, str) else _name(v)
)
def test_compiled_steps_under_a_forced_path(request, files, reference, path, fmt, package_cache):
    """The compiled steps the CLI and the server run by default (from a package on disk), under
    each forced path: the eager steps' greedy tokens, one sequence at a time and batched."""
    if _ran_apart(request, path):
        return
    with forced(cache=package_cache), forced(**path, activations="float32"):
        m = _load(files, fmt)
        tokens = _tokens(m)
        if fmt in FLOAT:
            assert tokens == reference[fmt][0]
        one = llmlib.LLM(m, Tok(), num_blocks=64, block_size=4, max_num_seqs=1, compile=True)
        assert one.runner.decode_path.startswith("compiled"), one.runner.decode_path
        params = llmlib.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
        got = [one.generate([p], params, use_tqdm=False)[0].token_ids for p in PROMPTS]
        assert got == tokens, (fmt, _name(path), "compiled, one sequence (llmlib generate)")
        got, llm = _engine_tokens(m, compile=True)
        # a model from a file: the engine's step is a package on disk, not compiled at each start;
        # except with PyTorch's weight-only int4/int8 kernels, whose packed copies inductor makes
        # while compiling, which a code-only package cannot name (it compiles in memory)
        on_disk = ("compiled (now, cached)", "compiled (from the cache)")
        if path.get("integer") != "off":
            assert llm.runner.decode_path in on_disk, llm.runner.decode_path
            assert one.runner.decode_path in on_disk, one.runner.decode_path
        assert got == tokens, (fmt, _name(path), "compiled engine")
        assert llm.runner.graphs.static_steps > 0
        if fmt in FLOAT:  # bitwise, with every row of a group of generated tokens in use
            kw = dict(num_blocks=512, block_size=4, max_num_seqs=64, batch_invariant=True)
            llm = llmlib.LLM(m, Tok(), compile=True, **kw)
            assert llm.runner.rows is not None, llm.runner.decode_path
            together = _invariant_logprobs(m, MANY, llm)
            alone = [_invariant_logprobs(m, [p], llm)[0] for p in MANY]
            differ = [i for i, (a, b) in enumerate(zip(alone, together)) if a != b]
            assert not differ, (fmt, _name(path), "compiled batch-invariant", differ)


def test_the_paths_cover_every_switch_this_machine_has() -> None:
    """Each choice is flipped in some path, and each lower C++ build is forced, so no fast path
    goes untested on a machine that can run it."""
    f = flags()
    flipped = {k for p in PATHS for k in p}
    assert {"integer", "paged_kernel", "onednn_float32", "onednn_bfloat16"} <= flipped
    assert "bfloat16_widen" in flipped
    if f.isa != "none":
        assert {"isa", "matvec"} <= flipped
    if f.isa == "avx512":
        assert "fused_norm" in flipped
        assert {p.get("isa") for p in PATHS} >= {"avx2", "none"}


def test_a_plain_model_is_the_books_and_computes_the_same(files) -> None:
    """``load_model(..., plain=True)``: every matrix an ``nn.Linear`` weight and the book's
    RMSNorm (what the chapters show), with the prepared model's logits."""
    from llmlib.model.norm import RMSNorm

    plain = llmlib.load_model(files["f32"], "cpu", "float32", plain=True)
    fast = llmlib.load_model(files["f32"], "cpu", "float32")
    assert type(plain.layers[0].attn.wqkv) is torch.nn.Linear
    assert all(type(m) is RMSNorm for n, m in plain.named_modules() if n.endswith("norm"))
    assert isinstance(plain.embed.weight, torch.nn.Parameter)
    ids = torch.tensor([PROMPTS[1]])
    torch.testing.assert_close(plain(ids), fast(ids), rtol=1e-4, atol=1e-4)


def test_the_flags_record_is_read_once(monkeypatch) -> None:
    """The environment is read on the first call only: a switch changed later changes nothing
    (a model's choices cannot move under it), and forced() is the one way to change them."""
    first = flags()
    monkeypatch.setenv("LLMLIB_PAGED_KERNEL", "0" if first.paged_kernel else "1")
    assert flags() is first
    with forced(paged_kernel=not first.paged_kernel) as f:
        assert flags() is f and f.paged_kernel != first.paged_kernel
    assert flags() is first


def test_a_class_of_cpu_is_run_as_its_own_choices() -> None:
    """``LLMLIB_AS_CPU``: llmlib takes the class's choices, and only where the libraries below it
    were held to the same instructions and this CPU can execute them; each refusal names why."""
    env = class_env("avx2")
    own = read(env={})
    if not {"avx2", "fma", "f16c"} <= own.cpu_flags:
        pytest.skip("this CPU cannot run AVX2 code")
    f = read(env=env)
    assert (f.as_cpu, f.vendor, f.isa, f.integer) == ("avx2", "AuthenticAMD", "avx2", "avx2")
    assert f.matvec and f.onednn_float32 and not f.onednn_bfloat16 and not f.fused_norm
    assert f.activations == "float32" and not f.native_bf16 and not f.invariant_compile
    with pytest.raises(ValueError, match="ATEN_CPU_CAPABILITY=avx2"):
        read(env={k: v for k, v in env.items() if k != "ATEN_CPU_CAPABILITY"})
    with pytest.raises(ValueError, match="lacks avx512_bf16"):
        read(
            env=class_env("zen4"), cpu=("GenuineIntel", CLASSES["zen4"].cpu_flags - {"avx512_bf16"})
        )
    zen4 = read(
        env=class_env("zen4"), cpu=("GenuineIntel", CLASSES["zen4"].cpu_flags | {"amx_tile"})
    )
    assert (zen4.isa, zen4.integer, zen4.activations) == ("avx512", "vnni", "bfloat16")
    assert zen4.onednn_bfloat16 and zen4.matvec and "amx_tile" not in zen4.cpu_flags
    assert not zen4.invariant_compile  # no AMX


@pytest.mark.parametrize("name", list(CLASSES))
def test_a_process_run_as_a_class_holds_the_libraries_to_it(name) -> None:
    """In a process started as the class, PyTorch dispatches to its instructions, inductor writes
    code for them (no AMX micro-kernels for a class without AMX) into caches of the class's own
    (one shared with this machine's class gave wrong tokens), and records name the class."""
    try:  # the refusal a process started as the class would meet first
        read(env=class_env(name))
    except ValueError as e:
        pytest.skip(str(e))
    code = (
        "import torch, llmlib.device as d; from llmlib.kernels.flags import flags; "
        "from torch._inductor.cpu_vec_isa import pick_vec_isa; flags(); "
        "from llmlib.runtime.compile import prepare_inductor; prepare_inductor(); "
        "from torch._inductor.runtime.cache_dir_utils import cache_dir; "
        "print(torch.backends.cpu.get_cpu_capability(), '|', pick_vec_isa(), '|', d.cpu_name(), "
        "'|', cache_dir())"
    )
    env = {**os.environ, **class_env(name)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    capability, isa, cpu, cache = (s.strip() for s in out.stdout.split("|"))
    assert Path(cache).name.split("-")[0] == CLASSES[name].env["ATEN_CPU_CAPABILITY"]
    assert capability == CLASSES[name].env["ATEN_CPU_CAPABILITY"].upper()
    assert isa.split()[0] == CLASSES[name].env["ATEN_CPU_CAPABILITY"] and "amx" not in isa
    assert cpu.endswith(f"run as {name}")


def test_inductor_caches_are_kept_apart_by_the_instructions_they_are_written_for(
    tmp_path, monkeypatch
) -> None:
    """inductor's cache keys leave out the vector instructions of its code: a graph cached as
    AVX-512 code and read back for AVX2 gave wrong tokens. Each kind of code gets its own
    folder, inside the one the user chose; asking again changes nothing."""
    from llmlib.runtime.compile import inductor_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert inductor_cache_dir() == str(tmp_path / "avx2")
    assert inductor_cache_dir() == str(tmp_path / "avx2")
    if not {"avx512f", "avx512bw", "avx512vl"} <= flags().cpu_flags:
        return
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")
    assert Path(inductor_cache_dir()).name.startswith("avx512")
