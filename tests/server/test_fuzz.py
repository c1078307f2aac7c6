"""API fuzzing of the OpenAI server from its own OpenAPI schema (schemathesis).

Bodies come from the published request schemas, as schemathesis generates them (valid ones,
and invalid ones: wrong types, missing fields, raw bytes), and from valid requests with
sampling fields (vLLM's extras included) set to arbitrary JSON. Whatever the body:

- no client input gets a 5xx, and no stream ends in a server error event;
- every error has OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``;
- the server still serves afterwards, its liveness probe green;
- no blocks leak: KV usage is back to 0 once the server is at rest.

The server runs the tiny model with a 2-second default deadline, so no generated request can
run for long whatever it asks for.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.core import NotSet
from schemathesis.generation import GenerationMode

from ladle.runtime import EngineArgs
from ladle.runtime.engine import LLMEngine
from ladle.runtime.limits import RequestLimits
from ladle.runtime.sampling_params import SamplingParams

from .conftest import InProcess, serve_in_thread

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
BASE = {
    "/v1/completions": {"prompt": "Hello there", "max_tokens": 4},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
    "/tokenize": {"prompt": "Hello"},
    "/detokenize": {"tokens": [1, 2, 3]},
}
# Request fields the server reads besides the SamplingParams fields.
SERVER_FIELDS = (
    "echo",
    "logprobs",
    "top_logprobs",
    "stream",
    "stream_options",
    "use_beam_search",
    "length_penalty",
    "early_stopping",
    "priority",
    "timeout",
    "suffix",
    "prompt",
    "messages",
    "max_completion_tokens",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "model",
)
FIELDS = sorted(
    {f.name for f in dataclasses.fields(SamplingParams) if f.init and f.name != "output_kind"}
    | set(SERVER_FIELDS)
)
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=8,
)
_INTS = st.integers(-2, 40) | st.sampled_from([0, 1, 300, 2**31, 2**63 - 1, 2**63, -(2**63)])
_FLOATS = st.floats(-3, 3) | st.sampled_from([0.0, 1e-9, 1.0, 2.0, 1e30, -1e30])
_TEXT = st.sampled_from(
    ["", " ", "a", "\n", "日本", "</s>", "<|im_end|>", "x" * 300, "lone \ud800 surrogate"]
) | st.text(max_size=8)
_IDS = st.lists(st.integers(-1, 49_200) | st.sampled_from([0, 2, 49_151]), max_size=6)
# What each field accepts, and values just past it: random JSON alone is refused at once by
# type checks, so most fuzzing would never reach the engine.
FIELD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    **dict.fromkeys(
        ["n", "best_of", "top_k", "max_tokens", "min_tokens", "max_completion_tokens"], _INTS
    ),
    **dict.fromkeys(["logprobs", "top_logprobs", "prompt_logprobs", "priority"], _INTS),
    **dict.fromkeys(
        [
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "length_penalty",
            "timeout",
        ],
        _FLOATS,
    ),
    "seed": _INTS | st.integers(0, 2**64),
    **dict.fromkeys(["stop", "bad_words"], _TEXT | st.lists(_TEXT, max_size=4)),
    **dict.fromkeys(["stop_token_ids", "allowed_token_ids"], _IDS),
    "logit_bias": st.dictionaries(st.integers(-1, 49_200).map(str), _FLOATS, max_size=4),
    **dict.fromkeys(
        [
            "echo",
            "stream",
            "use_beam_search",
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "add_generation_prompt",
            "continue_final_message",
        ],
        st.booleans(),
    ),
    "early_stopping": st.booleans() | st.sampled_from(["never", "always"]),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "prompt": _TEXT | _IDS | st.lists(_TEXT, max_size=3) | st.lists(_IDS, max_size=3),
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "assistant", "system", "tool"]), "content": _TEXT}
        ),
        max_size=3,
    ),
    "chat_template_kwargs": st.dictionaries(
        st.sampled_from(["tokenize", "enable_thinking", "x"]), st.booleans(), max_size=2
    ),
    "suffix": _TEXT | st.none(),
    "model": st.sampled_from([None, "SmolLM2-135M-Instruct", "gpt-4"]),
}
SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_path: Path) -> Iterator[InProcess]:
    args = EngineArgs(model=str(tiny_model_path), kv_cache_memory=16 << 20, max_model_len=256)
    limits = RequestLimits(max_n=8, max_prompts=4)
    with serve_in_thread(LLMEngine(args, limits), request_timeout=2.0) as srv:
        yield srv


@pytest.fixture(scope="module")
def api(fuzz_server: InProcess) -> Any:
    """The server's own OpenAPI document, as schemathesis reads it."""
    return schemathesis.openapi.from_dict(httpx.get(f"{fuzz_server.url}/openapi.json").json())


