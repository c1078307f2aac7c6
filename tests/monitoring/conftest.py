"""Fixtures for the monitoring tests: the chart rendered with monitoring on, and the tools.

Rendering needs only the cached helm binary, and promtool comes from ``ladle cluster build``
too; neither needs a running cluster.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from ladle_dev.cluster import build, sre_tools

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "ladle"
HERE = Path(__file__).resolve().parent
# What manifests/ladle-monitoring.yaml is rendered with (scripts/gen_manifests.py).
MONITORING = (
    "monitoring.prometheusRule.enabled=true",
    "monitoring.podMonitors.runtime.enabled=true",
    "monitoring.podMonitors.gateway.enabled=true",
    "monitoring.podMonitors.operator.enabled=true",
    "monitoring.dashboard.enabled=true",
)

Render = Callable[..., subprocess.CompletedProcess[str]]


def tool(path: Path) -> Path:
    if not path.is_file():
        pytest.fail(f"{path.name} is not built: run `make cluster-build`")
    return path


@pytest.fixture(scope="session")
def promtool() -> Path:
    return tool(sre_tools.TOOLSET.bin_dir() / "promtool")


@pytest.fixture(scope="session")
def helm_template() -> Render:
    """``helm template`` of the chart with ``--set`` values; never raises, for error checks."""
    helm = tool(build.bin_dir() / "helm")

    def render(
        *values: str, release: str = "ladle", namespace: str = "ladle-system", crds: bool = False
    ) -> Any:
        argv = [str(helm), "template", release, str(CHART), "--namespace", namespace]
        argv += ["--kube-version", "1.34.0", *(["--include-crds"] if crds else [])]
        for value in values:
            argv += ["--set", value]
        return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)

    return render


def documents(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


@pytest.fixture(scope="session")
def monitoring_objects(helm_template: Render) -> list[dict[str, Any]]:
    rendered = helm_template(*MONITORING)
    assert rendered.returncode == 0, rendered.stderr
    return [d for d in documents(rendered.stdout) if d["kind"] in ("PrometheusRule", "PodMonitor")]


@pytest.fixture(scope="session")
def prometheus_rule(monitoring_objects: list[dict[str, Any]]) -> dict[str, Any]:
    (rule,) = [d for d in monitoring_objects if d["kind"] == "PrometheusRule"]
    return rule
