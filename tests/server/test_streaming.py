"""Streamed and non-streamed responses agree exactly, over many generated requests.

A stream is the body cut into chunks: the same text, token logprobs (tokens, logprobs, top
alternatives, text offsets), finish and stop reasons, and usage, for completions (with echo,
n > 1, stop strings, token-id prompts) and for chat. The tiny random model writes plenty of
partial UTF-8 characters, and the stop strings are common letters, so text is often held back
while its tokens have already been sampled: exactly where logprobs used to go missing.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import InProcess

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,", "¿Qué tal? 日本語"]
STOPS = ["e", "a ", "th", "\n", "日"]
SETTINGS = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def sampling(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {
        "max_tokens": draw(st.integers(1, 24)),
        "n": draw(st.integers(1, 3)),
        "stop": draw(st.lists(st.sampled_from(STOPS), max_size=2, unique=True)),
        "include_stop_str_in_output": draw(st.booleans()),
        "ignore_eos": draw(st.booleans()),
        "min_tokens": draw(st.integers(0, 2)),
    }
    if draw(st.booleans()):
        body |= {"temperature": 0.9, "seed": draw(st.integers(0, 1000)), "top_k": 20}
    else:
        body["temperature"] = 0
    body["min_tokens"] = min(body["min_tokens"], body["max_tokens"])
    return body


@st.composite
def completion_bodies(draw: st.DrawFn) -> dict[str, Any]:
    body = sampling(draw)
    if draw(st.booleans()):
        body["prompt"] = draw(st.sampled_from(PROMPTS))
    else:
        body["prompt"] = draw(st.lists(st.integers(0, 49151), min_size=1, max_size=12))
    body["logprobs"] = draw(st.sampled_from([None, 0, 3]))
    body["echo"] = draw(st.booleans())
    return body


@st.composite
def chat_bodies(draw: st.DrawFn) -> dict[str, Any]:
    body = sampling(draw)
    body["messages"] = [{"role": "user", "content": draw(st.sampled_from(PROMPTS))}]
    if draw(st.booleans()):
        body |= {"logprobs": True, "top_logprobs": draw(st.integers(0, 3))}
    return body


def events(server: InProcess, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + path, json=payload, timeout=120) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all("error" not in c for c in chunks), chunks
    return chunks


def body(server: InProcess, path: str, request: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(server.url + path, json=request, timeout=120)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def joined_completions(chunks: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Each choice's chunks put back together."""
    joined: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            into = joined.setdefault(
                choice["index"],
                {"text": "", "logprobs": None, "finish_reason": None, "stop_reason": None},
            )
            into["text"] += choice["text"]
            if choice["logprobs"] is not None:
                lp = into["logprobs"] = into["logprobs"] or {
                    "text_offset": [],
                    "token_logprobs": [],
                    "tokens": [],
                    "top_logprobs": [],
                }
                for key in lp:
                    lp[key] += choice["logprobs"][key]
            if choice["finish_reason"] is not None:
                into["finish_reason"] = choice["finish_reason"]
                into["stop_reason"] = choice["stop_reason"]
    return joined


@SETTINGS
@given(request=completion_bodies())
def test_completion_stream_is_the_body_in_chunks(
    tiny_server: InProcess, request: dict[str, Any]
) -> None:
    full = body(tiny_server, "/v1/completions", request)
    chunks = events(tiny_server, "/v1/completions", request)
    expected = {
        c["index"]: {k: c[k] for k in ("text", "logprobs", "finish_reason", "stop_reason")}
        for c in full["choices"]
    }
    assert joined_completions(chunks) == expected
    if request["logprobs"] is not None:
        for choice in expected.values():
            tokens = choice["logprobs"]["tokens"]
            assert len(choice["logprobs"]["token_logprobs"]) == len(tokens)
    assert chunks[-1]["usage"] == full["usage"]
    assert tiny_server.engine.kv.num_allocated_blocks() == 0


@SETTINGS
@given(request=chat_bodies())
def test_chat_stream_is_the_body_in_chunks(tiny_server: InProcess, request: dict[str, Any]) -> None:
    full = body(tiny_server, "/v1/chat/completions", request)
    chunks = events(tiny_server, "/v1/chat/completions", request)
    joined: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            into = joined.setdefault(
                choice["index"], {"content": "", "logprobs": None, "finish_reason": None}
            )
            into["content"] += choice["delta"].get("content") or ""
            if choice.get("logprobs") is not None:
                into["logprobs"] = (into["logprobs"] or []) + choice["logprobs"]["content"]
            if choice["finish_reason"] is not None:
                into["finish_reason"] = choice["finish_reason"]
    expected = {
        c["index"]: {
            "content": c["message"]["content"],
            "logprobs": None if c["logprobs"] is None else c["logprobs"]["content"],
            "finish_reason": c["finish_reason"],
        }
        for c in full["choices"]
    }
    assert joined == expected
    assert chunks[-1]["usage"] == full["usage"]