def check(server: InProcess, path: str, body: Any) -> None:
    """Send ``body``; the server must answer it as a client error or a success, never 5xx."""
    if isinstance(body, NotSet):
        content = b""
    elif isinstance(body, bytes):
        content = body
    else:
        content = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    url = server.url + path
    with httpx.stream("POST", url, content=content, headers=headers, timeout=60) as response:
        raw = response.read()
    assert response.status_code < 500, (body, raw)
    if response.status_code >= 400:
        error = json.loads(raw)["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        # OpenAI's type for a 404 (an unknown model) is not_found_error.
        wanted = "not_found_error" if response.status_code == 404 else "invalid_request_error"
        assert error["type"] == wanted, error
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        lines = raw.decode().splitlines()
        assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]", lines[-3:]
        for line in lines:
            if line.startswith("data: {"):
                event = json.loads(line.removeprefix("data: "))
                assert "error" not in event or event["error"]["type"] != "server_error", event


@st.composite
def mutated(draw: st.DrawFn, path: str) -> dict[str, Any]:
    """A valid request with a few fields set to what they accept, to just past it, or (one
    time in four) to any JSON."""
    body = dict(BASE[path])
    for field in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3, unique=True)):
        typed = FIELD_VALUES.get(field, JSON)
        body[field] = draw(JSON if draw(st.integers(0, 3)) == 0 else typed)
    return body


@SETTINGS
@given(data=st.data(), path=st.sampled_from(ENDPOINTS), mode=st.sampled_from(GenerationMode))
def test_requests_from_the_schema_never_get_a_5xx(
    fuzz_server: InProcess, api: Any, data: st.DataObject, path: str, mode: GenerationMode
) -> None:
    case = data.draw(api[path]["POST"].as_strategy(generation_mode=mode), label="case")
    check(fuzz_server, path, case.body)


@settings(SETTINGS, max_examples=150)
@given(data=st.data(), path=st.sampled_from(ENDPOINTS[:2]))
def test_valid_requests_with_wild_fields_never_get_a_5xx(
    fuzz_server: InProcess, data: st.DataObject, path: str
) -> None:
    check(fuzz_server, path, data.draw(mutated(path), label="body"))


@SETTINGS
@given(body=JSON, path=st.sampled_from(ENDPOINTS))
def test_any_json_never_gets_a_5xx(fuzz_server: InProcess, body: Any, path: str) -> None:
    check(fuzz_server, path, body)


def test_the_server_serves_on_with_no_blocks_leaked(fuzz_server: InProcess) -> None:
    """Runs after the fuzzing (tests in a module run in order)."""
    engine = fuzz_server.engine
    deadline = time.monotonic() + 30
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "requests still open at rest"
        time.sleep(0.05)
    assert engine.kv.num_allocated_blocks() == 0
    assert engine.kv.usage == 0.0
    assert httpx.get(f"{fuzz_server.url}/health/live").status_code == 200
    response = httpx.post(
        f"{fuzz_server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60
    )
    assert response.status_code == 200
