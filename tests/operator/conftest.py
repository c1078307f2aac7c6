"""Fixtures for the operator tests.

The object builders return InferenceService, GPUPool and Deployment objects shaped as the API
server returns them, with the CRD's defaults filled in, so that unit tests see exactly what a
reconcile sees. (Fixtures rather than a module: tests run with --import-mode=importlib.)
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from ladle.operator.api import API_VERSION

Builder = Callable[..., dict[str, Any]]


def isvc_object(
    name: str = "chat",
    namespace: str = "team-a",
    *,
    spec: dict[str, Any] | None = None,
    generation: int = 1,
    created: str = "2026-01-01T00:00:00Z",
    status: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": {"name": "smollm2", "source": {"builtin": {}}},
        "quantization": "none",
        "runtime": {"startupTimeoutSeconds": 600},
        "engine": {"drainTimeoutSeconds": 30},
        "resources": {"gpus": 1},
        "replicas": 1,
        "minReplicas": 1,
    }
    for key, value in (spec or {}).items():
        if isinstance(value, dict) and isinstance(body.get(key), dict):
            body[key] = {**body[key], **copy.deepcopy(value)}
        else:
            body[key] = copy.deepcopy(value)
    return {
        "apiVersion": API_VERSION,
        "kind": "InferenceService",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{namespace}-{name}",
            "generation": generation,
            "creationTimestamp": created,
        },
        "spec": body,
        "status": status or {},
    }


def pool_object(
    name: str = "h200",
    *,
    spec: dict[str, Any] | None = None,
    generation: int = 1,
) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "GPUPool",
        "metadata": {"name": name, "uid": f"uid-pool-{name}", "generation": generation},
        "spec": {"nodeSelector": {}, "resourceName": "nvidia.com/gpu", **(spec or {})},
        "status": {},
    }


def deployment_object(
    replicas: int,
    *,
    generation: int = 1,
    observed: int = 1,
    updated: int | None = None,
    ready: int | None = None,
    available: int | None = None,
    total: int | None = None,
    conditions: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "chat-stable", "namespace": "team-a", "generation": generation},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": observed,
            "replicas": replicas if total is None else total,
            "updatedReplicas": replicas if updated is None else updated,
            "readyReplicas": replicas if ready is None else ready,
            "availableReplicas": replicas if available is None else available,
            "conditions": conditions or [],
        },
    }


@pytest.fixture
def make_isvc() -> Builder:
    return isvc_object


@pytest.fixture
def make_pool() -> Builder:
    return pool_object


@pytest.fixture
def make_deployment() -> Builder:
    return deployment_object
