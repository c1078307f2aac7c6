"""Failures a healthy process cannot show: an unexpected exception (500 with the request id,
and the server keeps serving), one request failing inside the engine (500 for it alone), an
engine loop that hangs, spins without progress or dies (liveness fails), and a dying engine
taking the server process with it.

The app runs in this process under uvicorn, around an engine whose methods the tests break.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest

from ladle.runtime import EngineArgs
from ladle.runtime.engine import LLMEngine
from ladle.runtime.scheduler_output import SchedulerOutput
from ladle.runtime.sequence import Sequence

from .conftest import serve_in_thread, start_server

BODY = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineArgs(kv_cache_memory=32 << 20, max_model_len=256))


@contextmanager
def running(engine: LLMEngine, liveness_timeout: float = 60.0) -> Iterator[str]:
    with serve_in_thread(engine, liveness_timeout=liveness_timeout) as srv:
        yield srv.url


def wait_status(url: str, status: int, timeout: float = 30.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while (response := httpx.get(url)).status_code != status:
        assert time.monotonic() < deadline, f"{url} stayed {response.status_code}"
        time.sleep(0.05)
    return response


def test_unexpected_error_is_500_with_request_id_and_serving_continues(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    with running(engine) as url:
        original: Callable[..., object] = engine.process_inputs

        def broken(*args: object, **kwargs: object) -> object:
            raise RuntimeError("a bug")

        monkeypatch.setattr(engine, "process_inputs", broken)
        failed = httpx.post(
            f"{url}/v1/completions", json=BODY, headers={"X-Request-Id": "bug-report-7"}
        )
        assert failed.status_code == 500
        assert failed.headers["x-request-id"] == "bug-report-7"
        error = failed.json()["error"]
        assert error["type"] == "server_error"
        assert "bug-report-7" in error["message"]
        assert "a bug" not in error["message"]  # internals stay in the log

        monkeypatch.setattr(engine, "process_inputs", original)
        assert httpx.post(f"{url}/v1/completions", json=BODY).status_code == 200


def test_hung_engine_step_fails_liveness(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    step = engine.step

    def hanging_step() -> object:
        release.wait(timeout=60)
        return step()

    with running(engine, liveness_timeout=0.5) as url:
        assert httpx.get(f"{url}/health/live").status_code == 200
        monkeypatch.setattr(engine, "step", hanging_step)
        request = threading.Thread(
            target=httpx.post, args=(f"{url}/v1/completions",), kwargs={"json": BODY, "timeout": 60}
        )
        request.start()
        stuck = wait_status(f"{url}/health/live", 503)
        assert "inside one step" in stuck.json()["status"]
        assert httpx.get(f"{url}/health/ready").status_code == 503
        release.set()
        request.join()
        wait_status(f"{url}/health/live", 200)


def test_engine_without_progress_fails_liveness(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watchdog: a loop that keeps stepping (its heartbeat is fresh) but schedules nothing
    while a request waits turns /health/live red, and green again once work moves."""
    with running(engine, liveness_timeout=0.5) as url:
        monkeypatch.setattr(engine.scheduler, "schedule", SchedulerOutput)
        request = threading.Thread(
            target=httpx.post, args=(f"{url}/v1/completions",), kwargs={"json": BODY, "timeout": 60}
        )
        request.start()
        stuck = wait_status(f"{url}/health/live", 503)
        assert "no progress" in stuck.json()["status"]
        monkeypatch.undo()
        request.join()
        wait_status(f"{url}/health/live", 200)


def test_a_request_failing_in_the_engine_is_500_alone(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_stop = engine.scheduler._check_stop

    def check(seq: Sequence, token: int) -> None:
        if seq.params.max_tokens == 3:  # the poisoned request
            raise RuntimeError("scheduler bug")
        check_stop(seq, token)

    monkeypatch.setattr(engine.scheduler, "_check_stop", check)
    with running(engine) as url:
        failed = httpx.post(
            f"{url}/v1/completions", json={**BODY, "max_tokens": 3}, headers={"X-Request-Id": "p1"}
        )
        assert failed.status_code == 500
        error = failed.json()["error"]
        assert error["code"] == "request_failed"
        assert "p1" in error["message"]
        streamed = httpx.post(
            f"{url}/v1/completions", json={**BODY, "max_tokens": 3, "stream": True}
        ).text
        assert '"code":"request_failed"' in streamed
        assert streamed.endswith("data: [DONE]\n\n")
        assert httpx.post(f"{url}/v1/completions", json=BODY).status_code == 200
        assert httpx.get(f"{url}/health/live").status_code == 200
        assert engine.kv.num_allocated_blocks() == 0


def test_dead_engine_loop_fails_liveness_and_refuses_requests(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs last: the engine keeps the request that was in flight when its loop died."""

    def crash() -> object:
        raise RuntimeError("device lost")

    with running(engine) as url:
        monkeypatch.setattr(engine, "step", crash)
        failed = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60)
        assert failed.status_code == 503
        assert failed.json()["error"]["code"] == "engine_dead"
        dead = wait_status(f"{url}/health/live", 503)
        assert "device lost" in dead.json()["status"]
        assert httpx.get(f"{url}/health/ready").status_code == 503
        refused = httpx.post(f"{url}/v1/completions", json=BODY)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "engine_dead"


def test_a_server_whose_engine_dies_exits_so_that_it_restarts_at_once(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """A rank of a model split over two processes is killed: the engine loop dies, and
    ``ladle serve`` exits 1 by itself (as vLLM's server does) with one error line saying why,
    instead of waiting for the liveness probe's failures to restart it."""
    server = start_server(tmp_path, "--model", str(tiny_model_path), "--tensor-parallel-size", "2")
    try:
        ranks = psutil.Process(server.proc.pid).children(recursive=True)
        assert ranks, "the second rank runs in a process of its own"
        for rank in ranks:
            rank.kill()
        assert server.proc.wait(timeout=60) == 1
    finally:
        server.stop()
    errors = [json.loads(line) for line in server.log_lines() if '"level": "error"' in line]
    died = [e for e in errors if e["message"].startswith("the engine loop died")]
    assert len(died) == 1, errors
    assert "rank 1 exited" in died[0]["error"], died
