"""Gate arithmetic: the canary's metrics against stable's over the same interval, and the
quality gate's thresholds. Pure: parsing, deltas and verdicts, no I/O.

**SLO gates** read what each runtime pod exports on ``/metrics`` (``ladle:`` names, vLLM's
set), scraped at both ends of an analysis interval:

- requests: ``ladle:request_success`` (every finished request, by finish reason) plus
  ``ladle:request_rejected`` (refused: queue full, draining, engine dead);
- errors: refused requests plus those that finished ``abort`` (an engine error, a deadline);
- TTFT: ``ladle:time_to_first_token_seconds``; TPOT: ``ladle:request_time_per_output_token_
  seconds`` (per request, decode time over output tokens after the first, as vLLM defines it).

A pod's interval is the difference of its two scrapes; a counter that went down means the pod
restarted, and then its new values are the interval (Prometheus' ``increase`` does the same).
A pod that had no scrape at the start is left out unless it started during the interval, so
nothing before the interval ever leaks in. Variants are summed over their pods, and p95 comes
from the summed buckets by linear interpolation, as ``histogram_quantile`` computes it.

Each gate compares canary with stable as a ratio. Error rates are floored (``errorRateFloor``),
so that a clean stable does not make a single canary error an infinite ratio. A gate whose
variants saw fewer than ``minRequests`` requests (or observations) is **Inconclusive**.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ladle.api import JSON, QualityGateSpec, SLOGateSpec
from ladle.operator.revisions import base_changed, changed_adapters, weights_of
from ladle.operator.rollout_state import QUALITY, GateOutcome, Result
from ladle.runtime.eval.metrics import GATES, Gate
from ladle.runtime_metrics import REJECTED, STARTED, SUCCESS, TPOT, TTFT, samples
from ladle.words import plural

# A p95 below this counts as this: sub-millisecond latencies are bucket noise, not speed.
LATENCY_FLOOR_SECONDS = 0.001


@dataclass(frozen=True)
class Histogram:
    """Cumulative buckets ((upper bound, count), +Inf last), as Prometheus exposes them."""

    buckets: tuple[tuple[float, float], ...] = ()

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0

    def __sub__(self, other: Histogram) -> Histogram:
        before = dict(other.buckets)
        return Histogram(tuple((le, c - before.get(le, 0.0)) for le, c in self.buckets))

    def __add__(self, other: Histogram) -> Histogram:
        if not self.buckets:
            return other
        if not other.buckets:
            return self
        theirs = dict(other.buckets)
        return Histogram(tuple((le, c + theirs.get(le, 0.0)) for le, c in self.buckets))

    def quantile(self, q: float) -> float | None:
        """``histogram_quantile(q, ...)``: None without observations; the highest finite
        bound when the rank falls in the +Inf bucket."""
        total = self.count
        if total <= 0:
            return None
        rank = q * total
        lower, below = 0.0, 0.0
        for le, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(le):
                    return lower
                if cumulative == below:
                    return le
                return lower + (le - lower) * (rank - below) / (cumulative - below)
            lower, below = le, cumulative
        return lower


@dataclass(frozen=True)
class PodTotals:
    """What one pod (or a variant's pods, summed) counted, cumulatively or over an interval."""

    requests: float = 0.0
    errors: float = 0.0
    ttft: Histogram = field(default_factory=Histogram)
    tpot: Histogram = field(default_factory=Histogram)
    # process_start_time_seconds, when the pod exports it (restarts and late starts).
    started: float | None = None

    def __sub__(self, before: PodTotals) -> PodTotals:
        return PodTotals(
            self.requests - before.requests,
            self.errors - before.errors,
            self.ttft - before.ttft,
            self.tpot - before.tpot,
            self.started,
        )

    def __add__(self, other: PodTotals) -> PodTotals:
        return PodTotals(
            self.requests + other.requests,
            self.errors + other.errors,
            self.ttft + other.ttft,
            self.tpot + other.tpot,
        )

    def went_down_from(self, before: PodTotals) -> bool:
        """A counter decreased: the process restarted since ``before``."""
        pairs = [(self.requests, before.requests), (self.errors, before.errors)]
        pairs += [(self.ttft.count, before.ttft.count), (self.tpot.count, before.tpot.count)]
        return any(now < then for now, then in pairs)


def parse_metrics(text: str) -> PodTotals:
    """A runtime pod's ``/metrics`` page, summed over its label sets (model names)."""
    found = samples(text, (SUCCESS, REJECTED, STARTED, TTFT + "_bucket", TPOT + "_bucket"))
    finished = found[SUCCESS]
    rejected = sum((v for _, v in found[REJECTED]), 0.0)
    aborted = sum((v for labels, v in finished if labels.get("finished_reason") == "abort"), 0.0)

    def histogram(name: str) -> Histogram:
        table: dict[float, float] = {}
        for labels, value in found[name + "_bucket"]:
            le = float(labels["le"])
            table[le] = table.get(le, 0.0) + value
        return Histogram(tuple(sorted(table.items())))

    return PodTotals(
        requests=sum((v for _, v in finished), 0.0) + rejected,
        errors=aborted + rejected,
        ttft=histogram(TTFT),
        tpot=histogram(TPOT),
        started=found[STARTED][-1][1] if found[STARTED] else None,
    )


def interval(
    before: Mapping[str, PodTotals],
    after: Mapping[str, PodTotals],
    started: float,
) -> PodTotals:
    """One variant over an interval that began at ``started``: each pod's increase, summed.
    ``before`` and ``after`` are scrapes by pod name."""
    total = PodTotals()
    for pod, end in after.items():
        start = before.get(pod)
        if start is not None and not end.went_down_from(start):
            total += end - start
        elif start is not None or (end.started is not None and end.started >= started):
            total += end  # restarted during the interval, or started after it began
    return total


def _ratio(canary: float, stable: float, floor: float) -> float:
    return max(canary, floor) / max(stable, floor)


def _seconds(value: float) -> str:
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.2f}s"


