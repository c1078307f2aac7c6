"""Gate arithmetic (``operator/analysis.py``): the runtime's own metrics page parsed, interval
deltas across restarts and late pods, p95 as histogram_quantile computes it, ratios with their
floors and minimum-sample rules, and the quality gate's thresholds and words."""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest

from ladle.api import QualityGateSpec, SLOGateSpec
from ladle.operator.analysis import (
    Histogram,
    PodTotals,
    QualityCheck,
    QualityNumbers,
    error_rate_gate,
    interval,
    latency_gate,
    parse_metrics,
    quality_checks,
    quality_outcome,
    quality_thresholds,
    slo_gates,
)
from ladle.runtime.config import EngineArgs
from ladle.runtime.eval.metrics import GATES, Gate


class RuntimePage:
    """A runtime pod's real ``ServerMetrics`` (an engine stand-in only for its gauges), fed
    finished requests with chosen timings, rendered as its /metrics page."""

    def __init__(self) -> None:
        from ladle.runtime.server.adapters import ServedAdapters
        from ladle.runtime.server.metrics import ServerMetrics

        stats = SimpleNamespace(
            num_running=0, num_waiting=0, kv_cache_usage=0.0, prefix_cache_queries=0,
            prefix_cache_hits=0, num_preemptions=0, num_blocks=64,
        )  # fmt: skip
        engine = SimpleNamespace(
            served_model_name="smollm2",
            max_model_len=512,
            args=EngineArgs(max_num_batched_tokens=512),
            iteration_observers=[],
            stats=lambda: stats,
            lora=None,
        )
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # as the server's registry has
        self.metrics = ServerMetrics(self.registry, engine, ServedAdapters())  # type: ignore[arg-type]

    def request(
        self, ttft: float, tokens: int = 5, tpot: float = 0.02, error: bool = False
    ) -> None:
        from ladle.runtime.server.metrics import RequestRecord

        record = RequestRecord("r", "e", "/v1/completions", False, 4, {}, arrival=100.0)
        record.first_scheduled = 100.0
        record.first_token = 100.0 + ttft
        record.last_token = record.first_token + tpot * (tokens - 1)
        record.finished = record.last_token
        record.completion_tokens = tokens
        if error:
            record.error = "RuntimeError('boom')"
        else:
            record.finish_reasons[0] = "length"
        self.metrics.finished(record)

    def refuse(self) -> None:
        self.metrics.rejected("queue_full")

    def scrape(self) -> PodTotals:
        return parse_metrics(generate_latest(self.registry).decode())


def test_the_runtime_page_parses_into_requests_errors_and_both_histograms() -> None:
    page = RuntimePage()
    for ttft in (0.1, 0.2, 0.3):
        page.request(ttft)
    page.request(0.2, error=True)
    page.refuse()
    page.request(0.05, tokens=1)  # one token: no TPOT
    scraped = page.scrape()
    assert scraped.requests == 6
    assert scraped.errors == 2
    assert scraped.ttft.count == 5  # a refused request has no first token
    assert scraped.tpot.count == 4
    assert scraped.started is not None  # process_start_time_seconds, for late pods


def test_quantile_interpolates_within_buckets_as_histogram_quantile_does() -> None:
    # 10 observations: 4 up to 0.1 s, 5 more up to 0.2 s, 1 more up to 0.5 s.
    hist = Histogram(((0.1, 4.0), (0.2, 9.0), (0.5, 10.0), (math.inf, 10.0)))
    assert hist.quantile(0.5) == pytest.approx(0.1 + 0.1 * (5 - 4) / 5)
    assert hist.quantile(0.95) == pytest.approx(0.2 + 0.3 * (9.5 - 9) / 1)
    assert hist.quantile(0.2) == pytest.approx(0.05)  # the first bucket starts at 0
    assert Histogram(((0.1, 0.0), (math.inf, 0.0))).quantile(0.95) is None
    # Beyond the last finite bucket: its bound, as Prometheus answers.
    assert Histogram(((0.1, 1.0), (math.inf, 5.0))).quantile(0.95) == 0.1


def test_interval_is_the_increase_whatever_pods_did_meanwhile() -> None:
    steady, restarted, late, unknown = RuntimePage(), RuntimePage(), RuntimePage(), RuntimePage()
    for page in (steady, restarted, unknown):
        for _ in range(10):
            page.request(1.0)  # slow requests before the interval: they must not count
    before = {"steady": steady.scrape(), "restarted": restarted.scrape()}
    began = 5_000.0
    for _ in range(3):
        steady.request(0.1)
        late.request(0.1)
        unknown.request(0.1)
    fresh = RuntimePage()  # the restarted pod's new process: counters from zero
    fresh.request(0.1)
    after = {
        "steady": steady.scrape(),
        "restarted": fresh.scrape(),
        "late": replace(late.scrape(), started=began + 2),
        "unknown": replace(unknown.scrape(), started=began - 60),
    }
    total = interval(before, after, began)
    # steady: 3; restarted: its 1 since the restart; late (started after the baseline): 3;
    # unknown (running before the interval, never scraped at its start): left out.
    assert total.requests == 7
    assert total.ttft.count == 7
    assert total.ttft.quantile(0.95) is not None
    assert total.ttft.quantile(0.95) <= 0.1  # none of the slow requests leaked in


