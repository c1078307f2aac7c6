"""What the event recorder logs beside each Event it posts: one JSON line in the schema every
Ladle log shares, naming the object as ``namespace/name`` or, cluster-scoped, ``name``."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest

from ladle import logs
from ladle.kube import KubeClient
from ladle.operator.events import EventRecorder, ObjectRef
from ladle.operator.telemetry import Metrics

POOL = ObjectRef("ladle.dev/v1alpha1", "GPUPool", "", "a100", "uid-1")
ISVC = ObjectRef("ladle.dev/v1alpha1", "InferenceService", "prod", "chat", "uid-2")


@pytest.fixture
def lines() -> Iterator[Callable[[], list[dict[str, Any]]]]:
    """Logging as ``ladle operator`` configures it, into a buffer instead of stderr (undone
    after); yields a function returning the JSON lines written so far."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    logs.configure("info")
    buffer = io.StringIO()
    handler = root.handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(buffer)
    try:
        yield lambda: [json.loads(line) for line in buffer.getvalue().splitlines()]
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def test_an_event_about_a_cluster_scoped_pool_names_it_without_a_slash(
    lines: Callable[[], list[dict[str, Any]]],
) -> None:
    # emit() only queues: nothing is posted without run(), so no client is needed.
    events = EventRecorder(cast(KubeClient, None), Metrics(), "test")
    events.emit(POOL, "Warning", "Overlap", "GPUPool a100 shares a node with GPUPool b")
    events.emit(ISVC, "Normal", "Restored", "the stable variant is back")
    warning, normal = lines()
    assert (warning["object"], warning["kind"], warning["level"]) == ("a100", "GPUPool", "warning")
    assert (warning["event"], warning["type"]) == ("Overlap", "Warning")
    assert (normal["object"], normal["kind"], normal["level"]) == (
        "prod/chat",
        "InferenceService",
        "info",
    )


def test_kopf_records_name_objects_by_the_same_rule(
    lines: Callable[[], list[dict[str, Any]]],
) -> None:
    kopf = logging.getLogger("kopf.objects")
    kopf.warning("pool trouble", extra={"k8s_ref": {"name": "a100", "kind": "GPUPool"}})
    kopf.warning("isvc trouble", extra={"k8s_ref": {"name": "chat", "namespace": "prod"}})
    pool, isvc = lines()
    assert (pool["object"], pool["kind"]) == ("a100", "GPUPool")
    assert isvc["object"] == "prod/chat"
    assert logs.object_id("", "a100") == logs.object_id(None, "a100") == "a100"