def error_rate_gate(
    canary: PodTotals, stable: PodTotals, spec: SLOGateSpec, min_requests: int
) -> GateOutcome:
    counts = f"{canary.requests:.0f} and {stable.requests:.0f} requests"
    if min(canary.requests, stable.requests) < min_requests:
        return GateOutcome(
            "errorRate",
            "Inconclusive",
            f"error rate: too few requests ({counts}; at least {min_requests} each)",
        )
    c, s = canary.errors / canary.requests, stable.errors / stable.requests
    ratio = _ratio(c, s, spec.error_rate_floor)
    result: Result = "Pass" if ratio <= spec.max_error_rate_ratio else "Fail"
    sign = "<=" if result == "Pass" else ">"
    return GateOutcome(
        "errorRate",
        result,
        f"error rate {c:.1%} vs stable {s:.1%}: {ratio:.2f}x {sign} {spec.max_error_rate_ratio:g}x "
        f"({counts})",
    )


def latency_gate(
    gate: str,
    label: str,
    canary: Histogram,
    stable: Histogram,
    max_ratio: float,
    min_requests: int,
) -> GateOutcome:
    counts = f"{canary.count:.0f} and {stable.count:.0f} requests"
    c, s = canary.quantile(0.95), stable.quantile(0.95)
    if c is None or s is None or min(canary.count, stable.count) < min_requests:
        return GateOutcome(
            gate, "Inconclusive", f"{label}: too few requests ({counts}; at least {min_requests})"
        )
    ratio = _ratio(c, s, LATENCY_FLOOR_SECONDS)
    result: Result = "Pass" if ratio <= max_ratio else "Fail"
    sign = "<=" if result == "Pass" else ">"
    return GateOutcome(
        gate,
        result,
        f"{label} {_seconds(c)} vs stable {_seconds(s)}: {ratio:.2f}x {sign} {max_ratio:g}x "
        f"({counts})",
    )


def slo_gates(
    canary: PodTotals, stable: PodTotals, spec: SLOGateSpec, min_requests: int
) -> tuple[GateOutcome, ...]:
    """Every enabled SLO gate over one interval (a ratio of 0 turns its gate off)."""
    gates = []
    if spec.max_error_rate_ratio > 0:
        gates.append(error_rate_gate(canary, stable, spec, min_requests))
    for gate, label, ratio, c, s in (
        ("ttftP95", "TTFT p95", spec.max_ttft_p95_ratio, canary.ttft, stable.ttft),
        ("tpotP95", "TPOT p95", spec.max_tpot_p95_ratio, canary.tpot, stable.tpot),
    ):
        if ratio > 0:
            gates.append(latency_gate(gate, label, c, s, ratio, min_requests))
    return tuple(gates)


# ---- the quality gate


# A change that is not a weight format (an int8 KV cache, engine settings, a new runtime
# image) is held to int8's gate: it should change the output no more than int8 weights do.
FALLBACK_GATE = "int8"


