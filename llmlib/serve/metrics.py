"""``/metrics``: the server's state and latencies in Prometheus' text format (``prometheus_client``).

The metrics mean what vLLM's mean, under the prefix ``llmlib:`` instead of ``vllm:``:

* gauges read from the engine at each scrape: ``num_requests_running``, ``num_requests_waiting``
  (sequences in the scheduler's queues), ``kv_cache_usage_perc`` (share of KV blocks held);
* counters: ``num_preemptions``, ``prefix_cache_queries`` and ``prefix_cache_hits`` (in tokens,
  so hits / queries is the prefix-cache hit rate), ``prompt_tokens``, ``generation_tokens``,
  ``request_success`` by finish reason;
* histograms, timed by the server from the moment a request is accepted:
  ``time_to_first_token_seconds``, ``inter_token_latency_seconds`` (each gap between two steps
  that gave a choice tokens), ``e2e_request_latency_seconds``, and the engine's
  ``request_queue_time_seconds`` (waiting before the first step).

Each app has its own registry, so several servers in one process (the tests) do not collide.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from llmlib.engine import AsyncLLM, RequestOutput

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_ITL = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineCollector:
    """Gauges and counters read from the engine when Prometheus scrapes."""

    def __init__(self, engine: AsyncLLM, model: str):
        self.engine, self.model = engine, model

    def collect(self) -> Any:
        llm = self.engine.llm
        sched, bm = llm.scheduler, llm.block_manager
        labels = ["model_name"]

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"llmlib:{name}", doc, labels=labels)
            g.add_metric([self.model], v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"llmlib:{name}", doc, labels=labels)
            c.add_metric([self.model], v)
            return c

        yield gauge("num_requests_running", "Sequences running in the engine.", len(sched.running))
        yield gauge("num_requests_waiting", "Sequences waiting to run.", len(sched.waiting))
        yield gauge(
            "kv_cache_usage_perc",
            "Share of KV-cache blocks in use (0-1).",
            bm.num_used_blocks / bm.num_blocks,
        )
        yield counter(
            "num_preemptions", "Sequences preempted (recomputed later).", sched.stats.preemptions
        )
        bs = bm.block_size
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            bm.num_prefix_queries * bs,
        )
        yield counter(
            "prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            bm.num_prefix_hit_blocks * bs,
        )
        # speculative decoding (vLLM's names): acceptance = accepted / draft tokens
        yield counter(
            "spec_decode_num_draft_tokens",
            "Tokens proposed by speculative decoding and verified.",
            sched.stats.spec_proposed,
        )
        yield counter(
            "spec_decode_num_accepted_tokens",
            "Proposed tokens the model kept.",
            sched.stats.spec_accepted,
        )


class ServerMetrics:
    """The server's metrics; :meth:`observe` is called for every engine output it receives."""

    def __init__(self, engine: AsyncLLM, model: str):
        self.model = model
        self.registry = CollectorRegistry()
        r, lab = self.registry, ["model_name"]
        self.ttft = Histogram(
            "llmlib:time_to_first_token_seconds",
            "Time to first token.",
            lab,
            buckets=_LATENCY,
            registry=r,
        )
        self.itl = Histogram(
            "llmlib:inter_token_latency_seconds",
            "Time between a choice's tokens.",
            lab,
            buckets=_ITL,
            registry=r,
        )
        self.e2e = Histogram(
            "llmlib:e2e_request_latency_seconds",
            "Request latency, end to end.",
            lab,
            buckets=_LATENCY,
            registry=r,
        )
        self.queue = Histogram(
            "llmlib:request_queue_time_seconds",
            "Time waiting before the first step.",
            lab,
            buckets=_LATENCY,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "llmlib:prompt_tokens", "Prompt tokens processed.", lab, registry=r
        )
        self.generation_tokens = Counter(
            "llmlib:generation_tokens", "Tokens generated.", lab, registry=r
        )
        self.success = Counter(
            "llmlib:request_success",
            "Requests finished.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        r.register(_EngineCollector(engine, model))
        # the labelled series, looked up once (observe runs for every engine output)
        self._ttft, self._itl, self._e2e, self._queue = (
            h.labels(model) for h in (self.ttft, self.itl, self.e2e, self.queue)
        )
        self._prompt, self._gen = (
            self.prompt_tokens.labels(model),
            self.generation_tokens.labels(model),
        )

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def observe(self, out: RequestOutput, now: float, state: dict[str, Any]) -> None:
        """Account one engine output of a request accepted at ``state['t0']``."""
        n_new = sum(len(o.delta_token_ids) for o in out.outputs)
        if n_new:
            self._gen.inc(n_new)
            if "first" not in state:
                state["first"] = now
                self._ttft.observe(now - state["t0"])
                met = out.metrics
                if met.first_scheduled_time is not None:
                    self._queue.observe(max(0.0, met.first_scheduled_time - met.arrival_time))
            last = state.setdefault("last", {})
            for o in out.outputs:
                if o.delta_token_ids:
                    if o.index in last:
                        self._itl.observe(now - last[o.index])
                    last[o.index] = now
        if out.finished:
            self._prompt.inc(len(out.prompt_token_ids))
            self._e2e.observe(now - state["t0"])
            for o in out.outputs:
                self.success.labels(self.model, o.finish_reason or "stop").inc()
