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

from ladle_dev.cluster import build
from ladle_dev.cluster.build import Tool

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

TOOLSET = build.ToolSet("sre-tools", TOOLS, RECIPE)
