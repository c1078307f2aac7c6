"""OpenTelemetry traces from the client through ``ladle gateway`` to ``ladle serve``, read back
from a real Jaeger (built from its pinned Go module) over its query API: the span tree, the
attributes, and timings that add up to what the client measured.

Every process here is real: Jaeger takes OTLP/HTTP, the gateway routes from a static file to
one runtime, and the client is the ``openai`` package."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from ladle_dev.cluster import jaeger
from ladle_dev.cluster.jaeger import Jaeger
from ladle_dev.pytest_plugin import wait_until

from .conftest import SERVE_FLAGS, Process, free_port, start_ladle

pytestmark = pytest.mark.slow

MODEL = "traced"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Jaeger]:
    try:
        found = jaeger.start(tmp_path_factory.mktemp("jaeger"))
    except FileNotFoundError as err:
        pytest.fail(str(err))
    yield found
    found.stop()


@pytest.fixture(scope="module")
def traced(collector: Jaeger, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    """A runtime and a gateway in front of it, both tracing to the collector."""
    folder = tmp_path_factory.mktemp("traced")
    tracing = ("--otlp-traces-endpoint", collector.otlp)
    port = free_port()
    runtime = start_ladle(
        folder / "serve.log",
        "serve", "--port", str(port), "--served-model-name", MODEL, *SERVE_FLAGS, *tracing,
        port=port,
    )  # fmt: skip
    routes = folder / "routes.yaml"
    routes.write_text(
        yaml.safe_dump({"services": [{"name": MODEL, "model": MODEL, "endpoints": [runtime.url]}]})
    )
    gateway_port = free_port()
    gateway = start_ladle(
        folder / "gateway.log",
        "gateway", "--static", str(routes), "--port", str(gateway_port), *tracing,
        port=gateway_port,
    )  # fmt: skip
    yield gateway
    gateway.stop()
    runtime.stop()


def test_a_streamed_chat_completion_is_one_trace_from_gateway_to_engine(
    collector: Jaeger, traced: Process
) -> None:
    client = openai.OpenAI(base_url=f"{traced.url}/v1", api_key="none", max_retries=0)
    parent = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
    started = time.monotonic()
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=12,
        stream=True,
        extra_headers={"traceparent": parent, "x-request-id": "traced-1"},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    measured = time.monotonic() - started
    assert text

    names = {
        "POST /v1/chat/completions@ladle-gateway", "gateway.route", "upstream",
        "POST /v1/chat/completions@ladle-runtime", "engine.request", "engine.queue",
        "engine.prefill", "engine.decode", "stream",
    }  # fmt: skip

    def complete() -> list[dict[str, Any]] | None:
        spans = collector.trace(TRACE_ID)
        if spans is None:
            return None
        have = {
            f"{s['operationName']}@{s['service']}" if s["operationName"].startswith("POST") else
            s["operationName"]
            for s in spans
        }  # fmt: skip
        return spans if names <= have else None

    # Both components export every 5 s; a minute covers a slow machine.
    spans = wait_until(complete, "every span of the trace in Jaeger", 60)
    by_id = {s["spanID"]: s for s in spans}

    def one(name: str, service: str | None = None) -> dict[str, Any]:
        (found,) = [
            s for s in spans
            if s["operationName"] == name and (service is None or s["service"] == service)
        ]  # fmt: skip
        return found

    gateway = one("POST /v1/chat/completions", "ladle-gateway")
    runtime = one("POST /v1/chat/completions", "ladle-runtime")
    upstream = one("upstream")
    engine = one("engine.request")
    # The client's traceparent is the root's parent; the tree runs gateway → attempt → pod →
    # engine → phases.
    assert gateway["parent"] == "00f067aa0ba902b7"
    assert one("gateway.route")["parent"] == gateway["spanID"]
    assert upstream["parent"] == gateway["spanID"]
    assert runtime["parent"] == upstream["spanID"]
    assert engine["parent"] == runtime["spanID"]
    for phase in ("engine.queue", "engine.prefill", "engine.decode", "stream"):
        assert one(phase)["parent"] == engine["spanID"], phase
    assert {by_id[s["parent"]]["service"] for s in spans if s["parent"] in by_id} == {
        "ladle-gateway",
        "ladle-runtime",
    }
    # The request id is on both sides; the decode says how many tokens it made.
    assert gateway["tags"]["ladle.request_id"] == "traced-1"
    assert runtime["tags"]["ladle.request_id"] == "traced-1"
    assert engine["tags"]["ladle.request_id"] == "traced-1"
    assert one("engine.decode")["tags"]["gen_ai.usage.output_tokens"] == 12
    assert gateway["tags"]["http.response.status_code"] == 200
    assert upstream["tags"]["ladle.outcome"] == "ok"

    # Timings: the gateway's span is the client's latency, within 10%; the engine's phases
    # follow one another and add up to the engine request.
    seconds = gateway["duration"] / 1e6
    assert abs(seconds - measured) <= 0.1 * measured, (seconds, measured)
    phases = [one(n) for n in ("engine.queue", "engine.prefill", "engine.decode", "stream")]
    for before, after in itertools.pairwise(phases):
        assert before["startTime"] + before["duration"] <= after["startTime"] + 1
    total = sum(p["duration"] for p in phases)
    assert abs(total - engine["duration"]) <= 0.1 * engine["duration"] + 1000


def test_a_malformed_traceparent_starts_a_new_trace_and_is_no_error(traced: Process) -> None:
    answer = httpx.post(
        f"{traced.url}/v1/completions",
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
        headers={"traceparent": "00-not-a-trace-01"},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text


def test_a_collector_that_is_down_costs_requests_nothing_and_drops_are_counted(
    tmp_path: Path,
) -> None:
    """Traces to a port where nothing listens: requests are answered as fast as ever, and the
    spans that could not go out are counted on the runtime's /metrics."""
    port = free_port()
    runtime = start_ladle(
        tmp_path / "serve.log",
        "serve", "--port", str(port), "--served-model-name", MODEL, *SERVE_FLAGS,
        "--otlp-traces-endpoint", f"http://127.0.0.1:{free_port()}",
        port=port,
    )  # fmt: skip
    try:
        for _ in range(3):
            answer = httpx.post(
                f"{runtime.url}/v1/completions",
                json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                timeout=30,
            )
            assert answer.status_code == 200, answer.text

        def dropped() -> float | None:
            page = httpx.get(f"{runtime.url}/metrics", timeout=5).text
            for line in page.splitlines():
                if line.startswith("ladle:trace_spans_dropped_total "):
                    value = float(line.split()[1])
                    return value if value >= 18 else None
            raise AssertionError("no ladle:trace_spans_dropped_total on /metrics")

        # Three requests of six spans each, lost in the first export or two (5 s apart, so a
        # slow machine may send the last request's spans in the second).
        wait_until(dropped, "the dropped spans of all three requests to be counted", 30)
    finally:
        runtime.stop()
