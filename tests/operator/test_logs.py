"""The operator's log as a log shipper reads it: a real ``ladle operator`` against the real API
server writes one JSON object a line, in the schema ``ladle serve`` and ``ladle gateway`` write
(tests/server/test_mistakes.py checks theirs); an object is ``namespace/name`` or, cluster-scoped,
``name``; a Warning Event is logged at warning; kopf's chatter stays at debug."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from kube_harness import Kube, OperatorProcess, isvc_manifest, pool_manifest, wait_until

from ladle.flag_types import LOG_LEVELS

pytestmark = pytest.mark.cluster

# The keys every line of every Ladle process carries.
SHARED = {"time", "level", "logger", "message"}
CHATTER = re.compile(r"^(Activity|Handler) .* (succeeded|finished)")


def records(operator: OperatorProcess) -> list[dict[str, Any]]:
    """Every line of the operator's log, each parsed as JSON (a line that is not fails)."""
    parsed = []
    for number, line in enumerate(operator.log.read_text().splitlines(), 1):
        try:
            parsed.append(json.loads(line))
        except json.JSONDecodeError:
            pytest.fail(f"line {number} of the operator's log is not JSON: {line!r}")
    return parsed


def test_the_operator_logs_one_schema_and_warning_events_at_warning(
    operator: OperatorProcess, kube: Kube, k8s_namespace: str
) -> None:
    ns = k8s_namespace
    # Two pools of the same nodes: each is Degraded (OverlappingPools), a Warning Event about
    # a cluster-scoped object.
    pool, twin = f"{ns}-logs-a", f"{ns}-logs-b"
    kube.apply(pool_manifest(pool))
    kube.apply(pool_manifest(twin))
    try:
        kube.apply(isvc_manifest("prof", resources={"gpus": 0}), ns)
        kube.wait_condition(ns, "prof", "Ready")
        # Profiling asked for without an API key: a Warning Event about an InferenceService.
        annotated = kube.kubectl(
            "annotate", "-n", ns, "lisvc", "prof", "ladle.dev/profiling=enabled"
        )
        assert annotated.returncode == 0, annotated.stderr

        def warned() -> tuple[dict[str, Any], dict[str, Any]] | None:
            events = [r for r in records(operator) if r.get("type") == "Warning"]
            about_isvc = [r for r in events if r.get("event") == "ProfilingNeedsAPIKey"]
            about_pool = [r for r in events if r.get("object") == pool]
            return (about_isvc[0], about_pool[0]) if about_isvc and about_pool else None

        isvc_line, pool_line = wait_until(warned, "both Warning Events in the operator's log")
    finally:
        kube.kubectl("delete", "-n", ns, "lisvc", "prof", "--wait=false")
        kube.kubectl("delete", "gpupool", pool, twin, "--wait=false")

    assert (isvc_line["level"], isvc_line["object"]) == ("warning", f"{ns}/prof")
    assert (pool_line["level"], pool_line["kind"]) == ("warning", "GPUPool")
    assert pool_line["event"] == "OverlappingPools", pool_line
    lines = records(operator)
    assert any(r.get("event") == "Ready" and r["level"] == "info" for r in lines)
    for record in lines:
        assert set(record) >= SHARED, record
        assert record["level"] in LOG_LEVELS, record
        assert "exc_info" not in record, record
        if "object" in record:
            # "ns/name" or "name", never "/name" or a list.
            assert re.fullmatch(r"([a-z0-9-]+/)?[a-z0-9.-]+", record["object"]), record
        if record.get("type") == "Warning":
            assert record["level"] == "warning", record
        # Library chatter is debug, which --log-level info leaves out.
        assert not (record["logger"].startswith("kopf") and record["level"] == "info"), record
        assert not CHATTER.match(record["message"]), record
