"""Prometheus, promtool and a kstatus probe, built from Go modules and cached like the cluster.

The alert rules are checked and unit-tested with promtool, the end-to-end test scrapes the local
cluster with a real Prometheus, and kstatus's own library judges our conditions. They share the
cluster binaries' recipe (``build.build_tools``) under a cache key of their own, so pinning a
new Prometheus never rebuilds Kubernetes, and the reverse.

Prometheus is built with ``remove_all_sd,enable_kubernetes_sd``: every cloud discovery SDK is
left out (file and HTTP discovery always stay), and without ``builtinassets`` there is no web
UI, only the API, so no JavaScript toolchain is involved.
"""

from __future__ import annotations

from pathlib import Path

from ladle_dev.cluster import build
from ladle_dev.cluster.build import BuildError, Tool

RECIPE = "1"
PROMETHEUS_TAGS = ("remove_all_sd", "enable_kubernetes_sd")
_VERSION_FLAGS = (
    "github.com/prometheus/common/version.Version",
    "github.com/prometheus/common/version.BuildDate",
)

TOOLS = (
    Tool(
        "promtool",
        "prometheus",
        "github.com/prometheus/prometheus/cmd/promtool",
        "github.com/prometheus/prometheus",
        _VERSION_FLAGS,
        PROMETHEUS_TAGS,
    ),
    Tool(
        "prometheus",
        "prometheus",
        "github.com/prometheus/prometheus/cmd/prometheus",
        "github.com/prometheus/prometheus",
        _VERSION_FLAGS,
        PROMETHEUS_TAGS,
    ),
    Tool("kstatus-compute", "kstatus", "ladle.local/hack/k8s/kstatus", "sigs.k8s.io/cli-utils"),
)


def bin_dir() -> Path:
    """The versioned cache folder of these tools (beside the cluster's, keyed separately)."""
    return build.cache_root() / "sre-tools" / build.versions_hash(TOOLS, RECIPE) / "bin"


def missing() -> list[str]:
    return [tool.name for tool in TOOLS if not (bin_dir() / tool.name).is_file()]


def binary(name: str) -> Path:
    """Path of a built tool; raises if it has not been built yet."""
    path = bin_dir() / name
    if not path.is_file():
        raise BuildError(f"{path} is missing; run `ladle cluster build` first")
    return path


def build_missing(force: bool = False) -> Path:
    """Build whatever is missing (everything with ``force``) and return the ``bin/`` folder."""
    target = bin_dir()
    todo = [tool for tool in TOOLS if force or tool.name in missing()]
    if not todo:
        print(f"prometheus, promtool and kstatus-compute up to date in {target}", flush=True)
        return target
    build.build_tools(todo, target)
    build.prune(target.parent)
    return target
