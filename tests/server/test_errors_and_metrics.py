"""Error responses over raw HTTP, client disconnects, and /metrics against what was sent."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ladle.gateway.scrape import parse_load
from ladle.operator.analysis import parse_metrics
from ladle.operator.pace import Pace
from ladle.operator.scrape import parse_pod
from ladle.runtime_metrics import CACHE_CONFIG_INFO, PROTOCOL_GAUGES
from ladle_dev.cluster import gaie

from .conftest import Server

MODEL = "SmolLM2-135M-Instruct"


def post(server: Server, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    """JSON with non-ASCII escaped, so that lone surrogates can be sent as clients send them."""
    headers = {"Content-Type": "application/json", **kwargs.pop("headers", {})}
    content = json.dumps(body)
    return httpx.post(
        f"{server.url}{path}", content=content, headers=headers, timeout=120, **kwargs
    )


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    return error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "n": "many"}, "n"),
        ({"prompt": "x", "top_k": "abc"}, "top_k"),
        ({"prompt": "x", "logprobs": -1}, "logprobs"),
        ({"prompt": "x", "no_such_knob": 1}, "no_such_knob"),
        ({"prompt": []}, "prompt"),
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": "word " * 600}, "prompt"),
        ({"prompt": "x", "max_tokens": 600}, "max_tokens"),
        # Limits, each with vLLM-like defaults (--max-n 128, --max-prompts 256, ...).
        ({"prompt": "x", "n": 129}, "n"),
        ({"prompt": ["x"] * 257}, "prompt"),
        ({"prompt": "x", "stop": ["s"] * 65}, "stop"),
        ({"prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"prompt": "x", "echo": True, "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "n": 2, "seed": 2**63 - 1}, "seed"),
        ({"prompt": "x", "priority": 1}, "priority"),
        ({"prompt": "x", "timeout": 0}, "timeout"),
        # JSON may carry lone surrogates; no tokenizer can encode them.
        ({"prompt": "a \ud800 b"}, "prompt"),
        ({"prompt": "x", "bad_words": ["\udfff"]}, "bad_words"),
    ],
)
def test_bad_completion_parameters_are_400(
    server: Server, body: dict[str, Any], param: str
) -> None:
    error = assert_error(post(server, "/v1/completions", body), 400, param)
    assert error["type"] == "invalid_request_error"


def test_chat_errors_are_400(server: Server) -> None:
    assert_error(post(server, "/v1/chat/completions", {"messages": []}), 400, "messages")
    lone = {"messages": [{"role": "user", "content": "\ud83d"}]}
    assert_error(post(server, "/v1/chat/completions", lone), 400, "messages")
    assert_error(post(server, "/tokenize", {"prompt": "\ud83d"}), 400, "prompt")
    bad_role = {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    assert_error(post(server, "/v1/chat/completions", bad_role), 400)
    only_top = {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}
    assert_error(post(server, "/v1/chat/completions", only_top), 400, "top_logprobs")


def test_unknown_model_is_404(server: Server) -> None:
    """OpenAI's and vLLM's answer, and the gateway's."""
    error = assert_error(
        post(server, "/v1/completions", {"model": "gpt-4", "prompt": "x"}), 404, "model"
    )
    assert error["code"] == "model_not_found"


def test_malformed_json_and_unknown_route(server: Server) -> None:
    raw = httpx.post(
        f"{server.url}/v1/completions",
        content=b"{not json",
        headers={"Content-Type": "application/json"},
    )
    assert_error(raw, 400)
    assert_error(httpx.get(f"{server.url}/v1/nothing-here"), 404)


def test_oversized_body_is_413(server: Server) -> None:
    huge = {"prompt": "x" * (9 << 20)}
    error = assert_error(post(server, "/v1/completions", huge), 413)
    assert error["code"] == "request_too_large"

    def chunks() -> Any:
        for _ in range(10):
            yield b"x" * (1 << 20)

    # No Content-Length (chunked upload): the limit still holds as the body streams in.
    chunked = httpx.post(
        f"{server.url}/v1/completions",
        content=chunks(),
        headers={"Content-Type": "application/json"},
    )
    assert_error(chunked, 413)


