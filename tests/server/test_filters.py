"""Filters in a real ``ladle serve``: the shipped PII redactor on the default model's own
stream, where an e-mail address arrives over several chunks; a rejecting input filter's 400."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from ladle.runtime.filters.pii import find

from .conftest import InProcess, Server, serve_in_thread, start_server

MODEL = "SmolLM2-135M-Instruct"
# Few-shot: greedy, the default model answers with an address of its own (jane.doe@...).
PROMPT = "Name: John Smith\nEmail: john.smith@example.com\n\nName: Jane Doe\nEmail:"


@pytest.fixture(scope="module")
def redacting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("filters"), "--output-filter", "pii")
    yield srv
    assert srv.stop() == 0


def stream(base: str, **extra: object) -> list[openai.types.Completion]:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    return list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True, **extra
        )
    )


def test_an_address_streamed_over_several_chunks_is_redacted(
    server: Server, redacting: Server
) -> None:
    plain = [c.choices[0].text for c in stream(server.url) if c.choices]
    text = "".join(plain)
    emails = [(s, e) for s, e, label, _ in find(text) if label == "EMAIL"]
    assert emails, f"the model wrote no address this time: {text!r}"
    start, end = emails[0]
    # The unfiltered stream splits the address over several chunks.
    edges, position = [], 0
    for piece in plain:
        position += len(piece)
        edges.append(position)
    assert any(start < edge < end for edge in edges), plain

    chunks = stream(redacting.url, logprobs=2)
    shown = "".join(c.choices[0].text for c in chunks if c.choices)
    assert shown == text[:start] + "[EMAIL]" + text[end:]
    assert "@" not in shown
    # Every generated token is still accounted for, each with its logprob; the tokens' texts
    # add up to the text shown, and none of them, nor any alternative, spells the address.
    tokens = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens
    ]
    logprobs = [
        lp
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for lp in c.choices[0].logprobs.token_logprobs
    ]
    assert len(tokens) == len(logprobs) == 12
    assert "".join(tokens) == shown
    tops = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.top_logprobs
    ]
    assert "@" not in repr(tops)
    # The body shows what the stream showed.
    body = httpx.post(
        f"{redacting.url}/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0},
        timeout=120,
    ).json()
    assert body["choices"][0]["text"] == shown
    assert body["usage"]["completion_tokens"] == 12


@pytest.fixture(scope="module")
def guarded(tiny_model_path: Path) -> Iterator[InProcess]:
    from ladle.runtime import EngineArgs
    from ladle.runtime.engine import LLMEngine

    args = EngineArgs(model=str(tiny_model_path), kv_cache_memory=16 << 20, max_model_len=256)
    with serve_in_thread(LLMEngine(args), input_filters=["pii"]) as srv:
        yield srv


def test_a_rejecting_input_filter_is_a_clear_400(guarded: InProcess) -> None:
    client = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="none", max_retries=0)
    model = guarded.engine.served_model_name
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "my card is 4111 1111 1111 1111"}],
            max_tokens=2,
        )
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["code"] == "content_filter"
    assert error["param"] == "messages"
    assert error["message"] == (
        "the request was refused by the input filter 'pii': the messages holds a payment card "
        "number"
    )
    # Nothing was admitted; a clean prompt still runs.
    ok = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=2
    )
    assert ok.usage is not None
    assert ok.usage.completion_tokens == 2