def quality_thresholds(spec: QualityGateSpec, weights: str) -> Gate:
    """The gate for a canary whose weights are ``weights``, threshold by threshold: each one
    the spec sets, and ``ladle eval``'s gate for that quantization for each one it leaves
    unset (so setting top-1 alone keeps int4's perplexity bound)."""
    default = GATES.get(weights, GATES[FALLBACK_GATE])
    given = (spec.min_top1, spec.max_kld, spec.max_ppl_increase)
    if all(v is None for v in given):
        return default
    return Gate(
        f"{default.name}+spec",
        max_kld=default.max_kld if spec.max_kld is None else spec.max_kld,
        min_top1=default.min_top1 if spec.min_top1 is None else spec.min_top1,
        max_ppl_delta=(
            default.max_ppl_delta if spec.max_ppl_increase is None else spec.max_ppl_increase
        ),
    )


@dataclass(frozen=True)
class QualityCheck:
    """One model the quality gate compares on a stable pod and a canary pod, and its gate."""

    model: str
    gate: Gate
    adapter: bool = False

    def worded(self, message: str) -> str:
        return f"adapter {self.model}: {message}" if self.adapter else message


def quality_checks(
    stable: JSON, canary: JSON, model: str, spec: QualityGateSpec
) -> list[QualityCheck]:
    """What a canary's quality gate compares: the base model when what it serves changed (held
    to its weight format's gate), and each adapter at a new version (held to the adapter
    gate). A canary that only changes adapters leaves the base model's answers as they were."""
    checks = []
    if base_changed(stable, canary):
        checks.append(QualityCheck(model, quality_thresholds(spec, weights_of(canary))))
    adapter_gate = quality_thresholds(spec, "adapter")
    checks += [QualityCheck(a, adapter_gate, True) for a in changed_adapters(stable, canary)]
    return checks or [QualityCheck(model, quality_thresholds(spec, weights_of(canary)))]


@dataclass(frozen=True)
class QualityNumbers:
    """What an online ``ladle eval`` measured (``EvalResult``'s fields the gate reads)."""

    top1: float
    kld: float
    ppl_increase: float
    greedy: float
    prompts: int
    tokens: int

    def as_status(self) -> dict[str, float]:
        return {
            "top1Agreement": self.top1,
            "kld": self.kld,
            "perplexityIncrease": self.ppl_increase,
            "greedyAgreement": self.greedy,
            "prompts": float(self.prompts),
            "tokens": float(self.tokens),
        }


def quality_outcome(numbers: QualityNumbers, gate: Gate) -> GateOutcome:
    """Pass or Fail, worded as ``top-1 agreement 0.81 < 0.95 (KLD 0.21)``: what failed first,
    the other numbers after it."""
    checks: list[tuple[str, bool, str]] = []
    if gate.min_top1 is not None:
        ok = numbers.top1 >= gate.min_top1
        sign = ">=" if ok else "<"
        checks.append(("top1", ok, f"top-1 agreement {numbers.top1:.3g} {sign} {gate.min_top1:g}"))
    if gate.max_kld is not None:
        ok = numbers.kld <= gate.max_kld
        sign = "<=" if ok else ">"
        checks.append(("kld", ok, f"KLD {numbers.kld:.2g} {sign} {gate.max_kld:g}"))
    if gate.max_ppl_delta is not None:
        ok = numbers.ppl_increase <= gate.max_ppl_delta
        sign = "<=" if ok else ">"
        checks.append(
            (
                "ppl",
                ok,
                f"perplexity {numbers.ppl_increase:+.1%} {sign} +{gate.max_ppl_delta:.0%}",
            )
        )
    failed = [text for _, ok, text in checks if not ok]
    gated = {name for name, _, _ in checks}
    extra = [
        text
        for name, text in (
            ("top1", f"top-1 agreement {numbers.top1:.3g}"),
            ("kld", f"KLD {numbers.kld:.2g}"),
            ("ppl", f"perplexity {numbers.ppl_increase:+.1%}"),
        )
        if name not in gated
    ]
    sample = f"{plural(numbers.prompts, 'prompt')}, {plural(numbers.tokens, 'token')}"
    if failed:
        passed = [text for _, ok, text in checks if ok]
        detail = ", ".join([*passed, *extra])
        return GateOutcome(
            QUALITY, "Fail", f"{'; '.join(failed)} ({detail + '; ' if detail else ''}{sample})"
        )
    shown = [text for _, _, text in checks] + extra
    return GateOutcome(QUALITY, "Pass", f"{', '.join(shown)} ({sample})")


def variant_pods(names: Iterable[str], scraped: Mapping[str, PodTotals]) -> dict[str, PodTotals]:
    """The scrapes of ``names`` that succeeded."""
    return {n: scraped[n] for n in names if n in scraped}


def sum_pods(pods: Sequence[PodTotals]) -> PodTotals:
    total = PodTotals()
    for pod in pods:
        total += pod
    return total
