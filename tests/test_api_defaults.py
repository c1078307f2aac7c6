"""Defaults once: ``ladle.api`` falls back to its dataclasses' defaults for a field an object
lacks (one stored before the field existed), and the API server fills in the CRD's. The two
must agree, or an old object would be served differently from a new one: parsing a minimal
object must give what parsing the same object with the CRD's defaults applied gives."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from ladle.api import parse_isvc, parse_pool

CRDS = Path(__file__).resolve().parents[1] / "crds"


def schema(kind: str) -> dict[str, Any]:
    for path in CRDS.glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["kind"] == kind:
            (version,) = [v for v in crd["spec"]["versions"] if v["storage"]]
            return dict(version["schema"]["openAPIV3Schema"])
    raise AssertionError(f"no CRD for {kind}")


def defaulted(value: Any, node: dict[str, Any]) -> Any:
    """What the API server stores for ``value``: structural defaulting, as apiextensions does
    it (an absent property with a default gets it, then defaulting goes on inside)."""
    if isinstance(value, dict):
        for name, child in (node.get("properties") or {}).items():
            if name not in value and "default" in child:
                value[name] = copy.deepcopy(child["default"])
            if name in value:
                value[name] = defaulted(value[name], child)
    elif isinstance(value, list) and "items" in node:
        return [defaulted(item, node["items"]) for item in value]
    return value


META = {"name": "chat", "namespace": "ns", "uid": "u", "generation": 1}

# The smallest objects the CRDs accept, and some with the optional blocks present but empty,
# whose own fields then default.
INFERENCE_SERVICES = {
    "minimal": {"model": {"name": "m"}},
    "every block empty": {
        "model": {"name": "m"},
        "routing": {"outlierDetection": {}},
        "circuitBreaker": {},
        "timeouts": {},
        "responseCache": {},
        "autoscaling": {},
        "engine": {},
        "resources": {},
        "quantization": {},
        "runtime": {},
        "inferencePool": {"endpointPicker": {}},
    },
    "a rollout with empty gates": {
        "model": {"name": "m"},
        "rollout": {"analysis": {"quality": {}, "slo": {}}},
    },
}


@pytest.mark.parametrize("spec", INFERENCE_SERVICES.values(), ids=INFERENCE_SERVICES.keys())
def test_an_inference_service_parses_the_same_with_or_without_the_crds_defaults(
    spec: dict[str, Any],
) -> None:
    obj = {"metadata": META, "spec": spec}
    stored = defaulted(copy.deepcopy(obj), schema("InferenceService"))
    assert stored != obj  # the CRD does default something here: the comparison is not vacuous
    old, new = parse_isvc(obj), parse_isvc(stored)
    assert old.spec == new.spec


def test_a_gpu_pool_parses_the_same_with_or_without_the_crds_defaults() -> None:
    obj = {"metadata": META, "spec": {"nodeSelector": {"pool": "a"}}}
    stored = defaulted(copy.deepcopy(obj), schema("GPUPool"))
    assert parse_pool(obj).spec == parse_pool(stored).spec
