"""``ladle operator`` settings: every flag explained, one rule for variables, one line per
mistake."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any

import pytest
from kube_harness import free_port

from ladle import settings
from ladle.cli import build_parser
from ladle.operator.config import DEFAULT_RUNTIME_IMAGE
from ladle_dev.pytest_plugin import KubeCluster


def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LADLE_OPERATOR_")}
    return subprocess.run(
        [sys.executable, "-m", "ladle.cli", *args],
        env={**clean, **env, "KUBECONFIG": "/nonexistent", "COLUMNS": "400"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def resolve(*argv: str, env: dict[str, str]) -> dict[str, Any]:
    """``ladle operator ARGV`` as the real CLI resolves it under ENV."""
    parser = build_parser()
    return vars(settings.resolve(parser.parse_args(["operator", *argv]), env, parser))


def test_every_flag_has_a_help_line_a_default_and_its_variable() -> None:
    result = run("operator", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    flags = set(re.findall(r"--([a-z][a-z-]+)", result.stdout)) - {"help", "no-leader-elect"}
    assert "lease-namespace" in flags
    for flag in flags:
        variable = "LADLE_OPERATOR_" + flag.upper().replace("-", "_")
        assert re.search(rf"\(default: [^;()]+; env {variable}\)", text), flag
    # The fallback runtime image and the chart's Lease namespace are shown, not left to guess.
    assert f"(default: {DEFAULT_RUNTIME_IMAGE}; env LADLE_OPERATOR_RUNTIME_IMAGE)" in text
    assert "(default: the pod's namespace, else ladle-system;" in text


@pytest.mark.parametrize(
    ("spelling", "value"),
    [("1", True), ("true", True), ("Yes", True), ("ON", True), ("0", False), ("off", False)],
)
def test_booleans_accept_the_usual_spellings(spelling: str, value: bool) -> None:
    assert resolve(env={"LADLE_OPERATOR_LEADER_ELECT": spelling})["leader_elect"] is value


def test_the_command_line_wins_and_defaults_match_the_chart() -> None:
    values = resolve(
        "--no-leader-elect",
        "--workers",
        "4",
        env={"LADLE_OPERATOR_LEADER_ELECT": "true", "LADLE_OPERATOR_WORKERS": "8"},
    )
    assert (values["leader_elect"], values["workers"]) == (False, 4)
    defaults = resolve(env={})
    # The chart's release namespace, so that a local operator competes for the same Lease.
    assert defaults["lease_namespace"] == "ladle-system"
    assert defaults["log_level"] == "info"
    assert defaults["lease_duration"] == 15
    assert resolve(env={"LADLE_OPERATOR_LEASE_NAMESPACE": "ops"})["lease_namespace"] == "ops"
    assert resolve("--log-level", "DEBUG", env={})["log_level"] == "debug"
    assert resolve(env={"LADLE_OPERATOR_LEASE_DURATION": "20s"})["lease_duration"] == 20


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("LADLE_OPERATOR_LEADER_ELECT", "maybe", "expected true or false"),
        ("LADLE_OPERATOR_LEASE_DURATION", "15m", "expected a whole number of seconds >= 2"),
        ("LADLE_OPERATOR_WORKERS", "0", "expected a whole number >= 1"),
        ("LADLE_OPERATOR_METRICS_BIND_ADDRESS", "8080", "expected HOST:PORT"),
        ("LADLE_OPERATOR_LOG_LEVEL", "loud", "expected one of debug, info, warning, error"),
        ("LADLE_OPERATOR_RENEW_DEADLINE", "20", "renew deadline < lease duration"),
    ],
)
def test_a_bad_variable_is_one_line_naming_it(variable: str, value: str, expected: str) -> None:
    result = run("operator", **{variable: value})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("ladle operator: ")
    assert expected in lines[0]
    if "deadline" not in expected:
        assert f"{variable}={value!r}" in lines[0]
    assert "Traceback" not in result.stderr


def test_a_bad_flag_is_a_usage_error() -> None:
    result = run("operator", "--lease-duration", "soon")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "ladle operator: --lease-duration 'soon': expected a whole number of seconds >= 2"
    )
    assert "Traceback" not in result.stderr


def test_an_operator_variable_never_breaks_other_subcommands() -> None:
    bad = {"LADLE_OPERATOR_LEASE_DURATION": "15s5", "LADLE_OPERATOR_LEADER_ELECT": "maybe"}
    for command in (["cluster", "--help"], ["operator", "--help"], ["--version"]):
        result = run(*command, **bad)
        assert result.returncode == 0, (command, result.stderr)
        assert "Traceback" not in result.stderr


@pytest.mark.cluster
def test_a_lease_namespace_that_does_not_exist_is_one_line_and_exit_2(
    k8s_cluster: KubeCluster,
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ladle.cli", "operator", "--lease-namespace", "no-such-ns",
         "--metrics-bind-address", f"127.0.0.1:{free_port()}", "--log-level", "error"],
        env={**os.environ, "KUBECONFIG": str(k8s_cluster.kubeconfig)},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "the Lease namespace no-such-ns does not exist" in lines[0]
    assert "--lease-namespace" in lines[0]
