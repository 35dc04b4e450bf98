"""The serving benchmark's client side: timed streaming requests, and their statistics.

See :mod:`llmlib.bench.serve` for the definitions (TTFT, TPOT, ITL, E2EL, throughputs).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = float("nan")
    latency: float = float("nan")
    itl: list[float] = field(default_factory=list)
    error: str = ""

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
    if not xs:
        return {
            f"mean_{name}_ms": float("nan"),
            f"median_{name}_ms": float("nan"),
            f"p99_{name}_ms": float("nan"),
        }
    return {
        f"mean_{name}_ms": statistics.fmean(xs),
        f"median_{name}_ms": statistics.median(xs),
        f"p99_{name}_ms": percentile(xs, 99),
    }


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """Aggregate per-request timings into the benchmark's metrics (vLLM's definitions)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    m: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else float("nan"),
        "output_throughput": out_tokens / duration if duration > 0 else float("nan"),
        "total_token_throughput": (in_tokens + out_tokens) / duration
        if duration > 0
        else float("nan"),
    }
    m.update(_stats("ttft", [r.ttft for r in ok]))
    m.update(_stats("tpot", [t for r in ok if (t := r.tpot) is not None]))
    m.update(_stats("itl", [g for r in ok for g in r.itl]))
    m.update(_stats("e2el", [r.latency for r in ok]))
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


async def run_level(
    url: str,
    model: str,
    prompts: list[str],
    max_tokens: int,
    concurrency: int | None = None,
    rate: float | None = None,
    seed: int = 0,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """Send every prompt once, ``concurrency`` at a time or Poisson-arriving at ``rate`` per second."""
    rng = random.Random(seed)
    limits = httpx.Limits(
        max_connections=max(64, (concurrency or 0) * 2), max_keepalive_connections=64
    )
    sem = asyncio.Semaphore(concurrency) if concurrency else None

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:

        async def task(p: str) -> RequestResult:
            payload = {
                "model": model,
                "prompt": p,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "stream": True,
                "ignore_eos": True,
                "stream_options": {"include_usage": True},
            }
            if sem is None:
                return await send_one(client, url, payload)
            async with sem:
                return await send_one(client, url, payload)

        t0 = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(task(p)))
            if rate:
                await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    m = summarize(list(results), duration)
    m.update(
        {
            "concurrency": concurrency,
            "request_rate": rate,
            "num_prompts": len(prompts),
            "max_tokens": max_tokens,
        }
    )
    return m


def make_prompts(n: int, words: int = 48, seed: int = 0) -> list[str]:
    """Prompts of about ``words`` words: passages from the Austen corpus when it is here, else filler."""
    rng = random.Random(seed)
    corpus = Path(__file__).resolve().parents[2] / "data" / "austen.txt"
    toks: list[str] = []
    if corpus.exists():
        with open(corpus, encoding="utf-8") as f:
            toks = f.read(400_000).split()
    if len(toks) < words * 4:
        toks = (
            "the inference path of a language model reads weights and writes tokens " * 50
        ).split()
    out = []
    for _ in range(n):
        i = rng.randrange(0, len(toks) - words)
        out.append("Continue this passage: " + " ".join(toks[i : i + words]))
    return out
