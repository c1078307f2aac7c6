"""On-demand profiling of a live ``ladle serve`` process: a trace written under concurrent load,
the key required, clear errors when off or out of order, and no start without a key."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from ladle.runtime.profiler import EngineProfiler

from .conftest import Server, start_server

KEY = "sk-profile-000001"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def profiled(
    tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, Path]]:
    folder = tmp_path_factory.mktemp("profile")
    traces = folder / "traces"
    server = start_server(
        folder,
        *("--model", str(tiny_model_path), "--served-model-name", "tiny"),
        *("--api-key", KEY, "--profile-dir", str(traces)),
    )
    try:
        yield server, traces
    finally:
        server.stop()


def _error(response: httpx.Response) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["code"]


def test_a_trace_of_live_traffic_and_the_key_is_required(profiled: tuple[Server, Path]) -> None:
    server, traces = profiled
    assert httpx.post(f"{server.url}/start_profile", timeout=30).status_code == 401
    assert _error(httpx.post(f"{server.url}/stop_profile", headers=AUTH, timeout=30)) == (
        409,
        "profiler_state",
    )

    started = httpx.post(f"{server.url}/start_profile", headers=AUTH, timeout=30)
    assert started.json() == {"status": "started", "trace": None}
    again = httpx.post(f"{server.url}/start_profile", headers=AUTH, timeout=30)
    assert _error(again) == (409, "profiler_state")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)

    def one(i: int) -> int:
        out = client.completions.create(
            model="tiny", prompt=f"Request {i}:", max_tokens=8, temperature=0
        )
        assert out.usage is not None
        return out.usage.completion_tokens

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(one, range(4))) == [8] * 4
    assert httpx.post(f"{server.url}/stop_profile", timeout=30).status_code == 401
    stopped = httpx.post(f"{server.url}/stop_profile", headers=AUTH, timeout=120)
    assert stopped.status_code == 200, stopped.text
    trace = Path(stopped.json()["trace"])
    assert trace.parent == traces
    assert [p.name for p in traces.iterdir()] == [trace.name]  # no partial file left
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    names = {e.get("name") for e in events}
    assert "aten::mm" in names or "aten::linear" in names  # the engine thread's model ops
    # Serving goes on after the trace, and a second profile can start.
    assert one(9) == 8
    assert httpx.post(f"{server.url}/start_profile", headers=AUTH, timeout=30).status_code == 200
    assert httpx.post(f"{server.url}/stop_profile", headers=AUTH, timeout=120).status_code == 200
    assert len(list(traces.iterdir())) == 2


def test_a_profile_stops_itself_at_the_cap(tiny_model_path: Path, tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    server = start_server(
        tmp_path,
        *("--model", str(tiny_model_path), "--api-key", KEY),
        *("--profile-dir", str(traces), "--profile-max-seconds", "0.5"),
    )
    try:
        started = httpx.post(f"{server.url}/start_profile", headers=AUTH, timeout=30)
        assert started.status_code == 200, started.text
        deadline = time.monotonic() + 60
        while not list(traces.glob("*.pt.trace.json.gz")) and time.monotonic() < deadline:
            time.sleep(0.1)
        (trace,) = traces.iterdir()  # written whole, with no stop asked for
        json.loads(gzip.decompress(trace.read_bytes()))
        late = httpx.post(f"{server.url}/stop_profile", headers=AUTH, timeout=30)
        assert _error(late) == (409, "profiler_state")
        message = late.json()["error"]["message"]
        assert "stopped itself after 0.5 s (--profile-max-seconds)" in message
        assert str(trace) in message
    finally:
        server.stop()


def test_the_cap_of_a_profile_stopped_by_hand_leaves_the_next_one_alone(tmp_path: Path) -> None:
    profiler = EngineProfiler(tmp_path, max_seconds=5)
    first = profiler.start()
    profiler.stop()
    second = profiler.start()
    assert profiler.stop_session(first) is None  # the first one's cap fires: nothing to do
    assert profiler.running
    stopped = profiler.stop_session(second)
    assert stopped is not None
    assert not profiler.running
    assert profiler.stop_session(second) is None


def test_off_by_default(tiny_model_path: Path, tmp_path: Path) -> None:
    server = start_server(tmp_path, "--model", str(tiny_model_path), "--api-key", KEY)
    try:
        response = httpx.post(f"{server.url}/start_profile", headers=AUTH, timeout=30)
        assert _error(response) == (404, "profiling_disabled")
        assert "--profile-dir" in response.json()["error"]["message"]
    finally:
        server.stop()


def test_refuses_to_start_without_a_key(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ladle.cli", "serve", "--profile-dir", str(tmp_path / "t")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "ladle serve: profile-dir needs --api-key or --api-key-file: the profiler endpoints "
        "must not be open to anyone who can reach the port"
    ]
    assert not (tmp_path / "t").exists()
