"""FrontMetrics: the HTTP front's Prometheus registry (one per app, no global registry state).

Engine-wide numbers are read from the request pool's stats at scrape time; latency histograms and
request counters are observed by the API routes through a per-request `ReqTimer`. The numbers that
vLLM also exports are exported a second time under vLLM's names (`vllm:...`, labelled with
`model_name`), so dashboards and autoscalers written for vLLM read this server unchanged.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from lightserve.shm.req_pool import SPEC_POSITIONS

if TYPE_CHECKING:
    from lightserve.engine.client import EngineClient

PREFIX = "lightserve_"
VLLM = "vllm:"

# Router stats (shm STATS_FIELDS) that only ever grow. Every other field is a gauge, including
# kv_tokens_total, which is the KV capacity despite its suffix.
COUNTER_STATS = frozenset({"pauses_total", "resumes_total", "prompt_tokens_total",
                           "prompt_tokens_cached_total", "generation_tokens_total", "steps_total",
                           "spec_drafts_total", "spec_draft_tokens_total", "spec_accepted_tokens_total",
                           *(f"spec_accepted_pos_{i}" for i in range(SPEC_POSITIONS))})

def idle_problems(samples: dict[str, float]) -> list[str]:
    """Why a server whose clients are all done is not back to its idle state: requests still held,
    KV or request slots leaked. `samples`: the unlabelled /metrics samples without the prefix.
    Used by the reliability tests and scripts/soak.py."""
    problems = [f"{k} = {samples[k]:g}" for k in ("requests_running", "requests_waiting", "requests_paused",
                                                   "requests_in_front", "requests_queued") if samples[k] != 0]
    if samples["kv_tokens_free"] + samples["kv_tokens_cached"] != samples["kv_tokens_total"]:
        problems.append(f"KV leaked: free {samples['kv_tokens_free']:g} + cached {samples['kv_tokens_cached']:g} "
                        f"!= total {samples['kv_tokens_total']:g}")
    if samples["req_slots_free"] != samples["req_slots_total"]:
        problems.append(f"request slots leaked: {samples['req_slots_free']:g} of {samples['req_slots_total']:g} free")
    return problems


_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0)


class FrontMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine: EngineClient, model_name: str = "", kv_cache_dtype: str = "",
                 kv_bytes_per_token: int = 0):
        """kv_cache_dtype / kv_bytes_per_token: the workers' KV cache format and its bytes a token on one rank
        (exported once, as vLLM's cache_config_info labels its cache_dtype)."""
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        r = self.registry
        Gauge(PREFIX + "kv_bytes_per_token", "KV cache bytes one token takes on a worker rank, over all layers",
              registry=r).set(kv_bytes_per_token)
        Gauge(VLLM + "cache_config_info", "The KV cache's settings", ["model_name", "cache_dtype"],
              registry=r).labels(model_name, kv_cache_dtype).set(1)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to the first output token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between output tokens",
                             buckets=_ITL_BUCKETS, registry=r)
        # NOTE: the front cannot see when the router schedules a request, so queue time is measured
        # as arrival to the first delta (slot wait + router queue + prefill).
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds",
                                    "Arrival to the first delta from the engine", buckets=_TTFT_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to the last output token",
                             buckets=_E2E_BUCKETS, registry=r)
        # The same observations under vLLM's names; vLLM's histograms carry a model_name label.
        self.vllm_ttft = Histogram(VLLM + "time_to_first_token_seconds", "Arrival to the first output token",
                                   ["model_name"], buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.vllm_itl = Histogram(VLLM + "inter_token_latency_seconds", "Time between output tokens",
                                  ["model_name"], buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self.vllm_e2e = Histogram(VLLM + "e2e_request_latency_seconds", "Arrival to the last output token",
                                  ["model_name"], buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        self.requests = Counter(PREFIX + "requests", "Generation requests by HTTP status", ["status"], registry=r)
        self.finished = Counter(PREFIX + "requests_finished", "Generation requests by how they ended "
                                "(stop, length, abort, disconnect, error)", ["reason"], registry=r)

    def timer(self) -> ReqTimer:
        return ReqTimer(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ReqTimer:
    """Latency bookkeeping of one request; `on_tokens` is called once per delta that carries tokens."""
    __slots__ = ("_last", "_metrics", "arrival")

    def __init__(self, metrics: FrontMetrics):
        self._metrics = metrics
        self.arrival = time.monotonic()
        self._last: float | None = None

    def on_tokens(self, num_tokens: int) -> None:
        now = time.monotonic()
        m = self._metrics
        if self._last is None:
            m.ttft.observe(now - self.arrival)
            m.vllm_ttft.observe(now - self.arrival)
            m.queue_time.observe(now - self.arrival)
        else:
            # A delta of several tokens (the front fell behind the detokenizer) spreads its gap.
            gap = (now - self._last) / num_tokens
            for _ in range(num_tokens):
                m.itl.observe(gap)
                m.vllm_itl.observe(gap)
        self._last = now

    def on_finish(self, reason: str) -> None:
        m = self._metrics
        m.finished.labels(reason).inc()
        if reason in ("stop", "length"):
            m.e2e.observe(time.monotonic() - self.arrival)
            m.vllm_e2e.observe(time.monotonic() - self.arrival)


class _EngineCollector(Collector):
    """Reads the router's shm stats and the front's queues at scrape time (nothing cached)."""

    def __init__(self, engine: EngineClient, model_name: str):
        self._engine = engine
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.pool.stats_dict()
        yield from self._vllm(stats)
        for name, value in stats.items():
            if name in COUNTER_STATS:
                yield CounterMetricFamily(PREFIX + name, f"router counter {name}", value=value)
            else:
                yield GaugeMetricFamily(PREFIX + name, f"router gauge {name}", value=value)
        yield GaugeMetricFamily(PREFIX + "requests_in_front", "Requests the HTTP front holds a slot for",
                                value=self._engine.num_pending)
        yield GaugeMetricFamily(PREFIX + "requests_queued", "Requests waiting in the front for a free slot",
                                value=self._engine.num_queued)
        pool = self._engine.pool
        yield GaugeMetricFamily(PREFIX + "req_slots_total", "Request-pool slots (--req_pool_size)",
                                value=pool.num_slots)
        yield GaugeMetricFamily(PREFIX + "req_slots_free", "Request-pool slots every owner has released",
                                value=pool.num_free_slots())
        adapters = self._engine.adapters
        if adapters is not None:  # --enable_lora: each served adapter and its requests (running or waiting)
            family = GaugeMetricFamily(PREFIX + "lora_requests", "Requests of each LoRA adapter the front holds "
                                       "(running, queued or waiting for a slot)", labels=["adapter"])
            for entry in adapters:
                family.add_metric([entry.name], adapters.in_flight[entry.lora_id])
            yield family

    def _vllm(self, stats: dict[str, int]) -> Iterator[Metric]:
        """vLLM's engine metrics from the router's stats. Waiting counts every request not running:
        queued in the front, waiting in the router, or paused (vLLM's preempted requests wait too)."""
        total = stats["kv_tokens_total"]
        used = total - stats["kv_tokens_free"] - stats["kv_tokens_cached"]  # cached rows are evictable
        waiting = stats["requests_waiting"] + stats["requests_paused"] + self._engine.num_queued
        for kind, name, doc, value in (
                (GaugeMetricFamily, "num_requests_running", "Requests in model execution batches",
                 stats["requests_running"]),
                (GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be processed", waiting),
                (GaugeMetricFamily, "kv_cache_usage_perc", "KV-cache usage, 1 = full", used / total if total else 0.0),
                (CounterMetricFamily, "prompt_tokens", "Prefill tokens processed", stats["prompt_tokens_total"]),
                (CounterMetricFamily, "generation_tokens", "Generation tokens processed",
                 stats["generation_tokens_total"]),
                (CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                 stats["prompt_tokens_total"]),
                (CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache",
                 stats["prompt_tokens_cached_total"]),
                (CounterMetricFamily, "num_preemptions", "Requests preempted (paused for KV)", stats["pauses_total"]),
                (CounterMetricFamily, "spec_decode_num_drafts", "Draft proposals verified (a request's step "
                 "with drafts)", stats["spec_drafts_total"]),
                (CounterMetricFamily, "spec_decode_num_draft_tokens", "Draft tokens verified",
                 stats["spec_draft_tokens_total"]),
                (CounterMetricFamily, "spec_decode_num_accepted_tokens", "Draft tokens accepted",
                 stats["spec_accepted_tokens_total"])):
            family = kind(VLLM + name, doc, labels=["model_name"])
            family.add_metric([self._model_name], value)
            yield family
        per_pos = CounterMetricFamily(VLLM + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each draft position", labels=["model_name", "position"])
        for i in range(SPEC_POSITIONS):
            per_pos.add_metric([self._model_name, str(i)], stats[f"spec_accepted_pos_{i}"])
        yield per_pos

    def describe(self) -> Iterator[Metric]:
        return iter(())  # names depend on STATS_FIELDS; skip the registration-time duplicate check