def test_error_rate_is_floored_and_needs_enough_requests() -> None:
    spec = SLOGateSpec()
    clean = PodTotals(requests=100, errors=0)
    assert error_rate_gate(PodTotals(requests=40, errors=0), clean, spec, 20).result == "Pass"
    # One error in 100 against a clean stable is 1% against the 1% floor: ratio 1.
    assert error_rate_gate(PodTotals(requests=100, errors=1), clean, spec, 20).result == "Pass"
    failing = error_rate_gate(PodTotals(requests=24, errors=24), clean, spec, 20)
    assert failing.result == "Fail"
    assert failing.message == (
        "error rate 100.0% vs stable 0.0%: 100.00x > 2x (24 and 100 requests)"
    )
    thin = error_rate_gate(PodTotals(requests=3, errors=3), clean, spec, 20)
    assert thin.result == "Inconclusive"
    assert "too few requests (3 and 100 requests; at least 20 each)" in thin.message


def test_latency_gates_compare_p95_of_the_interval_as_ratios() -> None:
    canary, stable = RuntimePage(), RuntimePage()
    for i in range(40):
        stable.request(0.1 + 0.001 * i, tpot=0.02)
        canary.request(0.4 + 0.004 * i, tpot=0.021)
    gates = {g.gate: g for g in slo_gates(canary.scrape(), stable.scrape(), SLOGateSpec(), 20)}
    assert gates["errorRate"].result == "Pass"
    assert gates["ttftP95"].result == "Fail"
    assert gates["ttftP95"].message.startswith("TTFT p95 ")
    assert "> 1.5x (40 and 40 requests)" in gates["ttftP95"].message
    assert gates["tpotP95"].result == "Pass"
    # A ratio of 0 turns its gate off.
    off = SLOGateSpec(max_ttft_p95_ratio=0, max_tpot_p95_ratio=0)
    assert [g.gate for g in slo_gates(canary.scrape(), stable.scrape(), off, 20)] == ["errorRate"]


def test_a_latency_gate_with_observations_but_fewer_than_min_requests_is_inconclusive() -> None:
    """A p95 can be computed from a handful of observations; it is not judged on them. Three
    slow canary requests would be a 10x TTFT ratio, and one-token requests leave TPOT with
    fewer observations than requests."""
    canary, stable = RuntimePage(), RuntimePage()
    for _ in range(3):
        canary.request(2.0)
    for _ in range(27):
        canary.request(0.1, tokens=1)  # counted as requests, no TPOT observation
    for _ in range(40):
        stable.request(0.1)
    c, s = canary.scrape(), stable.scrape()
    assert (c.requests, c.ttft.count, c.tpot.count) == (30, 30, 3)
    assert c.tpot.quantile(0.95) is not None  # observations enough for a number
    gates = {g.gate: g for g in slo_gates(c, s, SLOGateSpec(), 20)}
    assert gates["errorRate"].result == "Pass"
    assert gates["ttftP95"].result == "Fail"  # 30 observations: judged
    assert gates["tpotP95"].result == "Inconclusive"
    assert gates["tpotP95"].message == "TPOT p95: too few requests (3 and 40 requests; at least 20)"
    # The same few observations on the TTFT side alone: inconclusive, not a 10x failure.
    few = Histogram(((0.25, 0.0), (2.5, 3.0), (math.inf, 3.0)))
    many = Histogram(((0.25, 40.0), (2.5, 40.0), (math.inf, 40.0)))
    assert few.quantile(0.95) is not None
    thin = latency_gate("ttftP95", "TTFT p95", few, many, 1.5, 20)
    assert thin.result == "Inconclusive"
    assert thin.message == "TTFT p95: too few requests (3 and 40 requests; at least 20)"
    # Either side: a stable with too few observations holds the gate just the same.
    assert latency_gate("ttftP95", "TTFT p95", many, few, 1.5, 20).result == "Inconclusive"
    assert latency_gate("ttftP95", "TTFT p95", few, many, 1.5, 3).result == "Fail"


def test_an_erroring_canary_fails_on_errors_even_without_latencies() -> None:
    canary, stable = RuntimePage(), RuntimePage()
    for _ in range(30):
        canary.refuse()
        stable.request(0.1)
    results = {
        g.gate: g.result for g in slo_gates(canary.scrape(), stable.scrape(), SLOGateSpec(), 20)
    }
    assert results == {"errorRate": "Fail", "ttftP95": "Inconclusive", "tpotP95": "Inconclusive"}


