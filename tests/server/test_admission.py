"""A server configured the way the operator configures pods: a --config YAML file, LADLE_*
environment variables, an API key file from a Secret, a bounded waiting queue."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .conftest import Server, start_server


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("secret") / "api-key"
    path.write_text("first-key\n")
    return path


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory, key_file: Path) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("guarded")
    config = folder / "config.yaml"
    config.write_text(
        "served-model-name: tiny-chat\n"
        "max-num-seqs: 1\n"
        "max_waiting_requests: 5\n"  # the environment below overrides this
        f"api-key-file: {key_file}\n"
        "drain-timeout: 5\n"
    )
    srv = start_server(
        folder,
        "--config",
        str(config),
        env={"LADLE_SERVE_MAX_WAITING_REQUESTS": "1", "LADLE_SERVE_MAX_REQUEST_SIZE": "64KiB"},
    )
    yield srv
    assert srv.stop() == 0


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def complete(server: Server, key: str, **body: object) -> httpx.Response:
    payload = {"prompt": "Hi", "max_tokens": 1, **body}
    return httpx.post(f"{server.url}/v1/completions", json=payload, headers=auth(key), timeout=120)


def test_settings_come_from_config_and_environment(guarded: Server) -> None:
    models = httpx.get(f"{guarded.url}/v1/models", headers=auth("first-key")).json()
    assert [m["id"] for m in models["data"]] == ["tiny-chat"]


def test_api_key_required_except_for_probes_and_metrics(guarded: Server, key_file: Path) -> None:
    for headers in ({}, auth("wrong-key"), {"Authorization": "first-key"}):
        response = httpx.post(
            f"{guarded.url}/v1/completions", json={"prompt": "Hi"}, headers=headers
        )
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"
    assert httpx.post(f"{guarded.url}/tokenize", json={"prompt": "Hi"}).status_code == 401
    for path in ("/health/live", "/health/ready", "/health", "/metrics", "/version"):
        assert httpx.get(f"{guarded.url}{path}").status_code == 200, path
    assert complete(guarded, "first-key").status_code == 200


def test_rotated_key_file_is_picked_up(guarded: Server, key_file: Path) -> None:
    key_file.write_text("second-key\nthird-key\n")
    stat = key_file.stat()
    os.utime(key_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert complete(guarded, "first-key").status_code == 401
    assert complete(guarded, "second-key").status_code == 200
    assert complete(guarded, "third-key").status_code == 200


def test_body_limit_from_environment_is_413(guarded: Server, key_file: Path) -> None:
    key = key_file.read_text().split()[0]
    response = complete(guarded, key, prompt="word " * 20_000)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_admission_counts_sequences(guarded: Server, key_file: Path) -> None:
    """Two prompts are two sequences: more than --max-waiting-requests (1) could ever admit,
    so a 400 rather than a 429 to retry."""
    key = key_file.read_text().split()[0]
    response = complete(guarded, key, prompt=["Hi", "Ho"])
    assert response.status_code == 400
    assert "2 sequences" in response.json()["error"]["message"]


def test_full_waiting_queue_is_429_with_retry_after(guarded: Server, key_file: Path) -> None:
    """max-num-seqs 1: one request runs, one waits, the next is refused."""
    key = key_file.read_text().split()[0]
    body = {"prompt": "Hi", "max_tokens": 400, "ignore_eos": True, "stream": True}
    url = f"{guarded.url}/v1/completions"
    with (
        httpx.stream("POST", url, json=body, headers=auth(key), timeout=120),
        httpx.stream("POST", url, json=body, headers=auth(key), timeout=120),
    ):
        guarded.wait_metric("ladle:num_requests_running", 1)
        guarded.wait_metric("ladle:num_requests_waiting", 1)
        refused = complete(guarded, key)
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "queue_full"
    # Both streams were closed, which aborted them: the queue is open again.
    guarded.wait_metric("ladle:num_requests_running", 0)
    assert guarded.metric("ladle:request_rejected_total", reason="queue_full") == 1
    assert complete(guarded, key).status_code == 200


def test_a_key_file_gone_missing_is_logged_once_and_once_more_when_back(
    guarded: Server, key_file: Path
) -> None:
    """The Secret's file vanishes under a running server (an unmount, a botched rotation):
    the keys it held keep working, and the log says so once, not on every request; once more
    when the file is back. Runs last: it rewrites the file."""
    saved = key_file.read_text()
    key = saved.split()[0]
    before = len(guarded.log_lines())
    key_file.unlink()
    try:
        for _ in range(5):
            assert complete(guarded, key).status_code == 200
    finally:
        key_file.write_text(saved)
        stat = key_file.stat()
        os.utime(key_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    for _ in range(3):
        assert complete(guarded, key).status_code == 200
    records = [json.loads(line) for line in guarded.log_lines()[before:]]
    assert not [r for r in records if "exc_info" in r or r["level"] == "error"], records
    gone = [r for r in records if r["message"].startswith("api key file unreadable")]
    back = [r for r in records if r["message"] == "api key file readable again"]
    assert len(gone) == 1, gone
    assert (gone[0]["level"], gone[0]["path"]) == ("warning", str(key_file))
    assert "No such file" in gone[0]["error"]
    assert len(back) == 1, back
    assert back[0]["level"] == "info"
