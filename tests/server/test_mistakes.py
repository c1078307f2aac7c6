"""A newcomer's HTTP mistakes, sent to a real ``ladle serve`` and to a real ``ladle gateway``
in front of it: each is one OpenAI error object with a 4xx status that names what to fix, the
same words from both, and no traceback in either log.

The table is the point: a later mistake of the same class belongs in it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from .conftest import Gateway, Server, start_gateway

MODEL = "SmolLM2-135M-Instruct"
HI = [{"role": "user", "content": "Hi"}]
# Pretty-printed, as a person writes it, with a comma too many; "é" is two bytes and one
# character: the position counts characters, the line and column are the fifth line's first.
TRAILING_COMMA = (
    b'{\n  "model": "' + MODEL.encode() + b'",\n'
    b'  "messages": [{"role": "user", "content": "H\xc3\xa9"}],\n  "max_tokens": 2,\n}\n'
)


@dataclass(frozen=True)
class Mistake:
    path: str
    body: bytes | dict[str, object] | None
    status: int
    code: str
    param: str | None
    says: str  # appears in the message
    method: str = "POST"
    content_type: str = "application/json"


MISTAKES: dict[str, Mistake] = {
    "JSON cut short": Mistake(
        "/v1/chat/completions", b'{"model": "' + MODEL.encode() + b'", "messages": [', 400,
        "invalid_json", None, "not valid JSON: Expecting value at line 1, column",
    ),
    "JSON with a trailing comma, over several lines": Mistake(
        "/v1/chat/completions", TRAILING_COMMA, 400, "invalid_json", None,
        "Expecting property name enclosed in double quotes at line 5, column 1 (character 108)",
    ),
    "an array for a body": Mistake(
        "/v1/chat/completions", b"[1, 2]", 400, "invalid_json", None, "not an array"
    ),
    "no body": Mistake("/v1/chat/completions", b"", 400, "invalid_json", None, "body is empty"),
    "JSON sent as form data (curl -d)": Mistake(
        "/v1/chat/completions", b'{"model": "' + MODEL.encode() + b'", "messages": []}', 400,
        "invalid_json", None, "Content-Type: application/json, not application/x-www-form",
        content_type="application/x-www-form-urlencoded",
    ),
    "a misspelt parameter": Mistake(
        "/v1/chat/completions", {"messages": HI, "temprature": 0.5}, 400, "invalid_parameter",
        "temprature", "temprature",
    ),
    "a negative temperature": Mistake(
        "/v1/chat/completions", {"messages": HI, "temperature": -1}, 400, "invalid_parameter",
        "temperature", ">= 0",
    ),
    "max_tokens as words": Mistake(
        "/v1/chat/completions", {"messages": HI, "max_tokens": "ten"}, 400, "invalid_parameter",
        "max_tokens", "integer",
    ),
    "no messages": Mistake(
        "/v1/chat/completions", {"max_tokens": 2}, 400, "invalid_parameter", "messages",
        "required",
    ),
    "messages as a string": Mistake(
        "/v1/chat/completions", {"messages": "Hi"}, 400, "invalid_parameter", "messages", "list"
    ),
    "a role OpenAI does not have": Mistake(
        "/v1/chat/completions", {"messages": [{"role": "bot", "content": "Hi"}]}, 400,
        "invalid_parameter", "messages.0.role", "'user'",
    ),
    "more tokens than the context": Mistake(
        "/v1/chat/completions", {"messages": HI, "max_tokens": 100_000}, 400,
        "invalid_parameter", "max_tokens", "maximum context length is 512",
    ),
    "n of zero": Mistake(
        "/v1/chat/completions", {"messages": HI, "n": 0}, 400, "invalid_parameter", "n", ">= 1"
    ),
    "completions without a prompt": Mistake(
        "/v1/completions", {"max_tokens": 2}, 400, "invalid_parameter", "prompt", "required"
    ),
    "a base URL without /v1": Mistake(
        "/chat/completions", {"messages": HI}, 404, "not_found", None,
        "did you mean /v1/chat/completions?",
    ),
    "a path one letter short": Mistake(
        "/v1/chat/completion", {"messages": HI}, 404, "not_found", None,
        "did you mean /v1/chat/completions?",
    ),
    "GET where POST belongs": Mistake(
        "/v1/chat/completions", None, 405, "method_not_allowed", None,
        "GET is not allowed on /v1/chat/completions; use POST", method="GET",
    ),
}  # fmt: skip


@dataclass
class Front:
    gateway: Gateway
    server_lines: int  # the shared server's log before this module's requests

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def log(self) -> Path:
        return self.gateway.log


@pytest.fixture(scope="module")
def gateway(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    """``ladle gateway --static`` in front of the session's server."""
    folder = tmp_path_factory.mktemp("gateway")
    routes = f"services:\n- name: chat\n  model: {MODEL}\n  endpoints: [{server.url}]\n"
    lines = len(server.log_lines())
    gw = start_gateway(folder, routes)
    try:
        yield Front(gw, lines)
    finally:
        gw.stop()