def test_quality_defaults_follow_the_quantization() -> None:
    assert quality_thresholds(QualityGateSpec(), "int8") == GATES["int8"]
    assert quality_thresholds(QualityGateSpec(), "int4") == GATES["int4"]
    # Anything else (an int8 KV cache, engine settings, a new image) is held to int8's.
    assert quality_thresholds(QualityGateSpec(), "none") == GATES["int8"]


def test_the_quality_gate_compares_the_base_model_and_each_adapter_at_a_new_version() -> None:
    from ladle.operator.revisions import template_of

    def template(**spec: Any) -> dict[str, Any]:
        return template_of({"model": {"name": "m"}, **spec}, "img:1")

    def lora(path: str) -> list[dict[str, Any]]:
        return [
            {"name": "sql", "source": {"image": {"path": path}}},
            {"name": "fr", "source": {"image": {"path": "/fr"}}},
        ]

    spec = QualityGateSpec()
    v1, v2 = template(adapters=lora("/sql/v1")), template(adapters=lora("/sql/v2"))
    # Only an adapter's version: that adapter alone, held to the adapter gate (a new version
    # may answer differently; it may not read the text much worse).
    assert quality_checks(v1, v2, "m", spec) == [QualityCheck("sql", GATES["adapter"], True)]
    assert GATES["adapter"] == Gate("adapter", max_ppl_delta=0.1)
    # The weights too: the base model under int8's gate first, then the adapter.
    int8 = template(adapters=lora("/sql/v2"), quantization={"weights": "int8"})
    assert quality_checks(v1, int8, "m", spec) == [
        QualityCheck("m", GATES["int8"]),
        QualityCheck("sql", GATES["adapter"], True),
    ]
    # Thresholds the spec sets hold for adapters as well.
    strict = quality_checks(v1, v2, "m", QualityGateSpec(max_ppl_increase=0.02))
    assert strict[0].gate.max_ppl_delta == 0.02
    assert QualityCheck("sql", GATES["adapter"], True).worded("x") == "adapter sql: x"


def test_each_threshold_left_unset_keeps_the_quantizations_default() -> None:
    """Setting one threshold replaces that one alone: an int4 canary that states only its
    top-1 agreement is still held to int4's perplexity bound."""
    own = quality_thresholds(QualityGateSpec(min_top1=0.95), "int4")
    assert (own.min_top1, own.max_kld, own.max_ppl_delta) == (0.95, None, 0.05)
    # A canary whose top-1 passes the stated bound but whose perplexity went up 40% fails.
    numbers = QualityNumbers(
        top1=0.96, kld=0.05, ppl_increase=0.4, greedy=0.5, prompts=8, tokens=600
    )
    failed = quality_outcome(numbers, own)
    assert failed.result == "Fail"
    assert failed.message.startswith("perplexity +40.0% > +5% (top-1 agreement 0.96 >= 0.95")
    # int8's gate: KLD and top-1; setting KLD keeps the top-1 bound, and adds no perplexity.
    kld = quality_thresholds(QualityGateSpec(max_kld=0.02), "int8")
    assert (kld.min_top1, kld.max_kld, kld.max_ppl_delta) == (0.97, 0.02, None)
    # A threshold the default does not have is added; the fallback (int8's) fills the rest.
    ppl = quality_thresholds(QualityGateSpec(max_ppl_increase=0.1), "none")
    assert (ppl.min_top1, ppl.max_kld, ppl.max_ppl_delta) == (0.97, 0.005, 0.1)
    every = QualityGateSpec(min_top1=0.5, max_kld=1.0, max_ppl_increase=2.0)
    gate = quality_thresholds(every, "int4")
    assert (gate.min_top1, gate.max_kld, gate.max_ppl_delta) == (0.5, 1.0, 2.0)


def test_quality_outcome_names_what_failed_with_the_numbers() -> None:
    numbers = QualityNumbers(
        top1=0.81, kld=0.21, ppl_increase=0.4, greedy=0.1, prompts=8, tokens=600
    )
    failed = quality_outcome(numbers, Gate("t", min_top1=0.95))
    assert failed.result == "Fail"
    assert failed.message.startswith("top-1 agreement 0.81 < 0.95 (KLD 0.21")
    assert "8 prompts, 600 tokens" in failed.message
    good = QualityNumbers(top1=0.99, kld=0.001, ppl_increase=0.002, greedy=1, prompts=8, tokens=600)
    passed = quality_outcome(good, Gate("t", min_top1=0.97, max_kld=0.005))
    assert passed.result == "Pass"
    assert passed.message.startswith("top-1 agreement 0.99 >= 0.97, KLD 0.001 <= 0.005")
    both = quality_outcome(numbers, Gate("t", min_top1=0.97, max_kld=0.005, max_ppl_delta=0.05))
    assert both.message.startswith("top-1 agreement 0.81 < 0.97; KLD 0.21 > 0.005; perplexity")
