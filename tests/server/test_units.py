"""The server's pure parts, without a model: settings layering, keys, parameter mapping,
metric buckets, and the benchmark's statistics."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from ladle import settings
from ladle.cli import build_parser
from ladle.runtime.bench import throughput
from ladle.runtime.bench.serve import RequestResult, summarize
from ladle.runtime.bench.serve_args import parse_slos
from ladle.runtime.bench.workloads import WORKLOADS
from ladle.runtime.config import ConfigError, EngineArgs
from ladle.runtime.sampling_params import RequestOutputKind
from ladle.runtime.server.auth import ApiKeys
from ladle.runtime.server.errors import APIError, from_validation_errors
from ladle.runtime.server.metrics import LATENCY_BUCKETS, one_two_five_buckets
from ladle.runtime.server.params import build_sampling_params
from ladle.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from ladle.runtime.server.settings import ServerSettings
from ladle.settings import SettingError


def resolved(argv: list[str], env: dict[str, str]) -> argparse.Namespace:
    """``ladle serve`` ARGV as the real CLI resolves it under ENV."""
    parser = build_parser()
    return settings.resolve(parser.parse_args(["serve", *argv]), env, parser)


def test_command_line_beats_environment_beats_config_file(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        "port: 9000\nmax-waiting-requests: 3\ndrain_timeout: 12\n"
        "enable-prefix-caching: false\nkv-cache-memory: 1048576\napi-key: [a, b]\n"
    )
    env = {"LADLE_SERVE_MAX_WAITING_REQUESTS": "7", "LADLE_SERVE_LOG_PROMPTS": "true"}
    args = resolved(["--config", str(config), "--port", "9100"], env)
    server = ServerSettings.from_namespace(args)
    engine = EngineArgs.from_cli_args(args)
    assert server.port == 9100  # command line
    assert server.max_waiting_requests == 7  # environment over the file
    assert server.log_prompts is True
    assert server.drain_timeout == 12  # file, underscores accepted
    assert server.api_keys == ["a", "b"]
    assert server.host == "127.0.0.1"  # default
    assert engine.enable_prefix_caching is False
    assert engine.kv_cache_memory == 1 << 20
    assert engine.max_num_seqs == 256


def test_the_bare_command_is_the_default_settings() -> None:
    """The flags take their defaults from the dataclasses that the engine and the server are
    built from, so ``ladle serve`` and ``LLM()`` or a test's ``ServerSettings()`` agree."""
    args = resolved([], {})
    assert EngineArgs.from_cli_args(args) == EngineArgs()
    assert ServerSettings.from_namespace(args) == ServerSettings()


def test_config_path_from_environment_and_bad_values(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("served-model-name: from-file\n")
    assert resolved([], {"LADLE_SERVE_CONFIG": str(config)}).served_model_name == "from-file"
    config.write_text("max-num-seqz: 1\n")
    with pytest.raises(SettingError, match=r"'max-num-seqz' is not a setting.*max-num-seqs"):
        resolved(["--config", str(config)], {})
    with pytest.raises(SettingError, match="LADLE_SERVE_PORT='eighty': expected a whole number"):
        resolved([], {"LADLE_SERVE_PORT": "eighty"})
    with pytest.raises(SettingError, match="expected one of auto, float32"):
        resolved([], {"LADLE_SERVE_DTYPE": "int3"})
    with pytest.raises(SettingError, match="expected true or false"):
        resolved([], {"LADLE_SERVE_LOG_PROMPTS": "maybe"})


def test_api_keys_from_flags_and_a_rotating_file(tmp_path: Path) -> None:
    assert not ApiKeys([]).enabled
    keys = ApiKeys(["alpha", "beta"])
    assert keys.check("beta")
    assert not keys.check("gamma")
    assert not keys.check("")
    secret = tmp_path / "key"
    secret.write_text("  one \n\ntwo\n")
    from_file = ApiKeys([], secret)
    assert from_file.check("one")
    assert from_file.check("two")
    secret.write_text("three\n")
    stat = secret.stat()
    os.utime(secret, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert not from_file.check("one")
    assert from_file.check("three")
    secret.write_text("\n")
    with pytest.raises(ConfigError, match="holds no key"):
        ApiKeys([], secret)


def test_request_fields_map_to_sampling_params_by_name() -> None:
    request = CompletionRequest.model_validate(
        {
            "prompt": "x",
            "stop": "END",
            "logit_bias": {"42": 5},
            "top_k": 3,
            "min_p": 0.1,
            "repetition_penalty": 1.1,
            "user": "ignored",
            "priority": 2,
        }
    )
    params = build_sampling_params(request, {})
    assert params.stop == ["END"]
    assert params.logit_bias == {42: 5.0}
    assert (params.top_k, params.min_p, params.repetition_penalty) == (3, 0.1, 1.1)
    assert params.max_tokens == 16  # the completions API's default
    assert params.output_kind is RequestOutputKind.DELTA
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9}
    )
    assert build_sampling_params(chat, {"max_tokens": 9}).max_tokens == 9


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"frobnicate": 1}, "frobnicate"), ({"top_k": -5}, "top_k"), ({"n": 0}, "n")],
)
def test_bad_or_unknown_fields_name_the_parameter(extra: dict[str, int], param: str) -> None:
    request = CompletionRequest.model_validate({"prompt": "x", **extra})
    with pytest.raises((APIError, ValueError)) as info:
        build_sampling_params(request, {})
    assert getattr(info.value, "param", None) == param


