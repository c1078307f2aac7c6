"""OpenTelemetry traces for the gateway and the runtime: W3C trace context in and out, spans
made from the timings each already keeps, and an export queue that never holds up a request
and counts what it drops.

Tracing is off unless an OTLP endpoint is given; callers then hold no ``Tracing`` at all, so
nothing here runs per request (nor is this module imported). Spans go out over OTLP/HTTP in
batches from one background thread. A collector that is down costs a request nothing: a full
queue drops the newest span, a failed export drops its batch, and both are counted.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("ladle.tracing")

_PROPAGATOR = TraceContextTextMapPropagator()
# Both components time requests with the monotonic clock; spans want wall-clock nanoseconds.
_EPOCH_NS = time.time_ns() - time.monotonic_ns()
# The SDK's BatchSpanProcessor defaults.
MAX_QUEUE = 2048
MAX_BATCH = 512
EXPORT_INTERVAL_SECONDS = 5.0
EXPORT_TIMEOUT_SECONDS = 10.0

Attributes = Mapping[str, AttributeValue]


def wall_ns(monotonic: float) -> int:
    """A ``time.monotonic()`` (or default event-loop) time as epoch nanoseconds."""
    return _EPOCH_NS + round(monotonic * 1e9)


class ExportQueue(SpanProcessor):
    """Ended spans, exported in batches by one daemon thread: ``on_end`` never blocks or
    raises. ``dropped`` counts the spans lost to a full queue or a failed export."""

    def __init__(self, exporter: SpanExporter, interval: float = EXPORT_INTERVAL_SECONDS) -> None:
        self.exporter = exporter
        self.interval = interval
        self.dropped = 0
        self.exported = 0
        self._spans: collections.deque[ReadableSpan] = collections.deque()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="ladle-trace-export", daemon=True)
        self._thread.start()

    def on_end(self, span: ReadableSpan) -> None:
        if len(self._spans) >= MAX_QUEUE:
            self.dropped += 1
            return
        self._spans.append(span)
        if len(self._spans) >= MAX_BATCH:
            self._wake.set()

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(self.interval)
            self._wake.clear()
            self._drain()

    def _drain(self) -> None:
        while self._spans:
            batch = [self._spans.popleft() for _ in range(min(MAX_BATCH, len(self._spans)))]
            try:
                result = self.exporter.export(batch)
            except Exception:  # an exporter must not take the thread down with it
                log.exception("trace export failed")
                result = SpanExportResult.FAILURE
            if result is SpanExportResult.SUCCESS:
                self.exported += len(batch)
            else:
                self.dropped += len(batch)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self._wake.set()
        deadline = time.monotonic() + timeout_millis / 1000
        while self._spans and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._spans

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(EXPORT_TIMEOUT_SECONDS)
        self._drain()
        self.exporter.shutdown()


@dataclass
class Tracing:
    """One component's tracer and its export queue."""

    tracer: trace.Tracer
    queue: ExportQueue
    provider: TracerProvider = field(repr=False)

    def server(
        self,
        name: str,
        start: float,
        headers: Iterable[tuple[bytes, bytes]],
        attributes: Attributes | None = None,
    ) -> Span:
        """A request's span from ``start`` (monotonic seconds), under the trace its
        ``traceparent`` names; one that does not parse starts a new trace, as the W3C
        recommendation says."""
        carrier = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in headers
            if k in (b"traceparent", b"tracestate")
        }
        parent = _PROPAGATOR.extract(carrier) if carrier else None
        return self.tracer.start_span(
            name, parent, SpanKind.SERVER, attributes, start_time=wall_ns(start)
        )

    def child(
        self,
        name: str,
        start: float,
        parent: Span,
        attributes: Attributes | None = None,
        client: bool = False,
    ) -> Span:
        """A span from ``start`` under ``parent``; ``client`` for a call to another service."""
        return self.tracer.start_span(
            name,
            trace.set_span_in_context(parent),
            SpanKind.CLIENT if client else SpanKind.INTERNAL,
            attributes,
            start_time=wall_ns(start),
        )

    @staticmethod
    def traceparent(span: Span) -> list[tuple[bytes, bytes]]:
        """The headers that carry ``span``'s context to the next hop."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, trace.set_span_in_context(span))
        return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in carrier.items()]

    @staticmethod
    def end(span: Span, at: float) -> None:
        """End ``span`` at ``at`` (monotonic seconds) rather than now."""
        span.end(wall_ns(at))

    def record(
        self,
        name: str,
        start: float | None,
        end: float | None,
        parent: Span,
        attributes: Attributes | None = None,
    ) -> None:
        """A finished span from times already measured; nothing when either is missing (a
        phase the request never reached)."""
        if start is None or end is None or not parent.is_recording():
            return
        self.child(name, start, parent, attributes).end(wall_ns(max(start, end)))

    def dropped_metric(self, name: str) -> Collector:
        """A Prometheus counter ``name`` of the spans this component dropped."""
        queue = self.queue

        class Dropped(Collector):
            def collect(self) -> Iterator[Metric]:
                yield CounterMetricFamily(
                    name,
                    "Trace spans dropped: a full export queue or a failed export.",
                    value=queue.dropped,
                )

        return Dropped()

    def close(self) -> None:
        self.provider.shutdown()


def start_tracing(service_name: str, endpoint: str, ratio: float) -> Tracing:
    """Tracing to the OTLP/HTTP ``endpoint`` (the collector's base URL), sampling new traces
    at ``ratio`` and following the caller's decision for traces that arrive sampled or not."""
    exporter = OTLPSpanExporter(
        endpoint=f"{endpoint.rstrip('/')}/v1/traces", timeout=EXPORT_TIMEOUT_SECONDS
    )
    queue = ExportQueue(exporter)
    provider = TracerProvider(
        sampler=ParentBased(TraceIdRatioBased(ratio)),
        resource=Resource.create({"service.name": service_name}),
    )
    provider.add_span_processor(queue)
    return Tracing(provider.get_tracer("ladle"), queue, provider)
