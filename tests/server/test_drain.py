"""SIGTERM: readiness turns 503 at once, new requests get 503, in-flight ones finish (or are
aborted at the drain timeout), and the process exits 0."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from typing import Any

import httpx

from ladle_dev.pytest_plugin import wait_until

from .conftest import start_server

# The long request asks for more tokens than any CPU decodes within the drain timeout (the
# default model decodes tens of tokens a second here), so it is still running when the drain
# ends, however fast the machine; its cache is sized to hold them.
LONG = 4000


def test_sigterm_drains_then_exits_zero(tmp_path: Path) -> None:
    # Long enough for the short request to finish even on a busy machine.
    server = start_server(
        tmp_path, "--drain-timeout", "15", "--max-model-len", "4096", "--kv-cache-memory", "256MiB"
    )
    results: dict[str, Any] = {}

    def run(name: str, max_tokens: int) -> None:
        body = {"prompt": "Count: 1, 2, 3,", "max_tokens": max_tokens, "ignore_eos": True}
        results[name] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)

    short = threading.Thread(target=run, args=("short", 3))
    long = threading.Thread(target=run, args=("long", LONG))
    long.start()
    short.start()
    server.wait_metric("ladle:num_requests_running", 2)
    server.proc.send_signal(signal.SIGTERM)

    wait_until(
        lambda: httpx.get(f"{server.url}/health/ready").status_code == 503,
        "readiness to turn 503",
        30,
        interval=0.05,
    )
    assert httpx.get(f"{server.url}/health/ready").json() == {"status": "draining"}
    assert httpx.get(f"{server.url}/health/live").status_code == 200
    refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "draining"
    assert refused.json()["error"]["type"] == "service_unavailable_error"
    # A keep-alive client is told to reconnect, so its next request can find another replica.
    assert refused.headers["connection"] == "close"

    short.join()
    long.join()
    assert server.proc.wait(timeout=60) == 0
    assert results["short"].status_code == 200
    assert results["short"].json()["choices"][0]["finish_reason"] == "length"
    # Still running at the timeout: aborted, and answered with what it had.
    assert results["long"].status_code == 200
    aborted = results["long"].json()["choices"][0]
    assert aborted["finish_reason"] == "abort"
    assert 0 < results["long"].json()["usage"]["completion_tokens"] < LONG
    records = [json.loads(line) for line in server.log_lines() if line.startswith("{")]
    messages = {r["message"]: r for r in records}
    assert messages["draining"]["in_flight"] == 2
    assert messages["drain timeout; aborting requests"]["aborted"] == 1
