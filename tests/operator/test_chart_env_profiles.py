"""The chart's environment for its components: what each ``envProfile`` renders, diffed
against no profile, and ``tracing``, down to the runtime pods the operator then makes.
``helm template`` only: no cluster."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from ladle import settings
from ladle.api import parse_isvc
from ladle.cli import build_parser
from ladle.operator.config import OperatorConfig
from ladle.operator.desired import desired_children
from ladle_dev.cluster import build

CHART = Path(__file__).resolve().parents[2] / "charts" / "ladle"
PROFILES = ("dev", "staging", "prod")
Docs = dict[tuple[str, str], dict[str, Any]]


def render(*values: str) -> subprocess.CompletedProcess[str]:
    helm = build.bin_dir() / "helm"
    if not helm.is_file():
        pytest.fail("helm is not built: run `ladle cluster build`")
    argv = [str(helm), "template", "ladle", str(CHART), "--namespace", "ladle-system"]
    argv += ["--kube-version", "1.34.0"]
    for value in values:
        argv += ["--set", value]
    return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)


def objects(*values: str) -> Docs:
    done = render(*values)
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def env(docs: Docs, deployment: str) -> dict[str, str]:
    ctr = docs[("Deployment", deployment)]["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in ctr["env"] if "value" in e}


def without_profile_env(docs: Docs) -> Docs:
    """The objects less what a profile may set: the log levels and the runtime's profile."""
    rest = copy.deepcopy(docs)
    for name in ("ladle", "ladle-gateway"):
        ctr = rest[("Deployment", name)]["spec"]["template"]["spec"]["containers"][0]
        ctr["env"] = [
            e
            for e in ctr["env"]
            if not e["name"].endswith("_LOG_LEVEL")
            and e["name"] != "LADLE_OPERATOR_RUNTIME_ENV_PROFILE"
        ]
    return rest


@pytest.fixture(scope="module")
def rendered() -> dict[str, Docs]:
    return {p: objects(f"envProfile={p}") for p in ("", *PROFILES)}


def test_each_profile_renders_what_the_table_says_and_nothing_else(
    rendered: dict[str, Docs],
) -> None:
    said = {}
    for profile, docs in rendered.items():
        operator, gateway = env(docs, "ladle"), env(docs, "ladle-gateway")
        said[profile] = (
            operator.get("LADLE_OPERATOR_RUNTIME_ENV_PROFILE"),
            operator["LADLE_OPERATOR_LOG_LEVEL"],
            gateway["LADLE_GATEWAY_LOG_LEVEL"],
        )
        assert without_profile_env(docs) == without_profile_env(rendered[""]), profile
    assert said == {
        "": (None, "info", "info"),
        "dev": ("dev", "debug", "debug"),
        "staging": ("staging", "info", "info"),
        "prod": ("prod", "info", "info"),
    }


def test_explicit_log_levels_win_over_the_profile() -> None:
    docs = objects("envProfile=dev", "logLevel=WARNING", "gateway.logLevel=error")
    assert env(docs, "ladle")["LADLE_OPERATOR_LOG_LEVEL"] == "WARNING"
    assert env(docs, "ladle")["LADLE_OPERATOR_RUNTIME_ENV_PROFILE"] == "dev"
    assert env(docs, "ladle-gateway")["LADLE_GATEWAY_LOG_LEVEL"] == "error"


def test_an_unknown_profile_fails_the_render() -> None:
    done = render("envProfile=qa")
    assert done.returncode != 0
    assert 'envProfile: "qa" is not one of dev, staging, prod (or empty)' in done.stderr


@pytest.mark.parametrize("profile", PROFILES)
def test_the_operator_reads_the_charts_profile_into_its_runtime_pods(
    rendered: dict[str, Docs], profile: str
) -> None:
    """The chart's environment, resolved by `ladle operator` as in its pod, then the runtime
    Deployment it renders from it: the flag, and the profile's probe timings."""
    parser = build_parser()
    args = settings.resolve(
        settings.parse(parser, ["operator"]), env(rendered[profile], "ladle"), parser
    )
    assert args.runtime_env_profile == profile
    config = OperatorConfig(runtime_env_profile=args.runtime_env_profile)
    isvc = parse_isvc(
        {
            "metadata": {"name": "chat", "namespace": "a", "uid": "u", "generation": 1},
            "spec": {"model": {"name": "m", "source": {"builtin": {}}}},
        }
    )
    pod = desired_children(isvc, None, 1, config).deployment["spec"]["template"]["spec"]
    ctr = pod["containers"][0]
    assert ctr["args"][-2:] == ["--env-profile", profile]
    live = ctr["livenessProbe"]
    assert (live["periodSeconds"], live["failureThreshold"]) == (
        (30, 20) if profile == "dev" else (10, 3)
    )


def test_the_charts_tracing_reaches_the_gateway_and_the_runtime_pods() -> None:
    """tracing.endpoint, resolved from the rendered environment by `ladle gateway` and by
    `ladle operator` as in their pods: the gateway traces, and so do the runtime pods the
    operator renders; without it, neither has a tracing flag."""
    parser = build_parser()
    off = objects()
    assert not [k for k in env(off, "ladle-gateway") if "TRACE" in k]
    assert not [k for k in env(off, "ladle") if "TRACE" in k]
    docs = objects("tracing.endpoint=http://otel.observability:4318", "tracing.samplingRatio=0.1")
    gateway = settings.resolve(
        settings.parse(parser, ["gateway"]), env(docs, "ladle-gateway"), parser
    )
    assert (gateway.otlp_traces_endpoint, gateway.trace_sample_ratio) == (
        "http://otel.observability:4318",
        0.1,
    )
    args = settings.resolve(settings.parse(parser, ["operator"]), env(docs, "ladle"), parser)
    config = OperatorConfig(
        runtime_otlp_traces_endpoint=args.runtime_otlp_traces_endpoint,
        runtime_trace_sample_ratio=args.runtime_trace_sample_ratio,
    )
    isvc = parse_isvc(
        {
            "metadata": {"name": "chat", "namespace": "a", "uid": "u", "generation": 1},
            "spec": {"model": {"name": "m", "source": {"builtin": {}}}},
        }
    )
    ctr = desired_children(isvc, None, 1, config).deployment["spec"]["template"]["spec"]
    flags = ctr["containers"][0]["args"]
    assert flags[-4:] == [
        "--otlp-traces-endpoint", "http://otel.observability:4318", "--trace-sample-ratio", "0.1"
    ]  # fmt: skip