def test_streaming_client_disconnect_frees_blocks(server: Server) -> None:
    aborted = server.metric("ladle:request_success_total", finished_reason="abort")
    body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert server.metric("ladle:num_requests_running") == 1
        assert server.metric("ladle:kv_cache_usage_perc") > 0
    server.wait_metric("ladle:num_requests_running", 0, timeout=30)
    assert server.metric("ladle:kv_cache_usage_perc") == 0
    assert server.metric("ladle:request_success_total", finished_reason="abort") == aborted + 1


def test_non_streaming_client_disconnect_frees_blocks(server: Server) -> None:
    aborted = server.metric("ladle:request_success_total", finished_reason="abort")
    body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=2))
    server.wait_metric("ladle:num_requests_running", 0, timeout=30)
    assert server.metric("ladle:kv_cache_usage_perc") == 0
    assert server.metric("ladle:request_success_total", finished_reason="abort") == aborted + 1


@pytest.mark.parametrize("how", ["body", "header"])
def test_request_timeout_aborts_and_frees_blocks(server: Server, how: str) -> None:
    """The body's timeout, or the gateway's x-ladle-timeout header, in seconds."""
    body: dict[str, Any] = {"prompt": "Count: 1, 2, 3,", "max_tokens": 400, "ignore_eos": True}
    headers = {}
    if how == "body":
        body["timeout"] = 1
    else:
        headers["x-ladle-timeout"] = "1"
    response = post(server, "/v1/completions", body, headers=headers)
    assert response.status_code == 200
    result = response.json()
    assert result["choices"][0]["finish_reason"] == "abort"
    assert 0 < result["usage"]["completion_tokens"] < 400
    server.wait_metric("ladle:num_requests_running", 0, timeout=30)
    assert server.metric("ladle:kv_cache_usage_perc") == 0
    bad = post(server, "/v1/completions", {"prompt": "x"}, headers={"x-ladle-timeout": "soon"})
    assert_error(bad, 400, "x-ladle-timeout")


def test_metrics_count_what_was_sent(server: Server) -> None:
    before = server.metrics()
    bodies = [
        {"prompt": "Hello", "max_tokens": 3, "temperature": 0},
        {"prompt": "One two three four", "max_tokens": 5, "ignore_eos": True},
        {"prompt": "Stop here", "max_tokens": 4, "stream": True, "ignore_eos": True},
    ]
    usage = {"prompt_tokens": 0, "completion_tokens": 0}
    for body in bodies:
        if body.get("stream"):
            body["stream_options"] = {"include_usage": True}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as stream:
                events = [line for line in stream.iter_lines() if line.startswith("data: {")]
            counts = httpx.Response(200, content=events[-1][6:]).json()["usage"]
        else:
            counts = post(server, "/v1/completions", body).json()["usage"]
        for key in usage:
            usage[key] += counts[key]
    # The engine counts a step before handing out its tokens, and a request's histograms are
    # observed before its response ends, so nothing is pending now.
    after = server.metrics()

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    n = len(bodies)
    assert delta("ladle:prompt_tokens_total") == usage["prompt_tokens"]
    assert delta("ladle:generation_tokens_total") == usage["completion_tokens"]
    assert delta("ladle:request_success_total", finished_reason="length") == n
    assert delta("ladle:request_prompt_tokens_sum") == usage["prompt_tokens"]
    assert delta("ladle:request_generation_tokens_sum") == usage["completion_tokens"]
    for histogram in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert delta(f"ladle:{histogram}_count") == n, histogram
    # Each request here generates more than one token, so each has a TPOT.
    assert delta("ladle:request_time_per_output_token_seconds_count") == n
    # Every token after a request's first closes one inter-token gap.
    assert delta("ladle:inter_token_latency_seconds_count") == usage["completion_tokens"] - n
    # TPOT is one observation per request with more than one token.
    assert delta("ladle:request_time_per_output_token_seconds_count") == n
    assert delta("ladle:iteration_tokens_total_sum") >= usage["prompt_tokens"]
    # SLOs of 0.5, 1 and 2 s are bucket edges, so they read exactly.
    for edge in ("0.5", "1.0", "2.0"):
        assert ("ladle:time_to_first_token_seconds_bucket", (("le", edge),)) in after
        assert ("ladle:e2e_request_latency_seconds_bucket", (("le", edge),)) in after
    assert after[("ladle:num_requests_waiting", ())] == 0


def test_health_endpoints(server: Server) -> None:
    for path in ("/health", "/health/live", "/health/ready"):
        response = httpx.get(f"{server.url}{path}")
        assert response.status_code == 200
        assert response.json() == {"status": "ok"}


