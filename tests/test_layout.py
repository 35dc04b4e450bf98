"""The package's architecture, checked: no import cycles, imports in one direction, small modules,
one shape table, and a built wheel that works outside the source tree."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "llmlib"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports() -> dict[str, set[str]]:
    """module -> the llmlib modules it imports, anywhere in its body (function-level imports too)."""
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against this module's package
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
            for t in targets:
                while t and t not in modules:  # `from llmlib.x import name`: the module is llmlib.x
                    t = t.rpartition(".")[0]
                if t and t.startswith("llmlib") and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                found.append(stack[stack.index(m) :] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    return found


def test_no_import_cycles() -> None:
    graph = _imports()
    # A package __init__ that only re-exports lazily (through llmlib._lazy) imports nothing at load.
    for name in list(graph):
        init = PKG.parent / (name.replace(".", "/") + "/__init__.py")
        if init.is_file() and "lazy_exports" in init.read_text():
            graph[name] = {d for d in graph[name] if d == "llmlib._lazy"}
    assert _cycles(graph) == []


# Layers, bottom to top. A module may import its own layer and those below it, never above.
LAYERS = [
    {  # numbers and names: what a model is, with no torch in sight
        "llmlib._lazy",
        "llmlib.analysis",  # the package's index: a docstring
        "llmlib.config",
        "llmlib.families",
        "llmlib.dtypes",
        "llmlib.shapes",
        "llmlib.show",
        "llmlib.gguf_file",  # the GGUF container: numpy only, read by the tokenizer too
        "llmlib.files",  # the one file hasher
        "llmlib.kernels.flags",  # every switch and CPU capability, read once
        "llmlib.analysis.gpus",
    },
    {  # text, devices, arithmetic, and the pieces a request carries
        "llmlib.device",
        "llmlib.kernels.native",  # builds and loads the C++ kernels (llmlib/kernels/csrc)
        "llmlib.analysis.costs",
        "llmlib.analysis.capacity",
        "llmlib.tokenizer",
        "llmlib.text",
        "llmlib.prompts",
        "llmlib.sampling",
        "llmlib.structured",
        "llmlib.quantize",  # codes: how a float matrix is rounded to integers
    },
    {"llmlib.model"},  # the book's stages, plain PyTorch
    {"llmlib.kernels"},  # the machine's side, swapped into the model at load
    {"llmlib.runtime", "llmlib.analysis.roofline"},  # compiled and graphed steps; measured roofs
    {  # one request, from a file on disk to its tokens
        "llmlib.checkpoints",
        "llmlib.generate",
        "llmlib.perplexity",
        "llmlib.speculative",  # proposers and verification; a draft path loads via checkpoints
    },
    # the engine, the engine split over ranks, and measurements of the engine
    {"llmlib.engine", "llmlib.parallel", "llmlib.analysis.invariance"},
    {"llmlib.serve", "llmlib.bench", "llmlib.cli", "llmlib", "llmlib.__main__"},
]


def _layer(module: str) -> int:
    """The layer of the longest entry of LAYERS that names ``module`` or a package above it."""
    best: tuple[int, int] | None = None
    for i, layer in enumerate(LAYERS):
        for top in layer:
            if module == top or (top != "llmlib" and module.startswith(top + ".")):
                if best is None or len(top) > best[0]:
                    best = (len(top), i)
    if best is None:
        raise AssertionError(f"{module} is in no layer of test_layout.LAYERS: place it")
    return best[1]


def test_imports_run_one_way() -> None:
    """serve -> engine -> model -> config/device: nothing imports a layer above its own (the model
    never imports a checkpoint reader, the engine never imports the server)."""
    bad = []
    for mod, deps in _imports().items():
        if mod == "llmlib":
            continue
        for d in deps:
            if d != "llmlib" and _layer(d) > _layer(mod):
                bad.append(f"{mod} (layer {_layer(mod)}) imports {d} (layer {_layer(d)})")
    assert bad == []


def test_the_model_imports_none_of_the_layers_above_it() -> None:
    """The book's model is plain PyTorch: no kernel, runtime, checkpoint or engine code reaches
    into it; speed is swapped in from outside (llmlib.kernels.prepare)."""
    above = ("kernels", "runtime", "checkpoints", "engine", "parallel", "serve", "bench", "cli")
    bad = [
        f"{mod} imports {d}"
        for mod, deps in _imports().items()
        if mod == "llmlib.model" or mod.startswith("llmlib.model.")
        for d in deps
        if any(d == f"llmlib.{a}" or d.startswith(f"llmlib.{a}.") for a in above)
    ]
    assert bad == []


def test_only_the_flags_record_reads_the_environment() -> None:
    """Every LLMLIB_* switch is read once, in llmlib.kernels.flags; nothing else reads one.
    (torch.distributed's own RANK/WORLD_SIZE protocol in llmlib.parallel, and the variables the
    benchmarks set for their peers, are not switches of llmlib's.)"""
    readers = []
    for p in PKG.rglob("*.py"):
        if p.name == "flags.py" and p.parent.name == "kernels":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value.startswith("LLMLIB_") and not _sets_env(p, node.value):
                    readers.append(f"{p.relative_to(ROOT)}: {node.value}")
    assert readers == []


def test_one_reader_of_the_cpu_and_one_file_hasher() -> None:
    """``/proc/cpuinfo`` is read in llmlib.kernels.flags only (every other module asks its record),
    and a file's SHA-256 is computed in llmlib.files only."""
    cpuinfo, hashers = [], []
    for p in PKG.rglob("*.py"):
        text = p.read_text()
        rel = str(p.relative_to(PKG))
        if "/proc/cpuinfo" in text.replace("``/proc/cpuinfo``", "") and rel != "kernels/flags.py":
            cpuinfo.append(rel)
        if re.search(r"hashlib\.sha256\(\)", text) and rel != "files.py":
            hashers.append(rel)
    assert cpuinfo == [] and hashers == []


def _sets_env(path: Path, name: str) -> bool:
    """The sanctioned uses elsewhere: the parallel driver hands its ranks the variables that make
    them start the way it asks, and the start benchmark gives the `llmlib` it times a cache of its
    own with the compile default a user gets."""
    if path.name == "driver.py":
        return name in ("LLMLIB_TP_LOCAL", "LLMLIB_TP_STARTUP_TIMEOUT")
    return path.name == "starts.py" and name in ("LLMLIB_CACHE", "LLMLIB_COMPILE")


def test_modules_are_small_or_say_why() -> None:
    """No module over about 400 lines unless its docstring says why it is one piece."""
    long = []
    for p in PKG.rglob("*.py"):
        n = len(p.read_text().splitlines())
        doc = ast.get_docstring(ast.parse(p.read_text())) or ""
        if n > 420 and "one module" not in doc:
            long.append(f"{p.relative_to(ROOT)}: {n} lines")
    assert long == []


def test_shape_table_is_the_model_and_the_cost_model() -> None:
    """One shape table: the model built on the meta device has exactly its tensors, and the cost
    model's parameter count is its sum, for every preset (MoE included)."""
    from llmlib.analysis.costs import param_counts
    from llmlib.config import PRESETS
    from llmlib.model import Transformer
    from llmlib.shapes import numel, param_shapes

    for name, cfg in PRESETS.items():
        small = cfg.replace(n_layers=2)  # every layer is alike; two keep the meta build quick
        table = param_shapes(small)
        model = Transformer(small, device="meta")
        state = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        assert state == table, name
        assert param_counts(small).total == sum(numel(s) for s in table.values()), name
        assert sum(p.numel() for p in model.parameters()) == param_counts(small).total, name
        del model


@pytest.mark.slow
def test_built_wheel_works_outside_the_source_tree(tmp_path: Path) -> None:
    """``pip wheel .`` holds everything a user needs: installed into a throwaway environment that
    reuses this environment's dependencies, it imports from site-packages (not from the checkout),
    runs ``llmlib costs`` and generates a few tokens with a tiny random model."""
    # build from a copy, so setuptools' build/ and egg-info never land in the checkout
    src = tmp_path / "src"
    shutil.copytree(PKG, src / "llmlib", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
            str(src),
        ],
        check=True,
        timeout=600,
    )
    (wheel,) = wheels.glob("llmlib-*.whl")
    env_dir = tmp_path / "env"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120
    )
    py = env_dir / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    ours = subprocess.run(
        [sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # the dependencies: this environment's site-packages, appended (its editable llmlib is not,
    # since .pth files inside a directory added this way are not processed)
    Path(site, "deps.pth").write_text(ours + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", site, str(wheel)],
        check=True,
        timeout=300,
    )
    script = textwrap.dedent("""
        import json, subprocess, sys
        import torch, llmlib
        assert "site-packages" in llmlib.__file__, llmlib.__file__
        from llmlib.config import ModelConfig
        from llmlib.model import random_model
        tok = llmlib.train_bpe("the cat sat on the mat. " * 50, vocab_size=300, pattern="gpt4")
        cfg = ModelConfig(name="tiny", vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=4,
                          n_kv_heads=2, ffn_dim=64, max_seq_len=64)
        gen = llmlib.Generator(random_model(cfg, device="cpu"), tok)
        out = gen.generate("the cat", max_new_tokens=5, ignore_eos=True)
        assert len(out.token_ids) == 5, out
        llm = llmlib.LLM(random_model(cfg, device="cpu"), tok, num_blocks=16, block_size=4)
        outs = llm.generate(["the cat", "the mat"], llmlib.SamplingParams(max_tokens=4, temperature=0,
                            ignore_eos=True), use_tqdm=False)
        assert [len(o.token_ids) for o in outs] == [4, 4]
        costs = subprocess.run([sys.executable, "-m", "llmlib", "costs", "--model", "llama-3-70b",
                                "--json"], check=True, capture_output=True, text=True)
        assert json.loads(costs.stdout)["kv_bytes_per_token"] == 327680
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [str(py), "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr


def test_the_map_names_every_module() -> None:
    """llmlib/README.md, the package map: every module of the package in one row (by its path,
    ``kernels/prepare``, or in its package's row, ``tokenizer/`` ... ``merge``), and no row for a
    module that is not there."""
    text = (PKG / "README.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("|")]
    named: set[str] = set()
    first: set[str] = set()  # what the rows' first cells name
    for row in rows:
        cell = row.split("|")[1]
        spans = re.findall(r"`([^`]+)`", cell)
        for span in spans:
            named.add(span.strip("/"))
            first.add(span.strip("/"))
        package = next((s.strip("/") for s in spans if s.endswith("/")), None)
        if package is not None:  # the package's modules, named in the row's description
            for span in re.findall(r"`([a-z_]+)`", row.split("|")[2]):
                named.add(f"{package}/{span}")
    missing = []
    for p in sorted(PKG.rglob("*.py")):
        mod = p.relative_to(PKG).with_suffix("").as_posix()
        if mod.endswith("__init__"):  # a package's index: the package has rows of its own
            package = mod.removesuffix("__init__").strip("/")
            if package and not any(n == package or n.startswith(package + "/") for n in named):
                missing.append(package)
            continue
        if mod not in named:
            missing.append(mod)
    assert missing == []
    stale = sorted(
        n
        for n in first
        if "/" in n or n in {p.stem for p in PKG.glob("*.py")}
        if not (PKG / f"{n}.py").exists() and not (PKG / n).is_dir()
    )
    assert stale == []
