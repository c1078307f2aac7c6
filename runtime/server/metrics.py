"""Prometheus metrics: vLLM's set under ``ladle:``, each labelled with ``model_name``.

Engine gauges and engine-owned counters are read from ``LLMEngine.stats()`` at scrape time;
token counters and iteration sizes come from the engine's per-step observer; request
histograms are observed by the server as each request streams and finishes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ladle.runtime.engine import IterationStats, LLMEngine
from ladle.runtime.outputs import RequestOutput
from ladle.runtime.server.adapters import ServedAdapters
from ladle.runtime.spec_decode.counts import SpecDecodeCounts
from ladle.runtime_metrics import (
    CACHE_CONFIG_INFO,
    KV_USAGE,
    LORA_ADAPTERS,
    LORA_INFO,
    PROTOCOL_GAUGES,
    PROTOCOL_LORA_INFO,
    RUNNING,
    WAITING,
)

PREFIX = "ladle:"
# Latency buckets include 0.5, 1 and 2 s exactly, so those SLOs are read without interpolation.
LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5,
    5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 5.0,
    10.0, 20.0,
)  # fmt: skip
# A request with n > 1 counts once, under the most severe of its choices' reasons.
_SEVERITY = ("abort", "length", "stop")


def one_two_five_buckets(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets)."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > limit:
                return buckets
            buckets.append(float(value))
        scale *= 10


def iteration_buckets(max_num_batched_tokens: int) -> list[float]:
    sizes = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    return [float(s) for s in sizes if s < max_num_batched_tokens] + [float(max_num_batched_tokens)]


@dataclass
class RequestRecord:
    """One engine request's timings (``time.monotonic``, as the server receives outputs)."""

    request_id: str
    engine_request_id: str
    endpoint: str
    stream: bool
    prompt_tokens: int
    params: dict[str, Any]
    prompt: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    # Sequences the request runs (n, best_of or beam width): what admission counts.
    num_seqs: int = 1
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reasons: dict[int, str] = field(default_factory=dict)
    error: str | None = None
    # The LoRA adapter that served it, if any.
    lora_name: str | None = None

    def on_output(self, output: RequestOutput, now: float) -> float | None:
        """Account for one streamed output; returns the inter-token gap it closes, if any."""
        if self.first_scheduled is None:
            self.first_scheduled = output.metrics.first_scheduled_time
            self.cached_tokens = output.num_cached_tokens
        gap = None
        new_tokens = sum(len(c.token_ids) for c in output.outputs)
        if new_tokens:
            if self.last_token is not None:
                gap = now - self.last_token
            else:
                self.first_token = now
            self.last_token = now
            self.completion_tokens += new_tokens
        for completion in output.outputs:
            if completion.finish_reason is not None:
                self.finish_reasons[completion.index] = completion.finish_reason
        return gap

    @property
    def finish_reason(self) -> str:
        reasons = set(self.finish_reasons.values())
        if self.error is not None or not reasons:
            return "abort"
        return next((r for r in _SEVERITY if r in reasons), sorted(reasons)[0])

    def timings(self) -> dict[str, float | None]:
        end = self.finished if self.finished is not None else time.monotonic()

        def span(start: float | None, stop: float | None) -> float | None:
            return None if start is None or stop is None else stop - start

        return {
            "queue_s": span(self.arrival, self.first_scheduled),
            "ttft_s": span(self.arrival, self.first_token),
            "prefill_s": span(self.first_scheduled, self.first_token),
            "decode_s": span(self.first_token, self.last_token),
            "total_s": end - self.arrival,
        }


class _EngineCollector(Collector):
    """Reads the engine's own gauges and counters at scrape time."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        labels = ["model_name"]
        values = [self.model_name]
        for name, doc, value in (
            (RUNNING, "Requests in the running batch.", stats.num_running),
            (WAITING, "Requests waiting to be scheduled.", stats.num_waiting),
            (KV_USAGE, "Fraction of KV blocks in use (0-1).", stats.kv_cache_usage),
        ):
            for exported in (name, PROTOCOL_GAUGES[name]):
                gauge = GaugeMetricFamily(exported, doc, labels=labels)
                gauge.add_metric(values, value)
                yield gauge
        yield self._cache_config(stats.num_blocks)
        if self.engine.lora is not None:
            yield from self._lora_info(stats.loaded_loras, stats.waiting_loras)
        for name, doc, value in (
            ("prefix_cache_queries", "Prompt tokens looked up.", stats.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found cached.", stats.prefix_cache_hits),
            ("num_preemptions", "Sequences preempted for KV space.", stats.num_preemptions),
        ):
            counter = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            counter.add_metric(values, value)
            yield counter
        if self.engine.args.speculative_config is not None:
            yield from self._spec_decode(stats.spec_decode, values)

    def _spec_decode(self, counts: SpecDecodeCounts, values: list[str]) -> Iterator[Metric]:
        """vLLM's ``spec_decode`` counters: the acceptance rate is accepted over draft
        tokens, and the mean tokens a verifying step yields 1 + accepted over drafts."""
        for name, doc, value in (
            ("spec_decode_num_drafts", "Steps that verified a draft.", counts.drafts),
            ("spec_decode_num_draft_tokens", "Draft tokens proposed.", counts.draft_tokens),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", counts.accepted_tokens),
        ):
            counter = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            counter.add_metric(values, value)
            yield counter
        per_position = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position in the draft.",
            labels=["model_name", "position"],
        )
        for position, value in enumerate(counts.accepted_per_position):
            per_position.add_metric([*values, str(position)], value)
        yield per_position

    def _lora_info(self, loaded: list[str], waiting: list[str]) -> Iterator[Metric]:
        """``running_lora_adapters`` lists the adapters in device slots, as GAIE's protocol
        defines it: what a picker's LoRA affinity needs is where an adapter is ready, and
        vLLM's list (adapters with requests in flight) forgets a loaded one between requests."""
        labels = {
            "running_lora_adapters": ",".join(loaded),
            "waiting_lora_adapters": ",".join(waiting),
            "max_lora": str(self.engine.args.max_loras),
        }
        now = time.time()
        for name in (LORA_INFO, PROTOCOL_LORA_INFO):
            info = GaugeMetricFamily(
                name, "Adapters of running and waiting requests, at this time.", labels=list(labels)
            )
            info.add_metric(list(labels.values()), now)
            yield info

    def _cache_config(self, num_blocks: int) -> Metric:
        """vLLM's ``cache_config_info``: the KV cache's layout as labels on a constant 1."""
        args = self.engine.args
        config = {
            "block_size": str(args.block_size),
            "num_gpu_blocks": str(num_blocks),
            "cache_dtype": args.kv_cache_dtype,
            "enable_prefix_caching": str(args.enable_prefix_caching),
            "gpu_memory_utilization": str(args.gpu_memory_utilization),
        }
        info = GaugeMetricFamily(
            CACHE_CONFIG_INFO, "The KV cache's configuration.", labels=list(config)
        )
        info.add_metric(list(config.values()), 1.0)
        return info


