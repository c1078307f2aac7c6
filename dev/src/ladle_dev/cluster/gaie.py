"""The Gateway API Inference Extension from its pinned Go module (``hack/k8s/gaie``): the CRDs
that tests install (with the Gateway API's HTTPRoute, from ``hack/k8s/gateway-api``), the
model-server protocol document that the runtime's metrics are checked against, and the
reference endpoint picker (EPP), built and cached like the cluster's binaries.

Everything is read from the modules that the Go module proxy serves, never copied by hand, so
a new pin brings its CRDs, its protocol and its picker together.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ladle_dev.cluster import build
from ladle_dev.cluster.build import Tool

MODULE = "sigs.k8s.io/gateway-api-inference-extension"
TOOLSET = build.ToolSet("gaie", (Tool("epp", "gaie", f"{MODULE}/cmd/epp", MODULE),))
POOL_CRD = "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml"
MODEL_REWRITE_CRD = "config/crd/bases/inference.networking.x-k8s.io_inferencemodelrewrites.yaml"
PROTOCOL_DOC = "docs/proposals/003-model-server-protocol/README.md"
# The Gateway API (``hack/k8s/gateway-api``), for the HTTPRoute CRD.
GATEWAY_API = "sigs.k8s.io/gateway-api"
HTTP_ROUTE_CRD = "config/crd/standard/gateway.networking.k8s.io_httproutes.yaml"


def module_dir() -> Path:
    """The pinned module's source folder (downloaded on first use)."""
    _, _, path = build.module_info(build.find_go(), "gaie", MODULE)
    return path


def http_route_crd() -> Path:
    """The HTTPRoute CRD of the pinned Gateway API."""
    _, _, path = build.module_info(build.find_go(), "gateway-api", GATEWAY_API)
    return path / HTTP_ROUTE_CRD


@dataclass(frozen=True)
class ProtocolMetric:
    """One row of the protocol's metrics table, with vLLM's name for it."""

    name: str
    type: str
    vllm: str
    label: str | None
    optional: bool


def protocol_metrics(doc: Path | None = None) -> list[ProtocolMetric]:
    """The metrics that the model-server protocol asks for, from its document's table: the
    vLLM column names the metric (and, for an info gauge, the label that carries the value)."""
    text = (doc or module_dir() / PROTOCOL_DOC).read_text()
    rows: list[ProtocolMetric] = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        # The header and the rule name no metric in backquotes.
        names = re.findall(r"`([^`]+)`", cells[3]) if len(cells) > 3 else []
        if not names:
            continue
        name = cells[0].removeprefix("[Optional]").strip()
        kind = cells[1].split("/")[-1].strip().lower()
        label = names[1] if len(names) > 1 and "label" in cells[3] else None
        rows.append(ProtocolMetric(name, kind, names[0], label, name != cells[0]))
    return rows