def test_request_log_lines(server: Server) -> None:
    post(
        server,
        "/v1/completions",
        # ignore_eos: a sampled EOS would end it early, and change its finish reason.
        {
            "prompt": "secret prompt text",
            "max_tokens": 2,
            "top_k": 3,
            "temperature": 0.5,
            "ignore_eos": True,
        },
        headers={"X-Request-Id": "log-check-1"},
    )
    records = [json.loads(line) for line in server.log_lines() if line.startswith("{")]
    finished = [r for r in records if r.get("request_id") == "log-check-1"]
    assert len(finished) == 1
    record = finished[0]
    assert record["message"] == "request finished"
    assert record["prompt_tokens"] == 3
    assert record["completion_tokens"] == 2
    assert record["finish_reason"] == "length"
    assert record["ttft_s"] > 0
    assert record["total_s"] >= record["ttft_s"]
    assert record["sampling_params"] == {
        "max_tokens": 2,
        "temperature": 0.5,
        "top_k": 3,
        "ignore_eos": True,
    }
    assert "prompt" not in record
    assert all("secret prompt text" not in line for line in server.log_lines())


def test_the_autoscaler_reads_a_runtimes_load_and_its_pace_samples(server: Server) -> None:
    """The operator's scraper on a real runtime's /metrics: its gauges, and inter-token totals
    whose change between two scrapes is one sample for the pace."""
    scraped = [parse_pod("p", httpx.get(f"{server.url}/metrics", timeout=30).text)]
    body = {"prompt": "Count on", "max_tokens": 6, "ignore_eos": True}
    tokens = post(server, "/v1/completions", body).json()["usage"]["completion_tokens"]
    scraped.append(parse_pod("p", httpx.get(f"{server.url}/metrics", timeout=30).text))
    before, after = scraped
    assert (after.error, after.running, after.waiting) == (None, 0, 0)
    assert before.itl_count is not None
    assert after.itl_count is not None
    assert before.itl_sum is not None
    assert after.itl_sum is not None
    assert after.itl_count - before.itl_count == tokens - 1
    assert after.itl_sum > before.itl_sum
    pace = Pace().observe(0.0, [before], target=4).observe(2.0, [after], target=4)
    assert pace.weight == 1


def test_every_reader_of_metrics_finds_its_series_on_a_real_runtime(server: Server) -> None:
    """The gateway's picker, the autoscaler and the canary analysis read one page through one
    parser (ladle.runtime_metrics); a series renamed in the runtime fails here, not in a
    cluster where a reader would see an unknown load or an empty interval."""

    def page() -> str:
        return httpx.get(f"{server.url}/metrics", timeout=30).text

    before = parse_metrics(page())
    post(server, "/v1/completions", {"prompt": "Count on", "max_tokens": 3, "ignore_eos": True})
    text = page()
    after = parse_metrics(text)
    assert after.requests - before.requests == 1
    assert after.errors == before.errors
    assert (after.ttft - before.ttft).count == 1
    assert (after.tpot - before.tpot).count == 1
    assert after.started is not None
    assert parse_load(text.encode()) is not None
    assert parse_pod("p", text).error is None


def test_the_runtime_exports_the_model_server_protocol_of_the_pinned_gaie(server: Server) -> None:
    """Every metric in the model-server protocol document of the pinned Gateway API Inference
    Extension (read from its Go module), under vLLM's name and of the protocol's type, so that
    any endpoint picker reads a Ladle pod as it reads a vLLM one; the gauges agree with ours."""
    protocol = gaie.protocol_metrics()
    assert {m.vllm for m in protocol if not m.optional} == set(PROTOCOL_GAUGES.values())
    post(server, "/v1/completions", {"prompt": "Count on", "max_tokens": 2})
    families = {
        f.name: f
        for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics", timeout=30).text)
    }
    for metric in protocol:
        family = families.get(metric.vllm)
        assert family is not None, f"{metric.name}: no {metric.vllm} on /metrics"
        assert family.type == metric.type, f"{metric.vllm} is a {family.type}"
        if metric.label is not None:
            (sample,) = family.samples
            assert int(sample.labels[metric.label]) > 0, sample.labels
    for ours, theirs in PROTOCOL_GAUGES.items():
        assert families[ours].samples == [
            s._replace(name=ours) for s in families[theirs].samples
        ], ours
    (config,) = families[CACHE_CONFIG_INFO].samples
    assert config.labels["block_size"] == "16"