class _AdaptersCollector(Collector):
    """Every adapter the server serves (``loaded``) or was asked to and cannot
    (``failed``): per pod, what the operator's status reads."""

    def __init__(self, adapters: ServedAdapters, model_name: str) -> None:
        self.adapters = adapters
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily(
            LORA_ADAPTERS,
            "LoRA adapters this server serves (loaded) or cannot serve (failed).",
            labels=["model_name", "lora_name", "state"],
        )
        for name in self.adapters.names:
            gauge.add_metric([self.model_name, name, "loaded"], 1.0)
        for name in sorted(self.adapters.failed):
            gauge.add_metric([self.model_name, name, "failed"], 1.0)
        yield gauge


class ServerMetrics:
    def __init__(
        self, registry: CollectorRegistry, engine: LLMEngine, adapters: ServedAdapters
    ) -> None:
        self.model_name = engine.served_model_name
        registry.register(_EngineCollector(engine, self.model_name))
        if engine.lora is not None:
            registry.register(_AdaptersCollector(adapters, self.model_name))
        token_buckets = one_two_five_buckets(engine.max_model_len)
        m = [self.model_name]

        def counter(name: str, doc: str, *extra: str) -> Counter:
            return Counter(PREFIX + name, doc, ["model_name", *extra], registry=registry)

        def histogram(name: str, doc: str, buckets: Any) -> Histogram:
            metric = Histogram(
                PREFIX + name, doc, ["model_name"], buckets=buckets, registry=registry
            )
            return metric.labels(*m)

        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed.").labels(*m)
        self.generation_tokens = counter("generation_tokens", "Tokens generated.").labels(*m)
        self._success = counter(
            "request_success", "Finished requests, by finish reason.", "finished_reason"
        )
        self._rejected = counter("request_rejected", "Requests refused, by reason.", "reason")
        self._lora = counter("lora_requests", "Finished requests, by LoRA adapter.", "lora_name")
        self.iteration_tokens = histogram(
            "iteration_tokens_total",
            "Tokens run through the model per engine step (prefill chunks plus decodes).",
            iteration_buckets(engine.args.max_num_batched_tokens),
        )
        self.ttft = histogram(
            "time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Gap between streamed tokens.", TOKEN_LATENCY_BUCKETS
        )
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Per request: decode time over the output tokens after the first (vLLM's TPOT).",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Arrival to the last token.", LATENCY_BUCKETS
        )
        self.queue = histogram(
            "request_queue_time_seconds", "Arrival to first scheduling.", LATENCY_BUCKETS
        )
        self.prefill = histogram(
            "request_prefill_time_seconds", "First scheduling to first token.", LATENCY_BUCKETS
        )
        self.decode = histogram(
            "request_decode_time_seconds", "First token to last token.", LATENCY_BUCKETS
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt length per request.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens",
            "Generated tokens per request (all choices).",
            token_buckets,
        )
        engine.iteration_observers.append(self.on_iteration)

    def on_iteration(self, stats: IterationStats) -> None:
        """Runs on the engine thread; prometheus-client metrics are thread-safe."""
        self.iteration_tokens.observe(stats.num_batched_tokens)
        if stats.num_prompt_tokens:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)

    def rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def finished(self, record: RequestRecord) -> None:
        self._success.labels(self.model_name, record.finish_reason).inc()
        if record.lora_name is not None:
            self._lora.labels(self.model_name, record.lora_name).inc()
        self.request_prompt_tokens.observe(record.prompt_tokens)
        self.request_generation_tokens.observe(record.completion_tokens)
        timings = record.timings()
        for histogram, key in (
            (self.e2e, "total_s"),
            (self.ttft, "ttft_s"),
            (self.queue, "queue_s"),
            (self.prefill, "prefill_s"),
            (self.decode, "decode_s"),
        ):
            value = timings[key]
            if value is not None:
                histogram.observe(value)
        decode = timings["decode_s"]
        if decode is not None and record.completion_tokens > 1:
            self.tpot.observe(decode / (record.completion_tokens - 1))
