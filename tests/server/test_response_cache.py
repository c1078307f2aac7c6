"""The gateway's response cache through real processes: a repeated greedy request is answered
from memory with the same bytes; a sampled one never is; keys share only within a scope."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import Gateway, Server, start_gateway, start_server

MODEL = "tiny"
KEYS = {"a1": "sk-team-a-0001", "a2": "sk-team-a-0002", "b": "sk-team-b-0001"}


@dataclass
class Setup:
    server: Server
    gateway: Gateway

    def post(self, key: str, body: dict[str, object]) -> httpx.Response:
        response = httpx.post(
            f"{self.gateway.url}/v1/completions",
            json={"model": MODEL, **body},
            headers={"authorization": f"Bearer {KEYS[key]}"},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        return response

    def server_requests(self) -> float:
        return self.server.metric("ladle:request_success_total", finished_reason="length")

    def cache_counts(self) -> dict[str, float]:
        text = httpx.get(f"{self.gateway.url}/metrics", timeout=10).text
        return {
            s.labels["result"]: s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "ladle_gateway_response_cache_requests_total"
        }


@pytest.fixture(scope="module")
def setup(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    folder = tmp_path_factory.mktemp("cache")
    server = start_server(folder, "--model", str(tiny_model_path), "--served-model-name", MODEL)
    keys = folder / "keys.yaml"
    keys.write_text(
        "keys:\n"
        + "".join(
            f"- {{name: {name}, key: {key}, cacheScope: team-{name[0]}}}\n"
            for name, key in KEYS.items()
        )
    )
    routes = (
        f"services:\n- name: chat\n  model: {MODEL}\n  endpoints: [{server.url}]\n"
        "  responseCache: {enabled: true}\n"
    )
    try:
        gateway = start_gateway(folder, routes, "--api-keys-file", str(keys))
        try:
            yield Setup(server, gateway)
        finally:
            gateway.stop()
    finally:
        server.stop()


GREEDY = {"prompt": "The cache says", "max_tokens": 6, "temperature": 0}


def test_a_repeated_greedy_request_is_answered_from_memory(setup: Setup) -> None:
    before = setup.server_requests()
    miss = setup.post("a1", GREEDY)
    hit = setup.post("a1", GREEDY)
    assert (miss.headers["x-ladle-cache"], hit.headers["x-ladle-cache"]) == ("miss", "hit")
    assert hit.content == miss.content  # the same body, id and created included
    assert hit.headers["x-request-id"] != miss.headers["x-request-id"]
    assert setup.server_requests() == before + 1  # the pod saw one of them
    # The same scope shares; another scope does not.
    assert setup.post("a2", GREEDY).headers["x-ladle-cache"] == "hit"
    other = setup.post("b", GREEDY)
    assert other.headers["x-ladle-cache"] == "miss"
    assert other.json()["choices"] == miss.json()["choices"]  # greedy: the same text anyway
    # Any parameter changes the key.
    assert setup.post("a1", {**GREEDY, "max_tokens": 5}).headers["x-ladle-cache"] == "miss"


def test_a_streamed_answer_replays_byte_for_byte(setup: Setup) -> None:
    body = {**GREEDY, "prompt": "Streams too", "stream": True}
    first, again = setup.post("a1", body), setup.post("a1", body)
    assert again.headers["x-ladle-cache"] == "hit"
    assert again.headers["content-type"].startswith("text/event-stream")
    assert again.content == first.content
    assert first.content.endswith(b"data: [DONE]\n\n")


def test_a_sampled_request_is_never_cached(setup: Setup) -> None:
    counts = setup.cache_counts()
    before = setup.server_requests()
    sampled = {"prompt": "Roll the dice", "max_tokens": 6, "temperature": 1.0}
    answers = [setup.post("a1", sampled) for _ in range(3)]
    assert all("x-ladle-cache" not in r.headers for r in answers)
    assert setup.server_requests() == before + 3
    assert setup.cache_counts() == counts  # neither a hit nor a miss: not cacheable
    seeded = {**sampled, "seed": 7}
    assert [setup.post("a1", seeded).headers["x-ladle-cache"] for _ in range(2)] == ["miss", "hit"]
    assert setup.cache_counts()["hit"] >= 1
