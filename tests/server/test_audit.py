"""The audit trail through real processes: a named key's request through ``ladle gateway`` to
``ladle serve``, each writing its audit record to a file; the two join on the request id."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ladle.audit import fingerprint
from ladle.gateway.apikeys import ApiKey, KeySpec, digest
from ladle.gateway.audit import fields, output_text
from ladle.gateway.context import Outcome
from ladle.gateway.inbound import Inbound
from ladle.gateway.ratelimit import KeyLimiter
from ladle.runtime.server.audit import AuditEntry

from .conftest import Gateway, Server, start_gateway, start_server

KEY = "sk-team-a-000001"
MODEL = "tiny"


@dataclass
class Trail:
    server: Server
    gateway: Gateway
    server_audit: Path
    gateway_audit: Path

    def records(
        self, at_gateway: tuple[str, ...], at_server: tuple[str, ...] = ()
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Both files' records, once those of the given request ids are written (a record is
        written after the last byte went out, so the client may be a moment ahead)."""
        return _wait(self.gateway_audit, at_gateway), _wait(self.server_audit, at_server)


def _wait(path: Path, request_ids: tuple[str, ...]) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 30
    while True:
        records = [json.loads(line) for line in path.read_text().splitlines()]
        if set(request_ids) <= {r["request_id"] for r in records}:
            return records
        assert time.monotonic() < deadline, f"no record of {request_ids} in {path}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def trail(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trail]:
    folder = tmp_path_factory.mktemp("audit")
    server_audit, gateway_audit = folder / "serve-audit.jsonl", folder / "gateway-audit.jsonl"
    server = start_server(
        folder,
        *("--model", str(tiny_model_path), "--served-model-name", MODEL),
        *("--api-key", KEY, "--audit-log", str(server_audit), "--audit-text"),
    )
    keys = folder / "keys.yaml"
    keys.write_text(f"keys:\n- name: team-a\n  key: {KEY}\n")
    try:
        routes = f"services:\n- name: chat\n  model: {MODEL}\n  endpoints: [{server.url}]\n"
        gateway = start_gateway(
            folder,
            routes,
            *("--api-keys-file", str(keys), "--audit-log", str(gateway_audit), "--audit-text"),
        )
        try:
            yield Trail(server, gateway, server_audit, gateway_audit)
        finally:
            gateway.stop()
    finally:
        server.stop()


