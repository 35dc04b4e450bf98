"""The GPU check: llmlib's GPU tests, then the benchmarks chapter 11 quotes, written as JSON.

Run on a CUDA machine over a copy of the repository, with no network:

    make gpu-wheels                       # here, once: the wheels the GPU image lacks, .gpu-wheels/
    make gpu-check OUT=$OUT               # there, carrying .gpu-wheels: writes $OUT/gpu_check.json
    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu   # CI, on the CPU, in about a minute

The lent machines' image (Python 3.12, torch 2.11 with CUDA 13, triton 3.6, transformers,
httpx) lacks the server's fastapi and pydantic, and gguf: ``make gpu-wheels`` downloads those
eight pure-Python or cp312 wheels (3 MB) and ``make gpu-check`` installs them into a folder of
their own. The budget is 8 minutes on an H100, compiles and captures included; give the command
9 (the machine's 15 minutes then leave room for one retry). Nothing has run on a GPU yet: the
budget is an estimate from the sections' sizes, and the first lent run is its check.

Sections (each writes the JSON file again when it finishes, so a run cut short keeps what it did,
then frees its models, gc.collect and the CUDA cache, before the next sizes its memory):

1. ``tests``: pytest on the test files that hold a ``gpu`` test (test_gpu.py, test_paged_*.py)
   and the CUDA steps' meta-device traces (test_cuda_trace.py): only files that import nothing the
   image lacks.
2. ``copy_bandwidth``: a large device-to-device copy, the practical ceiling for decode.
3. ``smollm2_batch1``: SmolLM2-135M in bfloat16 at batch 1, greedy: llmlib eager, llmlib with CUDA
   graphs, and ``transformers``' ``generate`` on the same GPU with the same weights. The real GGUF
   weights when the file is in the cache, else random weights of the same shape (speed does not
   depend on the values).
4. ``llama8b_batch1``: a Llama-3.1-8B-shaped model with random bfloat16 weights at batch 1: tokens/s
   and model bandwidth utilisation (bytes a decode step must read, from ``llmlib.analysis.roofline``, over the
   measured time) against the measured copy bandwidth and the datasheet. Goal: at least 70%.
4b. ``llama8b_formats``: the same shape in bfloat16, weight-only int8 and int4 (group 32): tokens/s,
   the bytes a step reads as stored, and that traffic against the measured copy bandwidth.
5. ``engine_throughput``: the batching engine on 256 requests, prompt and output lengths uniform in
   100..1024 (EOS ignored), random weights of the chosen shape.
5b. ``paged_kernel``: one layer's decode attention at the engine's setting, the Triton kernel
   reading the pool in place against the gather path (``benchmarks/paged_attention_gpu.py``).
5c. ``serve_sweep``: the 8B shape behind the real server on 127.0.0.1, measured by the book's own
   client at 4 and 16 requests/s and all at once: TTFT, TPOT and ITL percentiles.
6. ``tensor_parallel``: the engine split over ``--tp`` GPUs with NCCL (skipped on a one-GPU
   machine): a checkpoint of ``--tp-layers`` layers of ``--tp-model``'s shape is saved, then run
   at TP = 1 and TP = N: greedy tokens equal in float32, each rank's weights its shard, every KV
   block returned; in bfloat16, tokens/s of both and the share of a step in all-reduce (timed with
   a device sync around each call, so that run is slower), beside ``llmlib.analysis.capacity``'s figure.

``--dry-run`` does all of it on the CPU with tiny shapes (2 layers, 8 requests, short lengths) and
writes the same schema with ``"dry_run": true`` to ``gpu_check.dry_run.json``, so the real results
file is never overwritten by a rehearsal.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import re
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a plain copy of the tree, installed or not

from llmlib.analysis import roofline  # noqa: E402
from llmlib.analysis.roofline import measure_bandwidth  # noqa: E402
from llmlib.config import ModelConfig, get_config  # noqa: E402
from llmlib.device import Timer, choose, machine_info, synchronize  # noqa: E402
from llmlib.sampling import SamplingParams  # noqa: E402

SCHEMA = "llmlib.gpu_check/1"

# The shapes the dry run uses instead of the real ones: same code, seconds on a CPU.
TINY = ModelConfig(
    name="tiny-2layer",
    vocab_size=512,
    d_model=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=128,
    max_seq_len=256,
    tie_embeddings=True,
    eos_token_ids=(2,),
)
TINY_UNTIED = TINY.replace(name="tiny-2layer-untied", tie_embeddings=False)


# ---- models ----------------------------------------------------------------------------------------


def random_model(cfg: ModelConfig, device: Any, dtype: torch.dtype, seed: int = 0):
    from llmlib.model import random_model as build

    return build(cfg, device=device, dtype=dtype, seed=seed)


def to_transformers(model: Any):
    """The same weights in ``transformers``' LlamaForCausalLM (both use the split-half RoPE layout)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = model.config
    if cfg.rope_scaling is not None or cfg.n_experts:
        raise ValueError("to_transformers handles dense models without RoPE scaling")
    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=list(cfg.eos_token_ids) or None,
    )
    names = {
        "embed.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight",
    }
    parts = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn.wq": "self_attn.q_proj",
        "attn.wk": "self_attn.k_proj",
        "attn.wv": "self_attn.v_proj",
        "attn.wo": "self_attn.o_proj",
        "ffn.w_gate": "mlp.gate_proj",
        "ffn.w_up": "mlp.up_proj",
        "ffn.w_down": "mlp.down_proj",
    }
    state = {}
    for k, v in model.state_dict().items():
        m = re.fullmatch(r"layers\.(\d+)\.(.+)\.weight", k)
        if m:
            state[f"model.layers.{m[1]}.{parts[m[2]]}.weight"] = v
        elif k in names:
            state[names[k]] = v
    with torch.device(model.device):  # small models only: built in place, then overwritten
        hf = LlamaForCausalLM(hf_cfg).to(dtype=model.dtype)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (cfg.tie_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(
            f"weight mapping to transformers failed: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    if cfg.tie_embeddings:
        hf.tie_weights()
    return hf.eval()


# ---- batch-1 decode timing ---------------------------------------------------------------------------


def time_llmlib_decode(
    model: Any, prompt: torch.Tensor, new_tokens: int, use_graphs: bool, reps: int
) -> dict:
    """Median prefill time and decode time per token at batch 1, greedy: the product path, the
    batching engine with one sequence (its all-decode steps replayed from CUDA graphs with
    ``use_graphs``). The graphs are captured once, outside the timing; every step's sampled token
    is read on the host, so the step times are the GPU's."""
    from llmlib.engine import LLM

    t = prompt.shape[1]
    blocks = -(-(t + new_tokens) // 16) + 1
    llm = LLM(
        model, None, max_num_seqs=1, num_blocks=blocks, block_size=16, cuda_graphs=use_graphs,
        compile=False, max_model_len=t + new_tokens,
    )  # fmt: skip
    t0 = time.perf_counter()
    captured = llm.capture_graphs(1, t + new_tokens)
    capture_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ids = prompt[0].tolist()
    prefill, decode, tokens = [], [], None
    for r in range(reps + 1):  # the first repetition warms up (allocator, cuBLAS heuristics)
        out = llm.generate([ids], params, use_tqdm=False)[0]
        m = out.metrics
        if r:
            prefill.append(m.time_to_first_token)
            decode.append((m.finished_time - m.first_token_time) / (new_tokens - 1))
        tokens = out.token_ids
    p, d = statistics.median(prefill), statistics.median(decode)
    graphs = llm.runner.graphs
    return {
        "prefill_s": p,
        "decode_s_per_token": d,
        "decode_tok_s": 1 / d,
        "tok_s": new_tokens / (p + d * (new_tokens - 1)),
        "graphs": bool(use_graphs and captured and graphs is not None and graphs.replays > 0),
        "capture_s": capture_s,
        "tokens": tokens,
    }


@torch.inference_mode()
def time_transformers(hf: Any, prompt: torch.Tensor, new_tokens: int, reps: int) -> dict:
    dev = prompt.device
    kw = dict(do_sample=False, attention_mask=torch.ones_like(prompt), pad_token_id=0)

    def run(n: int) -> tuple[float, list[int]]:
        with Timer(dev) as tm:
            out = hf.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kw)
        return tm.seconds, out[0, prompt.shape[1] :].tolist()

    run(new_tokens)  # warm-up
    firsts = [run(1)[0] for _ in range(reps)]
    totals, tokens = [], None
    for _ in range(reps):
        s, tokens = run(new_tokens)
        totals.append(s)
    p, total = statistics.median(firsts), statistics.median(totals)
    d = (total - p) / (new_tokens - 1)
    return {
        "prefill_s": p,
        "decode_s_per_token": d,
        "decode_tok_s": 1 / d,
        "tok_s": new_tokens / total,
        "tokens": tokens,
    }


def _agree(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy runs share (bf16 rounding may split a near-tie later on)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---- the sections --------------------------------------------------------------------------------------


class Check:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.dry = args.dry_run
        self.place = choose(
            "cpu" if self.dry else args.device, "float32" if self.dry else args.dtype
        )
        if not self.dry and not self.place.is_cuda:
            raise SystemExit(
                "gpu_check: no CUDA GPU is visible; use --dry-run to rehearse on the CPU"
            )
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / ("gpu_check.dry_run.json" if self.dry else "gpu_check.json")
        info = machine_info(self.place.device)
        self.report: dict[str, Any] = {
            "schema": SCHEMA,
            "dry_run": self.dry,
            "date": info["date"],
            "machine": info,
            "device": str(self.place.device),
            "dtype": str(self.place.dtype).removeprefix("torch."),
            "sections": {},
        }
        self.t_start = time.perf_counter()

    def save(self) -> None:
        self.report["elapsed_s"] = time.perf_counter() - self.t_start
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.report, indent=2, default=str))
        tmp.replace(self.path)

    def section(self, name: str, fn: Callable[[], dict]) -> None:
        if self.args.only and name not in self.args.only:
            return
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            res = fn()
            res["ok"] = res.get("ok", True)
        except Exception as e:
            traceback.print_exc()
            res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        res["seconds"] = time.perf_counter() - t0
        self.report["sections"][name] = res
        self.save()
        print(
            json.dumps(
                {k: v for k, v in res.items() if k not in ("tokens", "transformers_tokens")},
                default=str,
            )[:600],
            flush=True,
        )
        gc.collect()  # a section's models go before the next one sizes its memory
        if self.place.is_cuda:
            torch.cuda.empty_cache()

    # 1
    def tests(self) -> dict:
        # the files that hold a test marked `gpu`, and the CUDA steps' traces: collecting the
        # whole suite would import what the GPU image lacks (gguf, fastapi) at the top of a file
        files = [
            str(f)
            for f in sorted((ROOT / "tests").glob("test_*.py"))
            if "mark.gpu" in f.read_text() or f.name == "test_cuda_trace.py"
        ]
        # (a rehearsal collects them and runs only the `gpu` ones, all skipped: make test runs
        # the rest already)
        only_gpu = ["-m", "gpu"] if self.dry else []
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *only_gpu, *files]
        proc = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=self.args.tests_timeout
        )
        tail = (proc.stdout + proc.stderr).strip().splitlines()
        summary = next(
            (ln for ln in reversed(tail) if re.search(r"\b(passed|failed|skipped|error)", ln)), ""
        )
        counts = {
            k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)
        }
        return {
            "ok": proc.returncode == 0,
            "command": " ".join(cmd[1:]),
            "returncode": proc.returncode,
            "summary": summary,
            **counts,
            "tail": tail[-15:] if proc.returncode else [],
        }

    # 2
    def bandwidth(self) -> dict:
        nbytes = (64 << 20) if self.dry else (4 << 30)
        bw = statistics.median(
            measure_bandwidth(self.place.device, nbytes=nbytes, reps=5, kind="copy")
        )
        self.copy_bw = bw
        return {"copy_bandwidth_GBps": bw / 1e9, "bytes_copied": nbytes, "counting": "read + write"}

    # 3
    def smollm2(self) -> dict:
        dev, dtype = self.place.device, self.place.dtype
        weights = "random"
        if self.dry:
            cfg = TINY
            model = random_model(cfg, dev, dtype)
        else:
            from llmlib.checkpoints import default_model_path

            gguf = default_model_path()
            if gguf.exists():
                from llmlib.checkpoints import load_model

                model, weights = load_model(gguf, device=dev, dtype=dtype), "gguf Q4_1 dequantized"
            else:
                model = random_model(get_config("smollm2-135m"), dev, dtype)
            cfg = model.config
        p_len, n_new, reps = (
            (8, 16, 2) if self.dry else (self.args.prompt_len, self.args.new_tokens, self.args.reps)
        )
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, cfg.vocab_size, (1, p_len), generator=g).to(dev)
        eager = time_llmlib_decode(model, prompt, n_new, use_graphs=False, reps=reps)
        graphs = time_llmlib_decode(model, prompt, n_new, use_graphs=self.place.is_cuda, reps=reps)
        res: dict[str, Any] = {
            "model": cfg.name,
            "weights": weights,
            "batch": 1,
            "prompt_tokens": p_len,
            "new_tokens": n_new,
            "reps": reps,
            "llmlib_eager": _strip(eager),
            "llmlib_graphs": _strip(graphs),
            "graphs_match_eager": graphs["tokens"] == eager["tokens"],
        }
        try:
            hf = to_transformers(model)
            ref = time_transformers(hf, prompt, n_new, reps)
            res["transformers"] = _strip(ref)
            res["transformers_tokens_agree"] = _agree(ref["tokens"], graphs["tokens"])
            res["speedup_vs_transformers"] = graphs["tok_s"] / ref["tok_s"]
            del hf
        except Exception as e:
            res["transformers"] = {"error": f"{type(e).__name__}: {e}"}
        return res

    # 4
    def llama8b(self) -> dict:
        dev, dtype = self.place.device, self.place.dtype
        if self.dry:
            cfg = TINY_UNTIED.replace(name="tiny-2layer-untied (8B stand-in)")
            p_len, n_new, reps = 8, 16, 2
        else:
            cfg = get_config("llama-3.1-8b")
            p_len, n_new, reps = self.args.prompt_len, self.args.new_tokens, self.args.reps
            cfg = cfg.replace(max_seq_len=max(4096, p_len + n_new))  # RoPE tables for what we use
        model = random_model(cfg, dev, dtype)
        g = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, cfg.vocab_size, (1, p_len), generator=g).to(dev)
        graphs = time_llmlib_decode(model, prompt, n_new, use_graphs=self.place.is_cuda, reps=reps)
        eager = time_llmlib_decode(model, prompt, min(n_new, 64), use_graphs=False, reps=1)
        # the bytes one decode step reads, at the average context of the run
        dt = "bf16" if dtype == torch.bfloat16 else ("f16" if dtype == torch.float16 else "f32")
        ph = roofline.decode(cfg, batch=1, context=p_len + n_new // 2, dtype=dt)
        t = graphs["decode_s_per_token"]
        achieved = ph.bytes / t
        bw = getattr(self, "copy_bw", None) or statistics.median(
            measure_bandwidth(dev, nbytes=(64 << 20) if self.dry else (4 << 30), kind="copy")
        )
        res = {
            "model": cfg.name,
            "weights": "random",
            "batch": 1,
            "prompt_tokens": p_len,
            "new_tokens": n_new,
            "reps": reps,
            "params": sum(p.numel() for p in model.parameters()),
            "bytes_per_decode_step": ph.bytes,
            "llmlib_graphs": _strip(graphs),
            "llmlib_eager": _strip(eager),
            "tok_s": graphs["decode_tok_s"],
            "ms_per_token": 1e3 * t,
            "achieved_GBps": achieved / 1e9,
            "copy_bandwidth_GBps": bw / 1e9,
            "mbu_vs_copy": achieved / bw,
            "goal_mbu_vs_copy": 0.70,
            "goal_met": achieved / bw >= 0.70,
        }
        if self.place.is_cuda:
            from llmlib.analysis.costs import get_gpu

            name = torch.cuda.get_device_name(dev).lower()
            key = "h200" if "h200" in name else ("h100-sxm" if "h100" in name else None)
            if key:
                roof = roofline.Roof.from_gpu(key)
                pred = roofline.predict(ph, roof)
                res.update(
                    {
                        "datasheet_GBps": get_gpu(key).bandwidth / 1e9,
                        "mbu_vs_datasheet": achieved / roof.bandwidth,
                        "roofline_predicted_ms_per_token": 1e3 * pred.time,
                    }
                )
        del model
        return res

    # 4b
    def llama8b_formats(self) -> dict:
        """The same 8B shape at batch 1 in bfloat16, int8 and int4 (weight-only, group 32): decode
        tokens/s and the bytes each step reads as stored, against the measured copy bandwidth."""
        from llmlib.bench.formats import weight_bytes
        from llmlib.kernels.prepare import quantize_model

        dev = self.place.device
        if self.dry:
            cfg = TINY_UNTIED.replace(name="tiny-2layer-untied (8B stand-in)")
            p_len, n_new, reps = 8, 16, 2
        else:
            cfg = get_config("llama-3.1-8b")
            p_len, n_new, reps = self.args.prompt_len, self.args.new_tokens, self.args.reps
            cfg = cfg.replace(max_seq_len=max(4096, p_len + n_new))
        bw = getattr(self, "copy_bw", None) or statistics.median(
            measure_bandwidth(dev, nbytes=(64 << 20) if self.dry else (4 << 30), kind="copy")
        )
        g = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, cfg.vocab_size, (1, p_len), generator=g).to(dev)
        rows: dict[str, dict] = {}
        first_tokens = None
        for fmt in ("bfloat16", "int8", "int4"):
            model = random_model(cfg, dev, torch.bfloat16)
            if fmt != "bfloat16":
                quantize_model(model, fmt, group_size=32)
            if self.place.is_cuda:
                torch.cuda.synchronize()
            r = time_llmlib_decode(model, prompt, n_new, use_graphs=self.place.is_cuda, reps=reps)
            kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * (p_len + n_new // 2) * 2
            nbytes = weight_bytes(model) + kv
            t = r["decode_s_per_token"]
            first_tokens = first_tokens or r["tokens"]
            rows[fmt] = {
                # greedy tokens shared with bfloat16's from the start (random weights make near
                # ties, so a split late in the run is rounding, one early a broken kernel)
                "leading_tokens_as_bfloat16": _agree(first_tokens, r["tokens"]),
                "tok_s": r["decode_tok_s"],
                "ms_per_token": 1e3 * t,
                "bytes_per_decode_step": nbytes,
                "achieved_GBps": nbytes / t / 1e9,
                "mbu_vs_copy": nbytes / t / bw,
                "graphs": r["graphs"],
                "weight_format": getattr(model, "weight_format", fmt),
            }
            del model
            if self.place.is_cuda:
                torch.cuda.empty_cache()
        base = rows["bfloat16"]["tok_s"]
        for r in rows.values():
            r["vs_bfloat16"] = r["tok_s"] / base
        return {
            "model": cfg.name,
            "weights": "random",
            "batch": 1,
            "prompt_tokens": p_len,
            "new_tokens": n_new,
            "copy_bandwidth_GBps": bw / 1e9,
            "formats": rows,
        }

    # 5
    def engine(self) -> dict:
        from llmlib.engine import LLM
        from llmlib.sampling import SamplingParams

        dev, dtype = self.place.device, self.place.dtype
        if self.dry:
            cfg, n, lo, hi, max_seqs = TINY, 8, 4, 16, 8
        else:
            cfg = get_config(self.args.engine_model)
            n, lo, hi, max_seqs = self.args.requests, 100, 1024, self.args.max_num_seqs
            cfg = cfg.replace(
                max_seq_len=max(cfg.max_seq_len if cfg.max_seq_len <= 8192 else 4096, 2 * hi + 16)
            )
        rng = random.Random(0)
        prompts = [
            [rng.randrange(3, cfg.vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(n)
        ]
        outs = [rng.randint(lo, hi) for _ in range(n)]
        model = random_model(cfg, dev, dtype)
        # cuda_graphs=True: decode steps replay CUDA graphs on the GPU; in the dry run the same
        # fixed-shape steps run eagerly on the CPU, so the path is rehearsed either way
        llm = LLM(model, None, max_num_seqs=max_seqs, max_model_len=2 * hi + 16, cuda_graphs=True)
        # warm-up, not timed: capture every decode graph the run can need, then a couple of short
        # requests through the same code path
        synchronize(dev)
        t_cap = time.perf_counter()
        graphs = llm.capture_graphs(max_seqs, 2 * hi + 16)
        synchronize(dev)
        capture_s = time.perf_counter() - t_cap
        llm.generate(
            [prompts[0][:lo], prompts[1][:lo]],
            SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
            use_tqdm=False,
        )
        g = llm.runner.graphs
        replays0, static0 = g.replays, g.static_steps
        llm.reset_stats()
        for p, m in zip(prompts, outs):
            llm.add_request(p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
        deadline = time.perf_counter() + (60 if self.dry else self.args.engine_timeout)
        synchronize(dev)
        t0 = time.perf_counter()
        done, out_tokens, first_token = 0, 0, []
        while llm.has_unfinished_requests() and time.perf_counter() < deadline:
            for o in llm.step():
                out_tokens += len(o.delta_token_ids)
                if o.finished:
                    done += 1
                    if o.metrics.time_to_first_token is not None:
                        first_token.append(o.metrics.time_to_first_token)
        synchronize(dev)
        sec = time.perf_counter() - t0
        st = llm.stats()
        finished_all = done == n
        in_tokens = sum(len(p) for p in prompts)
        return {
            "model": cfg.name,
            "weights": "random",
            "requests": n,
            "prompt_len_range": [lo, hi],
            "output_len_range": [lo, hi],
            "total_prompt_tokens": in_tokens,
            "total_output_tokens_planned": sum(outs),
            "output_tokens": out_tokens,
            "completed_requests": done,
            "finished_all": finished_all,
            "seconds": sec,
            "output_tok_s": out_tokens / sec,
            "requests_s": done / sec,
            "total_tok_s": (out_tokens + (in_tokens if finished_all else 0)) / sec,
            "median_ttft_s": statistics.median(first_token) if first_token else None,
            "max_num_seqs": max_seqs,
            "num_blocks": st.num_blocks,
            "block_size": st.block_size,
            "peak_used_blocks": st.peak_used_blocks,
            "preemptions": st.preemptions,
            "steps": st.steps,
            "kv_waste": st.waste,
            "cuda_graphs": g.enabled,
            "graphs_captured": graphs,
            "graph_capture_s": capture_s,
            "graph_replays": g.replays - replays0,
            "fixed_shape_decode_steps": g.static_steps - static0,
            "ok": finished_all,
        }

    # 5b
    def paged_kernel(self) -> dict:
        """One layer's decode attention at the engine's setting (256 rows of 128 blocks, the 8B
        heads), the Triton kernel reading the pool in place against the gather path it replaces
        (``benchmarks/paged_attention_gpu.py``): time, bytes per second, extra memory, equality."""
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import paged_attention_gpu

        size = dict(rows=8, blocks=4) if self.dry else dict(rows=256, blocks=128)
        args = argparse.Namespace(
            device=str(self.place.device), dtype=str(self.place.dtype).removeprefix("torch."),
            block_size=16, heads=32, kv_heads=8, head_dim=128, window=None,
            repeats=3 if self.dry else 20, **size,
        )  # fmt: skip
        res = paged_attention_gpu.run(args)
        res["ok"] = bool(res["agree"]) and (self.dry or res["served_by_kernel"])
        return res

    # 5c
    def serve_sweep(self) -> dict:
        """The engine behind the real server on 127.0.0.1, measured by the book's own client
        (``llmlib bench serve``) over a sweep of request rates: TTFT, TPOT and ITL percentiles.
        The 8B shape with random weights; the tokenizer a small byte-level BPE trained here on
        the repository's text (the server needs one; the weights are random either way)."""
        from llmlib.bench import serve as bench
        from llmlib.engine import AsyncLLM
        from llmlib.serve import ServerThread, create_app
        from llmlib.tokenizer.train import train_bpe

        text = (ROOT / "data" / "austen.txt").read_text()[:200_000]
        tok = train_bpe(text, 1024, special_tokens=["<|endoftext|>"], progress=False)
        if self.dry:
            cfg, rates, n, out_len, words = TINY, (4.0, math.inf), 8, 8, 32
        else:
            cfg, rates, n, out_len, words = (
                get_config("llama-3.1-8b"),
                (4.0, 16.0, math.inf),
                64,
                64,
                190,
            )
        cfg = cfg.replace(vocab_size=tok.vocab_size, max_seq_len=1024, eos_token_ids=())
        model = random_model(cfg, self.place.device, self.place.dtype)
        engine = AsyncLLM(model, tok, max_num_seqs=64, max_model_len=1024, cuda_graphs=True)
        engine.start()
        try:
            with ServerThread(create_app(engine, "gpu-check")) as server:
                levels = bench.sweep(
                    server.url, rates=rates, num_prompts=n, max_tokens=out_len,
                    prompt_words=words, range_ratio=0.0, warmup=min(16, n), quiet=True,
                )  # fmt: skip
        finally:
            engine.shutdown()
        keep = ("request_rate", "completed", "failed", "output_throughput")
        rows = [{k: v for k, v in m.items() if k in keep or k.endswith("_ms")} for m in levels]
        return {
            "model": cfg.name, "weights": "random", "requests_per_level": n,
            "output_tokens": out_len, "prompt_words": words, "levels": rows,
            "ok": all(m["failed"] == 0 for m in levels),
        }  # fmt: skip

    # 6
    def tensor_parallel(self) -> dict:
        """The engine split over GPUs with NCCL (over CPU processes with gloo in the dry run):
        greedy tokens equal to one GPU's in float32, weights per rank against the shape table,
        and, in bfloat16, tokens/s and the share of each step spent in all-reduce."""
        import tempfile

        from llmlib.analysis.capacity import shard
        from llmlib.checkpoints.save import save_hf_folder
        from llmlib.engine import LLM
        from llmlib.parallel.driver import TPOptions
        from llmlib.sampling import SamplingParams

        n_gpus = 2 if self.dry else torch.cuda.device_count()
        if n_gpus < 2:
            return {"ok": True, "skipped": f"needs 2 or more GPUs; this machine has {n_gpus}"}
        if self.dry:
            cfg, tp, n_req, n_new, fast = TINY_UNTIED, 2, 4, 8, torch.float32
        else:
            cfg = get_config(self.args.tp_model)
            cfg = cfg.replace(n_layers=self.args.tp_layers, max_seq_len=2048)
            tp, n_req, n_new, fast = min(self.args.tp, n_gpus), 32, 64, torch.bfloat16
        rng = random.Random(2)
        prompts = [[rng.randrange(3, cfg.vocab_size) for _ in range(rng.randint(8, 200))]]
        prompts += [[rng.randrange(3, cfg.vocab_size) for _ in range(64)] for _ in range(n_req - 1)]
        greedy = SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)
        dev = "cpu" if self.dry else "cuda"
        res: dict[str, Any] = {"model": cfg.name, "layers": cfg.n_layers, "tp": tp}
        with tempfile.TemporaryDirectory(dir=self.args.tp_tmp) as folder:
            model = random_model(cfg, "cpu" if self.dry else "cuda", fast, seed=3)
            save_hf_folder(model, folder, max_shard_bytes=4 << 30)
            del model
            runs = {}
            for name, n, dtype, timing in (
                ("tp1_fp32", 1, torch.float32, None),
                ("tpN_fp32", tp, torch.float32, None),
                ("tp1_fast", 1, fast, None),
                ("tpN_fast", tp, fast, False),
                ("tpN_fast_timed", tp, fast, True),
            ):
                opts = TPOptions(timing=timing)
                kw = {"tensor_parallel_size": n, "tp_options": opts} if n > 1 else {}
                with LLM(folder, device=dev, dtype=dtype, max_num_seqs=n_req, **kw) as llm:
                    llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)
                    llm.reset_stats()  # every rank's counters too
                    synchronize(torch.device(dev))
                    t0 = time.perf_counter()
                    outs = llm.generate(prompts, greedy, use_tqdm=False)
                    synchronize(torch.device(dev))
                    sec = time.perf_counter() - t0
                    reports = llm.tensor_parallel_report()
                runs[name] = {
                    "tokens": [o.token_ids for o in outs],
                    "seconds": sec,
                    "output_tok_s": n_req * n_new / sec,
                    "ranks": [
                        {
                            "rank": r.rank,
                            "weight_bytes": r.weight_bytes,
                            "shard_bytes": r.shard_bytes,
                            "model_bytes": r.model_bytes,
                            "held_blocks": r.held_blocks,
                            "allreduce_share": r.allreduce_share,
                            "allreduce_calls": r.allreduce_calls,
                        }
                        for r in reports
                    ],
                }
        res["tokens_equal_fp32"] = runs["tpN_fp32"]["tokens"] == runs["tp1_fp32"]["tokens"]
        res["fast_tokens_agree"] = sum(
            _agree(a, b) for a, b in zip(runs["tpN_fast"]["tokens"], runs["tp1_fast"]["tokens"])
        ) / (n_req * n_new)  # bf16: leading tokens shared (rounding may split a near-tie later)
        for name, r in runs.items():
            res[name] = {k: v for k, v in r.items() if k != "tokens"}
        res["speedup_tpN_vs_tp1"] = (
            runs["tpN_fast"]["output_tok_s"] / runs["tp1_fast"]["output_tok_s"]
        )
        ranks = runs["tpN_fp32"]["ranks"]
        res["weights_are_shards"] = all(r["weight_bytes"] == r["shard_bytes"] for r in ranks)
        res["blocks_returned"] = all(r["held_blocks"] == 0 for r in ranks)
        if not self.dry:
            name = torch.cuda.get_device_name(0).lower()
            key = "h200" if "h200" in name else ("h100-sxm" if "h100" in name else None)
            if key:
                s_ = shard(cfg, key, tp, "bf16", context=200, batch=n_req)
                res["capacity_predicted_comm_share"] = s_.comm_share
        res["ok"] = (
            res["tokens_equal_fp32"] and res["weights_are_shards"] and res["blocks_returned"]
        )
        return res

    def run(self) -> int:
        print(
            f"gpu_check: {'DRY RUN on ' if self.dry else ''}{self.report['machine']['device_name']} "
            f"({self.place}); writing {self.path}",
            flush=True,
        )
        if not self.args.skip_tests:
            self.section("tests", self.tests)
        self.section("copy_bandwidth", self.bandwidth)
        self.section("smollm2_batch1", self.smollm2)
        self.section("llama8b_batch1", self.llama8b)
        self.section("llama8b_formats", self.llama8b_formats)
        self.section("engine_throughput", self.engine)
        self.section("paged_kernel", self.paged_kernel)
        self.section("serve_sweep", self.serve_sweep)
        self.section("tensor_parallel", self.tensor_parallel)
        ok = all(s.get("ok") for s in self.report["sections"].values())
        self.report["ok"] = ok
        self.save()
        print(
            f"gpu_check: {'all sections ok' if ok else 'SOME SECTIONS FAILED'} in "
            f"{self.report['elapsed_s']:.1f} s -> {self.path}",
            flush=True,
        )
        return 0 if ok else 1


def _strip(d: dict) -> dict:
    return {k: v for k, v in d.items() if k != "tokens"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", default=str(ROOT / "results" / "gpu"), help="folder for the JSON results"
    )
    ap.add_argument(
        "--dry-run", action="store_true", help="rehearse everything on the CPU with tiny shapes"
    )
    ap.add_argument("--device", default=None, help="default: cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument(
        "--only",
        nargs="*",
        default=None,
        help="run only these sections: tests copy_bandwidth smollm2_batch1 llama8b_batch1 "
        "llama8b_formats engine_throughput paged_kernel serve_sweep tensor_parallel",
    )
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument(
        "--engine-model", default="llama-3.1-8b", help="preset shape for the throughput run"
    )
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument(
        "--engine-timeout",
        type=float,
        default=120.0,
        help="stop the throughput run after this long",
    )
    ap.add_argument("--tests-timeout", type=float, default=300.0)
    ap.add_argument("--tp", type=int, default=2, help="GPUs for the tensor-parallel section")
    ap.add_argument(
        "--tp-model", default="llama-3.1-8b", help="preset shape for the tensor-parallel section"
    )
    ap.add_argument(
        "--tp-layers", type=int, default=8, help="layers of it to keep (the checkpoint is saved)"
    )
    ap.add_argument("--tp-tmp", default=None, help="where to write that checkpoint (default: /tmp)")
    args = ap.parse_args(argv)
    return Check(args).run()


if __name__ == "__main__":
    sys.exit(main())