def test_latency_buckets_hold_the_slo_edges() -> None:
    assert {0.5, 1.0, 2.0} <= set(LATENCY_BUCKETS)
    assert one_two_five_buckets(512) == [1, 2, 5, 10, 20, 50, 100, 200, 500]


def test_bench_statistics_follow_vllm_definitions() -> None:
    fast = RequestResult(True, None, 10, 5, ttft=0.1, latency=0.5, itl=[0.1] * 4)
    slow = RequestResult(True, None, 20, 3, ttft=1.0, latency=2.0, itl=[0.5, 0.5])
    failed = RequestResult(False, "HTTP 500", 10)
    slos = parse_slos(["ttft:500", "tpot:200"])
    assert slos == {"ttft": 0.5, "tpot": 0.2}
    summary = summarize([fast, slow, failed], duration=4.0, percentiles=[50, 99], slos=slos)
    assert summary["completed"] == 2
    assert summary["failed"] == 1
    assert summary["total_output_tokens"] == 8
    assert summary["output_throughput"] == 2.0
    assert summary["total_token_throughput"] == 38 / 4
    assert summary["goodput"] == 0.25  # only the fast request meets both SLOs
    assert summary["mean_tpot_ms"] == pytest.approx((100 + 500) / 2)  # 0.4/4 and 1.0/2
    assert summary["p50_itl_ms"] == pytest.approx(100)
    assert summary["mean_e2el_ms"] == pytest.approx(1250)
    with pytest.raises(ValueError, match="METRIC:MS"):
        parse_slos(["latency:5"])


def test_throughput_workloads_draw_distinct_prompts() -> None:
    """Workload B must not start with A's prompts, or B would run on A's prefix cache."""
    a, b = WORKLOADS["A"].prompts(0), WORKLOADS["B"].prompts(0)
    assert len(set(a)) == len(a)
    assert len(set(b)) == len(b)
    assert not set(a) & set(b)
    assert WORKLOADS["A"].prompts(0) == a  # reproducible
    assert WORKLOADS["A"].prompts(1) != a


def test_throughput_ratios_are_taken_within_rounds() -> None:
    """A round where the VM ran slow for both systems must not count as a slow engine: the
    ratio is per round, then the median and spread over rounds."""
    results = [
        throughput.Result("A", "ceiling", 0, 10.0, 100),
        throughput.Result("A", "ladle", 0, 12.5, 100),
        throughput.Result("A", "ceiling", 1, 20.0, 100),  # a slow minute for both
        throughput.Result("A", "ladle", 1, 25.0, 100),
        throughput.Result("A", "ceiling", 2, 10.0, 100),
        throughput.Result("A", "ladle", 2, 11.0, 100),
    ]
    summary = throughput.summarize(results)["A"]
    ratio = summary["ladle/ceiling"]
    assert ratio["median"] == pytest.approx(0.8)
    assert (ratio["min"], ratio["max"]) == pytest.approx((0.8, 10 / 11))
    assert summary["ladle"]["median"] == pytest.approx(100 / 12.5)
    assert "ladle/transformers" not in summary
    assert "80% [80%-91%]" in throughput.format_summary({"A": summary})


def test_a_json_error_is_placed_in_the_body_whatever_type_it_arrives_as() -> None:
    """FastAPI hands over the decoded text today; bytes must place the error the same way,
    never against an empty text (which would call every error "line 1")."""
    text = '{\n  "prompt": "é",\n  "n": 1,\n}'
    with pytest.raises(json.JSONDecodeError) as broken:
        json.loads(text)
    pos, msg = broken.value.pos, broken.value.msg
    error = {"type": "json_invalid", "loc": ("body", pos), "ctx": {"error": msg}}
    where = "at line 4, column 1 (character 29)"
    for body in (text, text.encode()):
        assert where in from_validation_errors([error], body).message, type(body)
    assert "not valid JSON: Expecting" in from_validation_errors([error], None).message