def send(base: str, mistake: Mistake) -> httpx.Response:
    body = mistake.body
    if isinstance(body, dict):
        body = httpx.Request("POST", "/", json={"model": MODEL, **body}).content
    headers = {"content-type": mistake.content_type} if body is not None else {}
    return httpx.request(
        mistake.method, base + mistake.path, content=body, headers=headers, timeout=60
    )


@pytest.mark.parametrize("name", list(MISTAKES))
def test_a_mistake_is_one_openai_error_naming_what_to_fix(
    name: str, server: Server, gateway: Front
) -> None:
    mistake = MISTAKES[name]
    answers = {}
    for where, base in (("serve", server.url), ("gateway", gateway.url)):
        response = send(base, mistake)
        assert response.status_code == mistake.status, (where, response.text)
        body = response.json()
        assert set(body) == {"error"}, (where, body)
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, (where, error)
        assert (error["code"], error["param"]) == (mistake.code, mistake.param), (where, error)
        assert mistake.says in error["message"], (where, error)
        answers[where] = error["message"]
    # The gateway checks the body's shape and routes; the server checks the rest. A client
    # reads the same words from either.
    assert answers["serve"] == answers["gateway"]


def test_the_openai_client_gets_the_same_errors(server: Server, gateway: Front) -> None:
    for base in (server.url, gateway.url):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=MODEL, messages=HI, temperature=-1)  # type: ignore[arg-type]
        assert bad.value.param == "temperature"
        with pytest.raises(openai.APIStatusError) as unknown:
            client.chat.completions.create(model="gpt-4o", messages=HI)  # type: ignore[arg-type]
        assert unknown.value.status_code in (400, 404)
        assert "gpt-4o" in unknown.value.message


def test_the_logs_share_one_schema_and_no_mistake_left_a_traceback(
    server: Server, gateway: Front
) -> None:
    """Runs last in this module: the mistakes above are in both logs, one JSON object a line
    with the same keys, and a request the gateway forwarded carries its id into the server's."""
    assert httpx.get(f"{server.url}/health/ready", timeout=10).status_code == 200
    records = {
        "serve": [json.loads(line) for line in server.log_lines()[gateway.server_lines :]],
        "gateway": [json.loads(line) for line in gateway.log.read_text().splitlines()],
    }
    for where, lines in records.items():
        for record in lines:
            assert {"time", "level", "logger", "message"} <= set(record), (where, record)
            assert record["level"] in ("debug", "info", "warning"), (where, record)
            assert "exc_info" not in record, (where, record)
    forwarded = [r for r in records["gateway"] if r.get("pod") and r.get("status") == 400]
    assert len(forwarded) >= 8
    seen = {r.get("request_id") for r in records["serve"]}
    assert all(r["request_id"] in seen for r in forwarded)
