"""``llmlib bench serve``: measure a running server the way serving systems are measured.

A concurrent streaming client (httpx, asyncio) sends completion requests to an OpenAI-compatible
server, either with a fixed number in flight (``--concurrency 1,4,16``) or arriving as a Poisson
process (``--rates 1,2,4`` requests per second), and times every server-sent event.

The definitions are those of vLLM's ``benchmark_serving`` (Kwon et al., 2023, the vLLM paper):

* TTFT, time to first token: from sending the request to receiving the first piece of text.
* TPOT, time per output token: ``(latency - TTFT) / (output_tokens - 1)`` per request (requests
  with one output token have none); it excludes the first token, which pays for the prefill.
* ITL, inter-token latency: every gap between two consecutive streamed pieces, pooled over all
  requests. TPOT is a per-request average; ITL shows the stalls (a decode step that waited behind
  another request's prefill shows up in ITL's p99).
* E2EL, end-to-end latency: from sending to the last byte.
* Request throughput: completed requests / wall time of the run; output token throughput: output
  tokens / wall time; total token throughput also counts the prompt tokens.

By default it starts its own server (``llmlib serve`` in a subprocess on 127.0.0.1, a free port) and
stops it at the end; ``--url`` points it at a server that is already running.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from llmlib.bench.serve_client import make_prompts, run_level

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
    ):
        self.port = free_port()
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
            self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
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
    concurrencies: Sequence[int] = (1, 4, 16),
    rates: Sequence[float] = (),
    num_prompts: int | None = None,
    max_tokens: int = 32,
    prompt_words: int = 48,
    seed: int = 0,
    quiet: bool = False,
) -> list[dict[str, Any]]:
    """Run every level against ``url`` (after one warm-up request) and return their metrics."""
    model = served_model(url)
    _run(run_level(url, model, make_prompts(1, 8, seed), 4, concurrency=1))  # warm-up, not counted
    levels: list[tuple[int | None, float | None]] = [(c, None) for c in concurrencies] + [
        (None, r) for r in rates
    ]
    out = []
    for c, r in levels:
        n = num_prompts or max(4, 2 * (c or int(4 * (r or 1))))
        prompts = make_prompts(n, prompt_words, seed)
        m = _run(run_level(url, model, prompts, max_tokens, concurrency=c, rate=r, seed=seed))
        m["model"] = model
        out.append(m)
        if not quiet:
            print(format_row(m), flush=True)
    return out


HEADER = (
    f"{'level':>10} {'reqs':>5} {'TTFT ms':>17} {'TPOT ms':>17} {'ITL ms':>17} {'req/s':>7} {'out tok/s':>9}\n"
    f"{'':>10} {'':>5} {'median':>8} {'p99':>8} {'median':>8} {'p99':>8} {'median':>8} {'p99':>8}"
)


def format_row(m: dict[str, Any]) -> str:
    level = f"c={m['concurrency']}" if m.get("concurrency") else f"rate={m['request_rate']}"
    return (
        f"{level:>10} {m['completed']:>5} {m['median_ttft_ms']:>8.1f} {m['p99_ttft_ms']:>8.1f} "
        f"{m['median_tpot_ms']:>8.1f} {m['p99_tpot_ms']:>8.1f} {m['median_itl_ms']:>8.1f} {m['p99_itl_ms']:>8.1f} "
        f"{m['request_throughput']:>7.2f} {m['output_throughput']:>9.1f}"
        + (f"  failed={m['failed']}" if m["failed"] else "")
    )


def plot(
    results: list[dict[str, Any]], path: str | os.PathLike | None = None, title: str = ""
) -> Any:
    """Latency (TTFT, TPOT, ITL p99) and throughput against the load level: the serving trade-off."""
    import matplotlib
    import matplotlib.ticker

    if path is not None:
        matplotlib.use("Agg", force=False) if "matplotlib.pyplot" not in sys.modules else None
    import matplotlib.pyplot as plt

    by_c = [m for m in results if m.get("concurrency")]
    rows = by_c or results
    xs = [m["concurrency"] if by_c else m["request_rate"] for m in rows]
    xlabel = "concurrent requests" if by_c else "request rate (req/s)"
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.plot(xs, [m["median_ttft_ms"] for m in rows], "o-", label="TTFT (median)")
    a.plot(xs, [m["median_tpot_ms"] for m in rows], "s-", label="TPOT (median)")
    a.plot(xs, [m["p99_itl_ms"] for m in rows], "^--", label="ITL (p99)")
    a.set_xscale("log", base=2)
    if any(m["median_ttft_ms"] > 0 for m in rows):  # nothing completed: leave the axis linear
        a.set_yscale("log")
    a.set_xlabel(xlabel)
    a.set_ylabel("milliseconds")
    a.set_title("latency per request")
    a.legend()
    b.plot(xs, [m["output_throughput"] for m in rows], "o-", color="C3")
    b.set_xscale("log", base=2)
    for ax in (a, b):  # the levels themselves as ticks, not powers of two
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    b.set_xlabel(xlabel)
    b.set_ylabel("output tokens / s")
    b.set_title("throughput of the server")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    return fig


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="llmlib bench serve", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--url", default=None, help="benchmark this running server instead of starting one"
    )
    ap.add_argument(
        "--model", default=None, help="model for the server it starts (default: SmolLM2)"
    )
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument(
        "--concurrency", default="1,4,16", help="comma-separated levels of requests in flight"
    )
    ap.add_argument(
        "--rates", default="", help="comma-separated Poisson request rates (req/s) to sweep as well"
    )
    ap.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="requests per level (default: 2x the level, >= 4)",
    )
    ap.add_argument(
        "--max-tokens", type=int, default=32, help="output tokens per request (EOS ignored)"
    )
    ap.add_argument("--prompt-words", type=int, default=48, help="about how many words per prompt")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="passed to the server it starts (torch CPU threads)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the metrics to this file")
    ap.add_argument("--plot", default=None, help="save the figure to this file (.png)")
    args = ap.parse_args(argv)
    concs = [int(c) for c in _floats(args.concurrency)]
    rates = _floats(args.rates)
    if any(c < 1 for c in concs) or any(r <= 0 for r in rates) or not (concs or rates):
        ap.error(
            "--concurrency levels must be >= 1 and --rates > 0, and at least one level is needed"
        )
    if args.max_tokens < 1:
        ap.error("--max-tokens must be >= 1")

    from llmlib.device import machine_info

    server = None
    url = args.url
    if url is None:
        print("llmlib bench serve: starting llmlib serve on 127.0.0.1 ...", flush=True)
        extra = ["--threads", str(args.threads)] if args.threads else []
        server = ServerProcess(args.model, args.device, args.dtype, extra=extra).start()
        url = server.url
    try:
        print(HEADER, flush=True)
        results = sweep(
            url, concs, rates, args.num_prompts, args.max_tokens, args.prompt_words, args.seed
        )
    finally:
        if server is not None:
            server.stop()
    report = {
        "benchmark": "serve",
        "url": url,
        "max_tokens": args.max_tokens,
        "prompt_words": args.prompt_words,
        "server_threads": args.threads,
        "machine": machine_info(args.device),
        "definitions": "vLLM benchmark_serving: TTFT to first text; TPOT=(latency-TTFT)/(out-1); "
        "ITL=gaps between streamed pieces, pooled",
        "results": results,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    if args.plot:
        plot(results, args.plot, title=results[0]["model"] if results else "")
        print(f"wrote {args.plot}")
    return 0 if all(m["failed"] == 0 for m in results) else 1
