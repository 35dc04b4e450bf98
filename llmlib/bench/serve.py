"""``llmlib bench serve``: measure a server the way serving systems are measured.

A streaming client (httpx, asyncio) sends completion requests to an OpenAI-compatible server,
arriving at a sweep of request rates (``--rates 1,2,4,8,inf``: a Poisson process, or gamma with
``--burstiness``; ``inf`` sends everything at once), or with a fixed number in flight
(``--concurrency``), and times every server-sent event. The workload is stated in
:mod:`llmlib.bench.serve_client` (``--input-len``, ``--output-len``, ``--range-ratio``).

The definitions are those of vLLM's ``benchmark_serving`` (Kwon et al., 2023, the vLLM paper):

* TTFT, time to first token: from sending the request to receiving the first piece of text.
* TPOT, time per output token: ``(latency - TTFT) / (output_tokens - 1)`` per request (requests
  with one output token have none); it excludes the first token, which pays for the prefill.
* ITL, inter-token latency: every gap between two consecutive streamed pieces, pooled over all
  requests. TPOT is a per-request average; ITL shows the stalls (a decode step that waited behind
  another request's prefill shows up in ITL's p99).
* E2EL, end-to-end latency: from sending to the last byte.
* Request throughput: completed requests / wall time of the run; output token throughput: output
  tokens / wall time; total token throughput also counts the prompt tokens; goodput: requests per
  second that met the SLO (``--slo-ttft-ms``, ``--slo-tpot-ms``).

Each is reported at p50, p90 and p99 per rate; ``--plot`` draws the latency-throughput curve.
``--compare-chunked-prefill`` runs the sweep twice, against servers with chunked prefill on and
off, with a long prompt every ``--long-every`` requests, and reports the other requests' ITL p99.

By default it starts its own server (``llmlib serve`` in a subprocess on 127.0.0.1, a free port) and
stops it at the end; ``--target URL`` measures any OpenAI-compatible server that is already running
(vLLM's, llama.cpp's), so the same command compares them side by side. ``--short`` is a quick mode
for CI (a dozen requests per rate, short lengths).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from llmlib.bench.serve_client import Req, knee, make_prompts, make_requests, plot, run_level

# ---- the server under test -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``llmlib serve`` in a subprocess on 127.0.0.1 and a free port (its own interpreter: no GIL shared
    with the client)."""

    def __init__(
        self,
        model: str | None = None,
        device: str | None = None,
        dtype: str | None = None,
        max_queue: int = 512,
        extra: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ):
        self.port = free_port()
        # variables set for the server over this process's own (a cache folder, a CPU class)
        self.env = {**os.environ, **env} if env else None
        cmd = [
            sys.executable,
            "-m",
            "llmlib.cli",
            "serve",
            "--port",
            str(self.port),
            "--max-queue",
            str(max_queue),
            "--log-level",
            "warning",
            *extra,
        ]
        for flag, v in (("--model", model), ("--device", device), ("--dtype", dtype)):
            if v:
                cmd += [flag, str(v)]
        self.cmd = cmd
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> ServerProcess:
        self.proc = subprocess.Popen(
            self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env
        )
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                out = self.proc.stdout.read() if self.proc.stdout else ""
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{out[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError("the server did not come up in time")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def served_model(url: str) -> str:
    r = httpx.get(url.rstrip("/") + "/v1/models", timeout=10)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def _run(coro: Any) -> Any:
    """``asyncio.run``, also from inside a running event loop (a notebook): then in a helper thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=target, name="bench-serve-client")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def sweep(
    url: str,
    concurrencies: Sequence[int] = (),
    rates: Sequence[float] = (1.0, 2.0, 4.0, 8.0, math.inf),
    num_prompts: int | None = 200,
    max_tokens: int = 32,
    prompt_words: int = 64,
    seed: int = 0,
    quiet: bool = False,
    range_ratio: float = 0.5,
    burstiness: float = 1.0,
    long_every: int = 0,
    long_words: int = 1200,
    slo: tuple[float, float] = (2000.0, 300.0),
    label: str = "",
    warmup: int = 0,
) -> list[dict[str, Any]]:
    """Run every level against ``url`` (after a warm-up request, and ``warmup`` requests of the
    workload's own shape sent at once: first calls of every step shape paid before timing) and
    return their metrics."""
    model = served_model(url)
    warm = [Req(p, 4) for p in make_prompts(2, 8, seed)]
    _run(run_level(url, model, warm, concurrency=1))  # warm-up, not counted
    if warmup:
        reqs = make_requests(warmup, prompt_words, max_tokens, range_ratio, seed + 1)
        _run(run_level(url, model, reqs, rate=math.inf, seed=seed))
    levels: list[tuple[int | None, float | None]] = [(c, None) for c in concurrencies] + [
        (None, r) for r in rates
    ]
    out = []
    for i, (c, r) in enumerate(levels):
        n = num_prompts or max(4, 2 * (c or 4))
        # each level's own prompts: the server's prefix cache keeps a level's prompts, and the
        # same prompts sent again would be read from it, not prefilled (a later level, faster)
        level_seed = seed + 1000 * (i + 1)
        reqs = make_requests(
            n, prompt_words, max_tokens, range_ratio, level_seed, long_every, long_words
        )
        m = _run(
            run_level(
                url, model, reqs, concurrency=c, rate=r, burstiness=burstiness, seed=seed, slo=slo
            )
        )
        m["model"], m["label"] = model, label
        m["workload"] = {
            "input_words": prompt_words,
            "output_tokens": max_tokens,
            "range_ratio": range_ratio,
            "long_every": long_every,
            "long_words": long_words,
        }
        out.append(m)
        if not quiet:
            print(format_row(m), flush=True)
    return out


HEADER = (
    f"{'level':>11} {'ok':>4} {'fail':>4} {'TTFT ms':>20} {'TPOT ms':>20} {'ITL ms':>20} "
    f"{'E2E ms':>8} {'req/s':>6} {'out t/s':>7} {'tot t/s':>7} {'good':>5}\n"
    f"{'':>11} {'':>4} {'':>4} {'p50':>6} {'p90':>6} {'p99':>6} {'p50':>6} {'p90':>6} {'p99':>6} "
    f"{'p50':>6} {'p90':>6} {'p99':>6} {'p50':>8}"
)


def _level(m: dict[str, Any]) -> str:
    if m.get("concurrency"):
        return f"c={m['concurrency']}"
    r = m["request_rate"]
    return "rate=inf" if math.isinf(r) else f"rate={r:g}"


def format_row(m: dict[str, Any]) -> str:
    def three(name: str) -> str:
        return " ".join(f"{m[f'p{q}_{name}_ms']:6.0f}" for q in (50, 90, 99))

    row = (
        f"{_level(m):>11} {m['completed']:>4} {m['failed']:>4} {three('ttft')} {three('tpot')} "
        f"{three('itl')} {m['median_e2el_ms']:8.0f} {m['request_throughput']:6.2f} "
        f"{m['output_throughput']:7.1f} {m['total_token_throughput']:7.1f} {m['goodput']:5.2f}"
    )
    if "p99_itl_short_ms" in m:
        row += f"  ITL p99 of the short requests {m['p99_itl_short_ms']:.0f} ms"
    return row + (f"  {m['label']}" if m.get("label") else "")


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="llmlib bench serve", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--target",
        "--url",
        dest="url",
        default=None,
        help="benchmark this running OpenAI-compatible server instead of starting one",
    )
    ap.add_argument(
        "--model", default=None, help="model for the server it starts (default: SmolLM2)"
    )
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--rates", default=None, help="request rates (req/s, 'inf' = all at once)")
    ap.add_argument("--concurrency", default="", help="levels of requests in flight, as well")
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson)")
    ap.add_argument("--num-prompts", type=int, default=None, help="requests per level (200)")
    ap.add_argument(
        "--input-len",
        "--prompt-words",
        dest="input_len",
        type=int,
        default=None,
        help="mean prompt length in words (64)",
    )
    ap.add_argument(
        "--output-len",
        "--max-tokens",
        dest="output_len",
        type=int,
        default=None,
        help="mean output length in tokens (32), EOS ignored",
    )
    ap.add_argument(
        "--range-ratio", type=float, default=0.5, help="lengths uniform in mean*(1 +- r)"
    )
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=300.0)
    ap.add_argument(
        "--compare-chunked-prefill",
        action="store_true",
        help="the sweep against servers with chunked prefill on and off, long prompts mixed in",
    )
    ap.add_argument(
        "--long-every", type=int, default=10, help="with the comparison: 1 long prompt in N"
    )
    ap.add_argument("--long-words", type=int, default=1200, help="with the comparison: its words")
    ap.add_argument("--short", action="store_true", help="a quick run for CI (few, short requests)")
    ap.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads of the server it starts"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="requests of the workload's shape sent at once before the levels, not counted",
    )
    ap.add_argument("--json", default=None, help="write the metrics to this file")
    ap.add_argument("--plot", default=None, help="save the figure to this file (.png)")
    args = ap.parse_args(argv)
    short = args.short
    rates = _floats(
        args.rates if args.rates is not None else ("2,8,inf" if short else "1,2,4,8,inf")
    )
    concs = [int(c) for c in _floats(args.concurrency)]
    n = args.num_prompts or (12 if short else 200)
    in_len = args.input_len or (24 if short else 64)
    out_len = args.output_len or (8 if short else 32)
    long_words = min(args.long_words, 300) if short else args.long_words
    if any(c < 1 for c in concs) or any(r <= 0 for r in rates) or not (concs or rates):
        ap.error(
            "--concurrency levels must be >= 1 and --rates > 0, and at least one level is needed"
        )
    if out_len < 1 or in_len < 1 or not 0 <= args.range_ratio < 1 or args.burstiness <= 0:
        ap.error("lengths must be >= 1, --range-ratio in [0, 1), --burstiness > 0")
    if args.compare_chunked_prefill and args.url:
        ap.error("--compare-chunked-prefill starts its own two servers; drop --target")

    from llmlib.device import machine_info

    runs = [("", [])]
    if args.compare_chunked_prefill:
        runs = [
            ("chunked prefill on", ["--enable-chunked-prefill"]),
            ("chunked prefill off", ["--no-enable-chunked-prefill"]),
        ]
    common = dict(
        num_prompts=n,
        max_tokens=out_len,
        prompt_words=in_len,
        seed=args.seed,
        range_ratio=args.range_ratio,
        burstiness=args.burstiness,
        long_every=args.long_every if args.compare_chunked_prefill else 0,
        long_words=long_words,
        slo=(args.slo_ttft_ms, args.slo_tpot_ms),
        warmup=args.warmup,
    )
    results: list[dict[str, Any]] = []
    print(HEADER, flush=True)
    for label, flags in runs:
        server = None
        url = args.url
        if url is None:
            extra = flags + (["--threads", str(args.threads)] if args.threads else [])
            server = ServerProcess(args.model, args.device, args.dtype, extra=extra).start()
            url = server.url
        try:
            results += sweep(url, concs, rates, label=label, **common)
        finally:
            if server is not None:
                server.stop()
    k = knee([m for m in results if m["label"] == runs[0][0]])
    report = {
        "benchmark": "serve",
        "url": args.url or "llmlib serve (started here)",
        "workload": results[0]["workload"] if results else {},
        "arrivals": "all at once" if not rates else f"gamma, shape {args.burstiness} (1 = Poisson)",
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "server_threads": args.threads,
        "machine": machine_info(args.device),
        "definitions": "vLLM benchmark_serving: TTFT to first text; TPOT=(latency-TTFT)/(out-1); "
        "ITL=gaps between streamed pieces, pooled; goodput=requests/s meeting the SLO",
        "knee_request_rate": k["request_rate"] if k else None,
        "results": results,
    }
    if k:
        print(
            f"below the knee: median TTFT within 2x of the lowest rate's up to {k['request_rate']:g} "
            "req/s",
            flush=True,
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    if args.plot:
        plot(results, args.plot, title=results[0]["model"] if results else "")
        print(f"wrote {args.plot}")
    return 0 if all(m["failed"] == 0 for m in results) else 1
