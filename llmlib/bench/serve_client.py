"""The serving benchmark's client side: a workload, timed streaming requests, their statistics
and the latency-throughput figure.

See :mod:`llmlib.bench.serve` for the definitions (TTFT, TPOT, ITL, E2EL, throughputs, goodput).

The workload (:func:`make_requests`) is stated, not sampled from a trace: prompt lengths are
uniform in ``[(1 - r) L_in, (1 + r) L_in]`` words of Jane Austen's text (random passages, so the
prefix cache finds nothing but the short instruction in front), output lengths uniform in
``[(1 - r) L_out, (1 + r) L_out]`` tokens, generated to the end (``ignore_eos``), the shape of
vLLM's ``random`` dataset. Optionally every ``long_every``-th request carries a long prompt instead,
to show what a long prefill does to the other requests' inter-token latency.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

PERCENTILES = (50, 90, 99)


@dataclass
class Req:
    prompt: str
    max_tokens: int
    long: bool = False


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = float("nan")
    latency: float = float("nan")
    itl: list[float] = field(default_factory=list)
    error: str = ""
    long: bool = False

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation (numpy's default), without numpy."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _stats(name: str, xs: Sequence[float]) -> dict[str, float]:
    xs = [x * 1e3 for x in xs]  # report milliseconds
    out = {f"mean_{name}_ms": statistics.fmean(xs) if xs else float("nan")}
    out[f"median_{name}_ms"] = statistics.median(xs) if xs else float("nan")
    for q in PERCENTILES:
        out[f"p{q}_{name}_ms"] = percentile(xs, q)
    return out


def summarize(
    results: list[RequestResult],
    duration: float,
    slo_ttft_ms: float = 2000.0,
    slo_tpot_ms: float = 300.0,
) -> dict[str, Any]:
    """Aggregate per-request timings into the benchmark's metrics (vLLM's definitions).

    Goodput: completed requests per second that met both SLOs (TTFT <= ``slo_ttft_ms`` and TPOT
    <= ``slo_tpot_ms``; a one-token request has no TPOT and meets that one)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    good = [
        r
        for r in ok
        if r.ttft * 1e3 <= slo_ttft_ms and (r.tpot is None or r.tpot * 1e3 <= slo_tpot_ms)
    ]

    def per_s(x: float) -> float:
        return x / duration if duration > 0 else float("nan")

    m: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(in_tokens + out_tokens),
        "goodput": per_s(len(good)),
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
    }
    m.update(_stats("ttft", [r.ttft for r in ok]))
    m.update(_stats("tpot", [t for r in ok if (t := r.tpot) is not None]))
    m.update(_stats("itl", [g for r in ok for g in r.itl]))
    m.update(_stats("e2el", [r.latency for r in ok]))
    if any(r.long for r in results):  # the short requests' gaps, with long prompts among them
        m.update(_stats("itl_short", [g for r in ok if not r.long for g in r.itl]))
        m.update(_stats("ttft_long", [r.ttft for r in ok if r.long]))
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        m["errors"] = errors[:5]
    return m


# ---- the client -----------------------------------------------------------------------------------


