"""How a GAIE gateway reaches a service (``spec.inferencePool``): its InferencePool's endpoint
picker, the Gateway whose HTTPRoute sends the service's model there, and whether each variant
gets a pool of its own."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ladle.api.meta import opt_str

DEFAULT_PICKER_PORT = 9002


@dataclass(frozen=True)
class EndpointPicker:
    """The Service of the endpoint picker that a service's InferencePool names; None as the
    name means ``<service>-epp``."""

    name: str | None = None
    port: int = DEFAULT_PICKER_PORT
    failure_mode: str = "FailClose"


@dataclass(frozen=True)
class GatewayRef:
    """A Gateway (Gateway API) that routes to a service's InferencePool through an HTTPRoute;
    None as the namespace means the service's own."""

    name: str
    namespace: str | None = None
    section_name: str | None = None


@dataclass(frozen=True)
class InferencePoolSpec:
    """How a service's InferencePool is reached: its endpoint picker, and the Gateway whose
    HTTPRoute sends the service's model there (None: the operator's default, if any).
    ``per_variant`` adds a pool for each variant, so that a GAIE gateway splits a canary
    rollout by its weights (a picker chooses by load within one pool, never by weight)."""

    endpoint_picker: EndpointPicker = EndpointPicker()
    gateway: GatewayRef | None = None
    per_variant: bool = False


def parse_inference_pool(raw: Mapping[str, Any] | None) -> InferencePoolSpec:
    raw = raw or {}
    picker = raw.get("endpointPicker") or {}
    gateway = raw.get("gateway")
    return InferencePoolSpec(
        endpoint_picker=EndpointPicker(
            name=opt_str(picker.get("name")),
            port=int(picker.get("port", DEFAULT_PICKER_PORT)),
            failure_mode=str(picker.get("failureMode", "FailClose")),
        ),
        gateway=(
            GatewayRef(
                str(gateway["name"]),
                opt_str(gateway.get("namespace")),
                opt_str(gateway.get("sectionName")),
            )
            if gateway
            else None
        ),
        per_variant=bool(raw.get("perVariant", False)),
    )
