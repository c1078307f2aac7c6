"""The kopf glue: which kinds the operator watches, and the registry that feeds the controller.

kopf owns the watch streams (list, then watch, reconnects, re-lists after 410 Gone); every
event goes to ``Controller.observe`` unchanged, without awaiting anything. The same table of
kinds drives the controller's own lists (priming a new leader, and re-list sweeps), so what is
watched and what is listed can never differ.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from ladle.api import (
    API_VERSION,
    HTTP_ROUTE_API_VERSION,
    HTTP_ROUTE_KIND,
    HTTP_ROUTE_PLURAL,
    INFERENCE_POOL_API_VERSION,
    INFERENCE_POOL_KIND,
    INFERENCE_POOL_PLURAL,
    ISVC_KIND,
    ISVC_PLURAL,
    MANAGED_SELECTOR,
    MODEL_REWRITE_API_VERSION,
    MODEL_REWRITE_KIND,
    MODEL_REWRITE_PLURAL,
    POOL_KIND,
    POOL_PLURAL,
)
from ladle.kube import KubeClient

log = logging.getLogger("ladle.operator.watch")


@dataclass(frozen=True)
class Watched:
    kind: str
    api_version: str
    plural: str
    # Filtered on the server: the operator never sees foreign children or pods.
    label_selector: str | None = None
    # Served only where someone else's CRD is installed; the operator does without it.
    optional: bool = False

    @property
    def list_path(self) -> str:
        base = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        return f"{base}/{self.plural}"


# In priming order: pools, nodes and namespaces before the services they decide about, and
# children and pods before InferenceServices, so that the first reconcile sees them all.
WATCHED = (
    Watched(POOL_KIND, API_VERSION, POOL_PLURAL),
    Watched("Node", "v1", "nodes"),
    Watched("Namespace", "v1", "namespaces"),
    Watched("Deployment", "apps/v1", "deployments", MANAGED_SELECTOR),
    Watched("StatefulSet", "apps/v1", "statefulsets", MANAGED_SELECTOR),
    Watched("Service", "v1", "services", MANAGED_SELECTOR),
    Watched("PodDisruptionBudget", "policy/v1", "poddisruptionbudgets", MANAGED_SELECTOR),
    Watched("ConfigMap", "v1", "configmaps", MANAGED_SELECTOR),
    Watched(
        INFERENCE_POOL_KIND,
        INFERENCE_POOL_API_VERSION,
        INFERENCE_POOL_PLURAL,
        MANAGED_SELECTOR,
        optional=True,
    ),
    Watched(
        HTTP_ROUTE_KIND, HTTP_ROUTE_API_VERSION, HTTP_ROUTE_PLURAL, MANAGED_SELECTOR, optional=True
    ),
    Watched(
        MODEL_REWRITE_KIND,
        MODEL_REWRITE_API_VERSION,
        MODEL_REWRITE_PLURAL,
        MANAGED_SELECTOR,
        optional=True,
    ),
    Watched("Pod", "v1", "pods", MANAGED_SELECTOR),
    Watched(ISVC_KIND, API_VERSION, ISVC_PLURAL),
)
CHILD_KINDS = frozenset(
    {
        "Deployment",
        "StatefulSet",
        "Service",
        "PodDisruptionBudget",
        "ConfigMap",
        INFERENCE_POOL_KIND,
        HTTP_ROUTE_KIND,
        MODEL_REWRITE_KIND,
    }
)

REQUIRED = frozenset(w for w in WATCHED if not w.optional)

Observe = Callable[[str, str | None, Mapping[str, Any]], None]


async def served(client: KubeClient) -> frozenset[Watched]:
    """The watched kinds the API server serves: every required one, and each optional one
    whose CRD is installed. Asked once per process, as kopf resolves its watches once; the
    operator says in one line what it does without."""
    found = set(REQUIRED)
    for watched in WATCHED:
        if watched.optional:
            listing = await client.get(f"/apis/{watched.api_version}")
            if any(r.get("name") == watched.plural for r in (listing or {}).get("resources", ())):
                found.add(watched)
            else:
                log.info(
                    f"the API server does not serve {watched.plural} ({watched.api_version}), "
                    "so none are made: install its CRDs and restart the operator to have them"
                )
    return frozenset(found)


def build_registry(
    observe: Observe, login_fn: Callable[[], kopf.ConnectionInfo], watched: Collection[Watched]
) -> kopf.OperatorRegistry:
    """kopf handlers that feed the controller, for the kinds ``served`` found."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def _login(**_: Any) -> kopf.ConnectionInfo:
        return login_fn()

    def feed(watched: Watched) -> Any:
        async def handler(event: Mapping[str, Any], **_: Any) -> None:
            observe(watched.kind, event.get("type"), event["object"])

        return handler

    for kind in watched:
        kopf.on.event(kind.api_version, kind.plural, registry=registry)(feed(kind))
    return registry


class NoDiffBase(kopf.DiffBaseStorage):
    """kopf builds a diff base (a deep copy of the object) on every event, for change handlers.
    The operator registers event handlers only, which never read it: about 15% of its CPU at
    scale went there."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        """Nothing to remember."""


def build_settings(workers: int) -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.persistence.diffbase_storage = NoDiffBase()
    settings.peering.standalone = True  # one active instance is ensured by the Lease instead
    settings.posting.enabled = False  # the controller posts its own, meaningful Events
    settings.scanning.disabled = True  # no CRD/namespace watching, so no RBAC for it
    settings.watching.inactivity_timeout = 70.0
    settings.watching.connect_timeout = 10.0
    settings.networking.request_timeout = 30.0
    settings.queueing.worker_limit = max(workers * 8, 64)
    for watched in WATCHED:
        if watched.label_selector:
            settings.watching.label_selectors[(watched.api_version, watched.plural)] = (
                watched.label_selector
            )
    return settings