async def send_one(client: httpx.AsyncClient, url: str, payload: dict) -> RequestResult:
    """One streaming completion; timestamps taken as each server-sent event arrives."""
    t0 = time.perf_counter()
    res = RequestResult(ok=False)
    last = t0
    pieces = 0
    try:
        async with client.stream("POST", url.rstrip("/") + "/v1/completions", json=payload) as r:
            if r.status_code != 200:
                body = (await r.aread()).decode(errors="replace")
                res.error = f"HTTP {r.status_code}: {body[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    res.error = str(obj["error"].get("message"))
                    return res
                if obj.get("usage"):
                    res.prompt_tokens = int(obj["usage"]["prompt_tokens"])
                    res.output_tokens = int(obj["usage"]["completion_tokens"])
                choices = obj.get("choices") or []
                if choices and choices[0].get("text"):
                    now = time.perf_counter()
                    if pieces == 0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                    pieces += 1
        res.latency = time.perf_counter() - t0
        if res.output_tokens == 0:
            res.output_tokens = pieces  # a server without usage reporting: one piece per token
        res.ok = pieces > 0
        if not res.ok:
            res.error = "no text streamed"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def gaps(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Inter-arrival times for ``rate`` requests a second: gamma with shape ``burstiness`` and
    mean ``1 / rate`` (shape 1 is a Poisson process; below 1 burstier, above 1 more regular);
    all zero for an infinite rate (everything at once)."""
    if math.isinf(rate):
        return [0.0] * n
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


async def run_level(
    url: str,
    model: str,
    requests: list[Req],
    concurrency: int | None = None,
    rate: float | None = None,
    burstiness: float = 1.0,
    seed: int = 0,
    timeout: float = 600.0,
    slo: tuple[float, float] = (2000.0, 300.0),
) -> dict[str, Any]:
    """Send every request once: ``concurrency`` at a time, or arriving at ``rate`` per second."""
    rng = random.Random(seed)
    limits = httpx.Limits(
        max_connections=max(256, (concurrency or 0) * 2), max_keepalive_connections=64
    )
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    waits = gaps(len(requests), rate, burstiness, rng) if rate else [0.0] * len(requests)

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:

        async def task(q: Req) -> RequestResult:
            payload = {
                "model": model,
                "prompt": q.prompt,
                "max_tokens": q.max_tokens,
                "temperature": 0.0,
                "stream": True,
                "ignore_eos": True,
                "stream_options": {"include_usage": True},
            }
            if sem is None:
                r = await send_one(client, url, payload)
            else:
                async with sem:
                    r = await send_one(client, url, payload)
            r.long = q.long
            return r

        t0 = time.perf_counter()
        tasks = []
        for q, w in zip(requests, waits):
            tasks.append(asyncio.create_task(task(q)))
            if w:
                await asyncio.sleep(w)
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    m = summarize(list(results), duration, *slo)
    m.update(
        {
            "concurrency": concurrency,
            "request_rate": rate,
            "burstiness": burstiness,
            "num_prompts": len(requests),
            "max_tokens": statistics.fmean(q.max_tokens for q in requests),
        }
    )
    return m


def _corpus() -> list[str]:
    corpus = Path(__file__).resolve().parents[2] / "data" / "austen.txt"
    toks: list[str] = []
    if corpus.exists():
        with open(corpus, encoding="utf-8") as f:
            toks = f.read(400_000).split()
    if len(toks) < 10_000:
        toks = (
            "the inference path of a language model reads weights and writes tokens " * 900
        ).split()
    return toks


def make_requests(
    n: int,
    input_words: int = 64,
    output_tokens: int = 32,
    range_ratio: float = 0.5,
    seed: int = 0,
    long_every: int = 0,
    long_words: int = 1200,
) -> list[Req]:
    """The stated workload (see the module docstring)."""
    rng = random.Random(seed)
    toks = _corpus()

    def span(mean: int) -> int:
        lo, hi = max(1, round(mean * (1 - range_ratio))), max(1, round(mean * (1 + range_ratio)))
        return rng.randint(lo, hi)

    out = []
    for k in range(n):
        long = bool(long_every) and k % long_every == long_every // 2
        words = long_words if long else span(input_words)
        i = rng.randrange(0, len(toks) - words)
        prompt = "Continue this passage: " + " ".join(toks[i : i + words])
        out.append(Req(prompt, span(output_tokens), long))
    return out


def make_prompts(n: int, words: int = 48, seed: int = 0) -> list[str]:
    """Prompts of exactly ``words`` words (the notebook's and the warm-up's)."""
    return [q.prompt for q in make_requests(n, words, 1, 0.0, seed)]


def knee(results: list[dict[str, Any]], factor: float = 2.0) -> dict[str, Any] | None:
    """The highest finite offered rate below the knee of the latency curve: its median TTFT is
    within ``factor`` times the median TTFT at the lowest rate, i.e. requests were not yet
    queueing. Past it, requests arrive faster than the engine finishes them, and TTFT climbs."""
    rated = sorted(
        (m for m in results if m.get("request_rate") and not math.isinf(m["request_rate"])),
        key=lambda m: m["request_rate"],
    )
    if not rated or not rated[0]["completed"]:
        return None
    base, best = rated[0]["p50_ttft_ms"], None
    for m in rated:
        if not m["completed"] or m["p50_ttft_ms"] > factor * base:
            break
        best = m
    return best


def plot(
    results: list[dict[str, Any]], path: str | os.PathLike | None = None, title: str = ""
) -> Any:
    """The latency-throughput curve (latency against achieved output throughput, one point per
    rate) and, per label, the ITL p99 against the offered rate."""
    import matplotlib

    if path is not None and "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    labels = list(dict.fromkeys(m.get("label", "") for m in results))
    for k, lab in enumerate(labels):
        rows = [m for m in results if m.get("label", "") == lab and m["completed"]]
        xs = [m["output_throughput"] for m in rows]
        suffix = f" ({lab})" if lab else ""
        a.plot(
            xs, [m["p50_ttft_ms"] for m in rows], "o-", color=f"C{2 * k}", label="TTFT p50" + suffix
        )
        a.plot(
            xs,
            [m["p99_itl_ms"] for m in rows],
            "^--",
            color=f"C{2 * k + 1}",
            label="ITL p99" + suffix,
        )
        rated = [m for m in rows if m.get("request_rate")]
        finite = [m for m in rated if not math.isinf(m["request_rate"])]
        b.plot(
            [m["request_rate"] for m in finite],
            [m.get("p99_itl_short_ms", m["p99_itl_ms"]) for m in finite],
            "o-",
            color=f"C{2 * k + 1}",
            label="ITL p99" + suffix,
        )
    a.set_yscale("log")
    a.set_xlabel("output tokens / s (achieved)")
    a.set_ylabel("milliseconds")
    a.set_title("latency against throughput")
    a.legend(fontsize=8)
    b.set_xlabel("offered request rate (req/s)")
    b.set_ylabel("ITL p99 (ms)")
    b.set_title("inter-token latency, p99")
    b.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    return fig
