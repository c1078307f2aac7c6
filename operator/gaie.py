"""The children a service gets from the Gateway API Inference Extension and the Gateway API,
where the cluster serves their CRDs: its InferencePools, the HTTPRoute from a named Gateway
(weighted by the rollout, or moved to the fallback) and the model rewrite its fallback needs.
The objects themselves are ``service_objects``' pure builders; this holds what the cluster
serves and what the store says of the fallback."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ladle.api import (
    INFERENCE_POOL_KIND,
    ISVC_KIND,
    JSON,
    MODEL_REWRITE_KIND,
    InferenceService,
)
from ladle.operator.config import OperatorConfig
from ladle.operator.service_objects import (
    Fallback,
    desired_http_route,
    desired_inference_pools,
    desired_model_rewrite,
    route_fallback,
)
from ladle.operator.store import Store


@dataclass
class GaieChildren:
    store: Store
    config: OperatorConfig
    # Whether the cluster serves GAIE's InferencePool, the Gateway API's HTTPRoute and GAIE's
    # InferenceModelRewrite: the controller finds out as its term starts, as kopf resolves
    # what it watches once.
    inference_pools: bool = False
    http_routes: bool = False
    model_rewrites: bool = False

    def desired(
        self, isvc: InferenceService, weights: Sequence[tuple[str, int]], available: int
    ) -> list[JSON]:
        """The service's GAIE children, given its variants' ``weights`` (every variant it
        runs) and how many of its replicas are ``available``."""
        if not self.inference_pools:
            return []
        objects = desired_inference_pools(isvc, [variant for variant, _ in weights])
        gateway = isvc.spec.inference_pool.gateway or self.config.inference_gateway
        if self.http_routes and gateway is not None:
            fallback = self._fallback(isvc)
            if fallback is not None and fallback.model != isvc.spec.served_model_name:
                objects.append(desired_model_rewrite(isvc, fallback))
            routed = route_fallback(fallback, available)
            objects.append(desired_http_route(isvc, gateway, weights, routed))
        return objects

    @property
    def pruned_kinds(self) -> tuple[str, ...]:
        """The served kinds pruned like the other children (HTTPRoute is always among those):
        a canary's pool goes with its rollout, the model rewrite with the fallback."""
        served = (
            (self.inference_pools, INFERENCE_POOL_KIND),
            (self.model_rewrites, MODEL_REWRITE_KIND),
        )
        return tuple(kind for on, kind in served if on)

    def _fallback(self, isvc: InferenceService) -> Fallback | None:
        """The service's fallback as a GAIE gateway can reach it: an InferenceService (whose
        pool the operator makes) serving the same model name, or another where GAIE's model
        rewrite is installed to rename the requests. Otherwise there is none: a request for
        the wrong model would only be refused by the fallback's pods."""
        name = isvc.spec.traffic.fallback
        other = self.store.get(ISVC_KIND, (isvc.meta.namespace, name)) if name else None
        if other is None:
            return None
        model = other.spec.served_model_name
        if model != isvc.spec.served_model_name and not self.model_rewrites:
            return None
        return Fallback(other.meta.name, model)
