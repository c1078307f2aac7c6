"""``ladle operator`` settings: every flag explained, one rule for variables, one line per
mistake."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from typing import Any

import pytest
from kube_harness import free_port

from ladle.cluster.pytest_plugin import KubeCluster
from ladle.operator import cli


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


def parsed(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_parsers(parser.add_subparsers())
    return parser.parse_args(["operator", *argv])


def test_every_flag_has_a_help_line_a_default_and_its_variable() -> None:
    result = run("operator", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    flags = set(re.findall(r"--([a-z][a-z-]+)", result.stdout)) - {"help", "no-leader-elect"}
    assert flags == {s.flag for s in cli.SETTINGS}
    for setting in cli.SETTINGS:
        variable = "LADLE_OPERATOR_" + setting.flag.upper().replace("-", "_")
        assert f"(default: {setting.shown}; env {variable})" in text, setting.flag
    # The fallback runtime image is shown, not left to guess.
    assert "ghcr.io/ladle-dev/ladle-runtime:" in text


@pytest.mark.parametrize(
    ("spelling", "value"),
    [("1", True), ("true", True), ("Yes", True), ("ON", True), ("0", False), ("off", False)],
)
def test_booleans_accept_the_usual_spellings(spelling: str, value: bool) -> None:
    assert cli.resolve(parsed(), {"LADLE_OPERATOR_LEADER_ELECT": spelling})["leader_elect"] is value


def test_the_command_line_wins_and_defaults_match_the_chart() -> None:
    values: dict[str, Any] = cli.resolve(
        parsed("--no-leader-elect", "--workers", "4"),
        {"LADLE_OPERATOR_LEADER_ELECT": "true", "LADLE_OPERATOR_WORKERS": "8"},
    )
    assert (values["leader_elect"], values["workers"]) == (False, 4)
    defaults = cli.resolve(parsed(), {})
    # The chart's release namespace, so that a local operator competes for the same Lease.
    assert defaults["lease_namespace"] == "ladle-system"
    assert defaults["log_level"] == "info"
    assert cli.resolve(parsed(), {"LADLE_OPERATOR_LEASE_NAMESPACE": "ops"})["lease_namespace"] == (
        "ops"
    )
    assert cli.resolve(parsed("--log-level", "DEBUG"), {})["log_level"] == "debug"


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("LADLE_OPERATOR_LEADER_ELECT", "maybe", "expected true or false"),
        ("LADLE_OPERATOR_LEASE_DURATION", "15m", "expected a whole number of seconds"),
        ("LADLE_OPERATOR_WORKERS", "0", "expected a whole number of at least 1"),
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
    assert "argument --lease-duration: expected a whole number of seconds" in result.stderr
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
