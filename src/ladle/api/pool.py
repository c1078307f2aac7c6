"""The GPUPool: a set of GPU nodes, its quota, and who may use it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ladle.api.meta import LabelSelector, ObjectMeta, opt_int, opt_str, parse_meta, parse_selector
from ladle.api.names import DEFAULT_GPU_RESOURCE, GPU_PRODUCT_LABEL, JSON


@dataclass(frozen=True)
class GPUPoolSpec:
    node_selector: Mapping[str, str]
    tolerations: tuple[JSON, ...]
    resource_name: str = DEFAULT_GPU_RESOURCE
    product: str | None = None
    quota_gpus: int | None = None
    # Which namespaces may run InferenceServices in the pool (None: every namespace).
    namespace_selector: LabelSelector | None = None

    def scheduling_selector(self) -> dict[str, str]:
        """The nodeSelector a runtime pod gets: the pool's own plus its GPU product."""
        selector = dict(self.node_selector)
        if self.product:
            selector[GPU_PRODUCT_LABEL] = self.product
        return selector


@dataclass(frozen=True)
class GPUPool:
    meta: ObjectMeta
    spec: GPUPoolSpec
    status: JSON


def parse_pool(obj: Mapping[str, Any]) -> GPUPool:
    spec = obj.get("spec") or {}
    quota = spec.get("quota") or {}
    return GPUPool(
        meta=parse_meta(obj),
        spec=GPUPoolSpec(
            node_selector={str(k): str(v) for k, v in (spec.get("nodeSelector") or {}).items()},
            tolerations=tuple(dict(t) for t in spec.get("tolerations") or ()),
            resource_name=str(spec.get("resourceName") or DEFAULT_GPU_RESOURCE),
            product=opt_str(spec.get("product")),
            quota_gpus=opt_int(quota.get("gpus")),
            namespace_selector=parse_selector(spec.get("namespaceSelector")),
        ),
        status=dict(obj.get("status") or {}),
    )
