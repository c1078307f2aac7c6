"""Jaeger v2 from its pinned Go module (``hack/k8s/jaeger``), for the tests that read traces
back: it takes OTLP over HTTP, as any OpenTelemetry SDK exports it, and answers Jaeger's query
API from memory. Cached like the cluster's binaries, under a key of its own."""

from __future__ import annotations

from ladle_dev.cluster import build
from ladle_dev.cluster.build import Tool

MODULE = "github.com/jaegertracing/jaeger"
TOOLSET = build.ToolSet("jaeger", (Tool("jaeger", "jaeger", f"{MODULE}/cmd/jaeger", MODULE),))
