"""The OpenAI API of a real ``ladle serve``, driven by the official ``openai`` client."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from ladle.runtime import LLM, SamplingParams
from ladle.runtime.sampling_params import BeamSearchParams

from .conftest import Server

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def aclient(server: Server) -> openai.AsyncOpenAI:
    """Per test: an async client belongs to the event loop it first ran on."""
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_models_version_and_request_id(client: openai.OpenAI, server: Server) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    assert httpx.get(f"{server.url}/version").json()["version"]
    raw = client.completions.with_raw_response.create(
        model=models[0].id,
        prompt=PROMPT,
        max_tokens=2,
        temperature=0,
        extra_headers={"X-Request-Id": "trace-123"},
    )
    assert raw.headers["x-request-id"] == "trace-123"
    generated = httpx.get(f"{server.url}/health/live")
    assert len(generated.headers["x-request-id"]) == 32  # one is made up when none is sent


def test_completion_stream_equals_non_stream(client: openai.OpenAI) -> None:
    full = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=6, temperature=0
    )
    choice = full.choices[0]
    assert choice.finish_reason == "length"
    assert full.usage is not None
    assert full.usage.completion_tokens == 6
    assert full.usage.prompt_tokens == 5
    chunks = list(
        client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt=PROMPT,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens == 11
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


async def test_async_chat_stream_and_non_stream(aclient: openai.AsyncOpenAI) -> None:
    full = await aclient.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=MESSAGES, max_tokens=5, temperature=0
    )
    message = full.choices[0].message
    assert message.role == "assistant"
    assert message.content
    stream = await aclient.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content
    assert chunks[-1].usage is not None
    assert full.usage is not None
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_sync_chat_uses_the_chat_template(client: openai.OpenAI, server: Server) -> None:
    response = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=MESSAGES, max_tokens=1, temperature=0
    )
    tokenized = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}).json()
    assert response.usage is not None
    assert response.usage.prompt_tokens == tokenized["count"]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokenized["tokens"]}).json()
    assert "<|im_start|>user\nName a colour.<|im_end|>" in text["prompt"]
    assert text["prompt"].endswith("<|im_start|>assistant\n")


def test_n_choices_and_logprobs(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt=PROMPT,
        max_tokens=3,
        n=2,
        temperature=1.0,
        seed=7,
        logprobs=2,
    )
    assert sorted(c.index for c in response.choices) == [0, 1]
    for choice in response.choices:
        assert choice.logprobs is not None
        assert len(choice.logprobs.tokens or []) == 3
        assert "".join(choice.logprobs.tokens or []) == choice.text
        for top in choice.logprobs.top_logprobs or []:
            assert 2 <= len(top) <= 3  # the top 2, plus the sampled token when it is not one
    assert response.usage is not None
    assert response.usage.completion_tokens == 6


async def test_chat_top_logprobs_stream(aclient: openai.AsyncOpenAI) -> None:
    stream = await aclient.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=MESSAGES,
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    )
    entries = [
        entry
        async for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content or []
    ]
    assert len(entries) == 3
    for entry in entries:
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)


def test_stop_string(client: openai.OpenAI) -> None:
    free = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=8, temperature=0
    )
    text = free.choices[0].text
    word = text.split()[1]
    stopped = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=8, temperature=0, stop=[word]
    )
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == text[: text.index(word)]
    assert choice.model_extra is not None
    assert choice.model_extra["stop_reason"] == word


def test_vllm_extras_pass_through(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt=PROMPT,
        max_tokens=4,
        temperature=0.8,
        seed=1,
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 4},
    )
    assert response.usage is not None
    assert response.usage.completion_tokens == 4
    # ignore_eos with max_tokens gives an exact length, as benchmarks rely on.
    exact = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="Say nothing.",
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert exact.usage is not None
    assert exact.usage.completion_tokens == 5


def test_multiple_prompts_in_one_request(client: openai.OpenAI) -> None:
    single = [
        client.completions.create(
            model="SmolLM2-135M-Instruct", prompt=p, max_tokens=3, temperature=0
        )
        .choices[0]
        .text
        for p in (PROMPT, "One, two,")
    ]
    both = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=[PROMPT, "One, two,"], max_tokens=3, temperature=0
    )
    assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == single


@pytest.fixture(scope="module")
def offline() -> LLM:
    """The offline engine, configured as the server is, for token-exact comparisons."""
    return LLM(kv_cache_memory="64MiB", max_model_len=512)


def test_beam_search_matches_offline(client: openai.OpenAI, offline: LLM) -> None:
    response = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt=PROMPT,
        max_tokens=4,
        n=2,
        extra_body={"use_beam_search": True, "length_penalty": 1.0},
    )
    beams = offline.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_tokens=4))
    served = [c.text for c in sorted(response.choices, key=lambda c: c.index)]
    assert served == [s.text for s in beams[0].sequences]


async def test_16_concurrent_streams_equal_offline_greedy(
    aclient: openai.AsyncOpenAI, offline: LLM
) -> None:
    prompts = [f"Write the number {i} in words:" for i in range(16)]

    async def stream(prompt: str) -> str:
        chunks = await aclient.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt=prompt,
            max_tokens=6,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join([c.choices[0].text async for c in chunks if c.choices])

    served = await asyncio.gather(*(stream(p) for p in prompts))
    expected = offline.generate(
        prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
    )
    assert served == [o.outputs[0].text for o in expected]


def test_bench_serve_against_the_server(server: Server, tmp_path: Path) -> None:
    result_file = tmp_path / "bench.json"
    args = ["--base-url", server.url, "--num-prompts", "4", "--input-len", "16"]
    args += ["--output-len", "3", "--max-concurrency", "2", "--request-rate", "20"]
    args += ["--goodput", "ttft:600000", "e2el:600000", "--result-file", str(result_file)]
    done = subprocess.run(
        [sys.executable, "-m", "ladle.cli", "bench", "serve", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "Output token throughput (tok/s):" in done.stdout
    result = json.loads(result_file.read_text())
    assert result["completed"] == 4
    assert result["total_output_tokens"] == 12
    assert result["total_input_tokens"] == 4 * 16
    assert result["goodput"] == pytest.approx(result["request_throughput"])
    assert result["p99_ttft_ms"] >= result["p50_ttft_ms"] > 0
    assert all(len(r["itl"]) == 2 for r in result["requests"])


def test_bench_serve_stopped_by_a_signal_reports_what_it_sent(
    server: Server, tmp_path: Path
) -> None:
    """SIGTERM mid-run: nothing more is sent, the requests in flight finish, and the report
    covers every request that was sent (what a test keeping load running in the background
    reads back)."""

    def finished() -> float:
        return sum(
            value
            for (name, _), value in server.metrics().items()
            if name == "ladle:request_success_total"
        )

    before = finished()
    result_file = tmp_path / "stopped.json"
    args = ["--base-url", server.url, "--num-prompts", "2000", "--input-len", "8"]
    args += ["--output-len", "4", "--max-concurrency", "2", "--result-file", str(result_file)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ladle.cli", "bench", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while finished() < before + 4:  # the test request and a few timed ones
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "bench serve sent nothing"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "Stopped early; requests not sent:" in out
    result = json.loads(result_file.read_text())
    assert result["failed"] == 0, result["requests"]
    assert result["completed"] >= 3
    assert result["not_sent"] == 2000 - result["completed"]
    assert len(result["requests"]) == result["completed"]
    # Those in flight at the signal finished: the server finished every request it was sent,
    # the test request among them, and none was cut off.
    assert finished() == before + 1 + result["completed"]