def test_one_requests_records_join_on_the_request_id(trail: Trail) -> None:
    client = openai.OpenAI(base_url=f"{trail.gateway.url}/v1", api_key=KEY, max_retries=0)
    messages = [{"role": "user", "content": "Tell me a story"}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    request_id = raw.headers["x-request-id"]
    chunks = list(raw.parse())
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    gateway_records, server_records = trail.records((request_id,), (request_id,))
    at_gateway = [r for r in gateway_records if r["request_id"] == request_id]
    at_server = [r for r in server_records if r["request_id"] == request_id]
    assert (len(at_gateway), len(at_server)) == (1, 1), (gateway_records, server_records)
    gw, srv = at_gateway[0], at_server[0]
    # Who: the key by name at the gateway, by fingerprint at the pod; never the key itself.
    assert gw["key"] == "team-a"
    assert srv["key"] == fingerprint(KEY)
    assert KEY not in trail.gateway_audit.read_text() + trail.server_audit.read_text()
    # What, and how it went: the same model, parameters, token counts and text on both sides.
    assert (gw["component"], srv["component"]) == ("gateway", "runtime")
    assert gw["model"] == srv["model"] == MODEL
    assert gw["params"]["temperature"] == srv["params"]["temperature"] == 0
    assert srv["params"]["max_tokens"] == 8
    assert (gw["status"], gw["outcome"], srv["status"], srv["outcome"]) == (200, "ok", 200, "ok")
    assert srv["completion_tokens"] == gw["completion_tokens"] > 0
    assert srv["prompt_tokens"] == gw["prompt_tokens"] > 0
    assert gw["output"] == srv["output"] == [streamed]
    assert gw["prompt"] == messages
    assert "Tell me a story" in srv["prompt"][0]
    assert (gw["service"], gw["variant"], gw["pod"]) == ("chat", "stable", "default/chat-stable-0")
    assert srv["finish_reasons"] == ["length"]
    for record in (gw, srv):
        assert record["logger"].startswith("ladle.audit")
        assert record["message"] == "audit"
        assert record["audit_version"] == 1
        assert record["stream"] is True
        assert record["duration_s"] > 0
        assert record["time"]
    assert srv["ttft_s"] is not None
    assert 0 <= srv["queue_s"] <= srv["ttft_s"]
    # The client's usage was not asked for: the gateway asked on its behalf and kept it.
    assert chunks
    assert all(chunk.usage is None for chunk in chunks)


def test_refusals_are_recorded_where_they_happen(trail: Trail) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    refused = httpx.post(f"{trail.gateway.url}/v1/chat/completions", json=body, timeout=30)
    assert refused.status_code == 401
    bad = httpx.post(
        f"{trail.gateway.url}/v1/chat/completions",
        json={**body, "temperature": -1},
        headers={"authorization": f"Bearer {KEY}"},
        timeout=30,
    )
    assert bad.status_code == 400
    ids = (refused.headers["x-request-id"], bad.headers["x-request-id"])
    gateway_records, server_records = trail.records(ids, ids[1:])
    by_id = {r["request_id"]: r for r in gateway_records}
    first = by_id[refused.headers["x-request-id"]]
    assert (first["key"], first["status"], first["outcome"]) == (None, 401, "rejected")
    assert "API key" in first["error"]
    assert first["pod"] is None
    # Never reached a pod, so the pod has no record of it.
    assert refused.headers["x-request-id"] not in {r["request_id"] for r in server_records}
    # The pod refused the other: both sides say so, with the pod's words.
    pod_side = [r for r in server_records if r["request_id"] == bad.headers["x-request-id"]]
    assert len(pod_side) == 1
    assert pod_side[0]["outcome"] == "rejected"
    assert "temperature" in pod_side[0]["error"]
    assert pod_side[0]["completion_tokens"] == 0
    assert by_id[bad.headers["x-request-id"]]["status"] == 400


def test_text_is_recorded_only_when_opted_in() -> None:
    entry = AuditEntry(key="k", text=False)
    entry.begin("m", {"temperature": 0}, False, ["a secret prompt"])
    entry.shown(0, "a secret answer")
    record = entry.fields("/v1/completions", 200, 0.1)
    assert "prompt" not in record
    assert "output" not in record
    assert "secret" not in json.dumps(record)
    key = ApiKey(KeySpec("team-a", digest("sk-xxxxxxxx")), KeyLimiter(None, None, 0.0))
    inbound = Inbound.parse(b'{"model": "m", "prompt": "a secret prompt", "seed": 3}')
    out = Outcome(status=200, captured=[b'{"choices": [{"index": 0, "text": "a secret"}]}'])
    without = fields("/v1/completions", out, key, inbound, 0.1, text=False)
    assert "secret" not in json.dumps(without)
    assert without["params"] == {"seed": 3}
    with_text = fields("/v1/completions", out, key, inbound, 0.1, text=True)
    assert with_text["prompt"] == ["a secret prompt"]
    assert with_text["output"] == ["a secret"]


def test_stream_output_text_joins_each_choices_deltas() -> None:
    events = b"".join(
        b"data: " + json.dumps(doc).encode() + b"\n\n"
        for doc in (
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"index": 1, "delta": {"content": "B"}}]},
            {"choices": [{"index": 0, "delta": {"content": "A1"}}]},
            {"choices": [{"index": 0, "delta": {"content": "A2"}, "finish_reason": "stop"}]},
            {"choices": [], "usage": {"total_tokens": 3}},
        )
    )
    assert output_text(events + b"data: [DONE]\n\n", stream=True) == ["A1A2", "B"]
