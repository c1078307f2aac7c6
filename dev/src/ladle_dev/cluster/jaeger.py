"""Jaeger v2 from its pinned Go module (``hack/k8s/jaeger``), for the tests that read traces
back: it takes OTLP over HTTP, as any OpenTelemetry SDK exports it, and answers Jaeger's query
API from memory. Cached like the cluster's binaries, under a key of its own."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from ladle_dev.cluster import build
from ladle_dev.cluster.build import Tool
from ladle_dev.cluster.control_plane import HOST, free_ports

MODULE = "github.com/jaegertracing/jaeger"
TOOLSET = build.ToolSet("jaeger", (Tool("jaeger", "jaeger", f"{MODULE}/cmd/jaeger", MODULE),))


@dataclass
class Jaeger:
    """A running Jaeger: ``otlp`` is where exporters send (OTLP/HTTP), ``query`` its API."""

    proc: subprocess.Popen[bytes]
    otlp: str
    query: str
    log: Path

    def trace(self, trace_id: str) -> list[dict[str, Any]] | None:
        """The trace's spans once Jaeger has them, each with its service, its tags as a dict
        and its parent's span id; None before."""
        got = httpx.get(f"{self.query}/api/traces/{trace_id}", timeout=5)
        if got.status_code != 200 or not got.json().get("data"):
            return None
        (data,) = got.json()["data"]
        services = {pid: p["serviceName"] for pid, p in data["processes"].items()}
        return [
            {
                **span,
                "service": services[span["processID"]],
                "tags": {t["key"]: t["value"] for t in span["tags"]},
                "parent": next(
                    (r["spanID"] for r in span["references"] if r["refType"] == "CHILD_OF"), None
                ),
            }
            for span in data["spans"]
        ]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def start(folder: Path, otlp_host: str = HOST) -> Jaeger:
    """Jaeger taking OTLP on ``otlp_host`` (the cluster's host address, for pods to reach) and
    answering queries on the loopback, once its query API answers."""
    binary = TOOLSET.bin_dir() / "jaeger"
    if not binary.is_file():
        raise FileNotFoundError("Jaeger is not built: run `make cluster-build`")
    (query, grpc), (otlp,) = free_ports(2), free_ports(1, otlp_host)
    config = {
        "service": {
            "extensions": ["jaeger_storage", "jaeger_query"],
            "pipelines": {
                "traces": {"receivers": ["otlp"], "exporters": ["jaeger_storage_exporter"]}
            },
            "telemetry": {"metrics": {"level": "none"}, "logs": {"level": "warn"}},
        },
        "extensions": {
            "jaeger_query": {
                "storage": {"traces": "memory"},
                "http": {"endpoint": f"{HOST}:{query}"},
                "grpc": {"endpoint": f"{HOST}:{grpc}"},
            },
            "jaeger_storage": {"backends": {"memory": {"memory": {"max_traces": 1000}}}},
        },
        "receivers": {"otlp": {"protocols": {"http": {"endpoint": f"{otlp_host}:{otlp}"}}}},
        "exporters": {"jaeger_storage_exporter": {"trace_storage": "memory"}},
    }
    path = folder / "jaeger.yaml"
    path.write_text(yaml.safe_dump(config))
    log = folder / "jaeger.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(binary), "--config", str(path)], stdout=out, stderr=subprocess.STDOUT
        )
    found = Jaeger(proc, f"http://{otlp_host}:{otlp}", f"http://{HOST}:{query}", log)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"Jaeger exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{found.query}/api/services", timeout=2).status_code == 200:
                return found
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    found.stop()
    raise TimeoutError(f"Jaeger's query API did not answer in 60 s:\n{log.read_text()[-3000:]}")
