"""Spec → desired child objects: a pure function of the InferenceService, its pool and its grant.

Everything here is deterministic (names, labels, ordering), so that server-side apply of the
same inputs is a no-op and a reviewer can predict every child from the spec alone.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass

import yaml

from ladle.api import (
    API_VERSION,
    CANARY,
    CONFIG_HASH_ANNOTATION,
    ISVC_KIND,
    JSON,
    LABEL_ISVC,
    LABEL_MANAGED_BY,
    LABEL_POOL,
    LABEL_VARIANT,
    MANAGED_BY,
    STABLE,
    GPUPoolSpec,
    InferenceService,
)
from ladle.operator import groups
from ladle.operator.config import OperatorConfig
from ladle.operator.revisions import with_template
from ladle.operator.rollout_state import RolloutState, split
from ladle.operator.runtime_flags import engine_config, operator_settings, render_flags
from ladle.operator.runtime_pod import (
    ADAPTERS_FILE,
    CONFIG_FILE,
    CONFIG_MOUNT,
    HTTP_PORT,
    adapter_path,
    pod_template,
)
from ladle.operator.store import PodInfo, runtime_settings

# On the Deployment (not its pods): a digest of the pod template it was last given, so that
# any leader can tell from the live object whether a rollout of the current spec is due.
TEMPLATE_HASH_ANNOTATION = "ladle.dev/template-hash"
# On a Deployment whose runtime refused its settings (exit EX_CONFIG: a tensor-parallel size
# the model's heads do not split into, a context longer than the model's): that template's
# digest and the runtime's words. It stays at zero replicas until the template changes, instead
# of crash-looping pods that no restart can help.
REFUSED_TEMPLATE_ANNOTATION = "ladle.dev/refused-template"
REFUSAL_ANNOTATION = "ladle.dev/refusal"


def variant_sources(
    isvc: InferenceService, state: RolloutState
) -> list[tuple[str, InferenceService, int]]:
    """(name, the service as that variant runs it, its share of traffic) of each variant to
    run: stable, and the canary while a rollout runs."""
    stable_source = (
        with_template(isvc, state.stable_template) if state.stable_template is not None else isvc
    )
    variants = [(STABLE, stable_source, 100 - state.weight)]
    if state.active and state.canary_template is not None:
        variants.append((CANARY, with_template(isvc, state.canary_template), state.weight))
    return variants


def variant_replicas(isvc: InferenceService, state: RolloutState, granted: int) -> dict[str, int]:
    """Each variant's replicas, given the rollout state and the replicas the pool granted
    (stable first: a canary never takes a stable replica's place)."""
    steps = isvc.spec.rollout.steps if isvc.spec.rollout else (100,)
    stable_want, canary_want = split(state, steps, isvc.requested_replicas)
    stable = min(stable_want, granted)
    return {STABLE: stable, CANARY: min(canary_want, max(granted - stable, 0))}


def variant_name(isvc_name: str, variant: str) -> str:
    """Deployment/PDB name of a variant; CRD validation keeps it within 63 characters."""
    return f"{isvc_name}-{variant}"


def adapters_config_map_name(isvc_name: str, variant: str) -> str:
    return f"{variant_name(isvc_name, variant)}-adapters"


def config_map_name(isvc_name: str, variant: str) -> str:
    return f"{variant_name(isvc_name, variant)}-config"


def service_url(isvc: InferenceService, cluster_domain: str) -> str:
    """The OpenAI base URL inside the cluster."""
    meta = isvc.meta
    return f"http://{meta.name}.{meta.namespace}.svc.{cluster_domain}/v1"


def selector_labels(isvc_name: str, variant: str | None = None) -> dict[str, str]:
    labels = {LABEL_ISVC: isvc_name}
    if variant is not None:
        labels[LABEL_VARIANT] = variant
    return labels


def label_selector(isvc_name: str) -> str:
    """The string form of the selector, as the scale subresource publishes it."""
    return f"{LABEL_ISVC}={isvc_name}"


def common_labels(isvc_name: str, variant: str | None = None) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "ladle-runtime",
        "app.kubernetes.io/instance": isvc_name,
        "app.kubernetes.io/component": "inference",
        LABEL_MANAGED_BY: MANAGED_BY,
        **selector_labels(isvc_name, variant),
    }


def owner_reference(isvc: InferenceService) -> JSON:
    return {
        "apiVersion": API_VERSION,
        "kind": ISVC_KIND,
        "name": isvc.meta.name,
        "uid": isvc.meta.uid,
        "controller": True,
    }


def service_metadata(isvc: InferenceService) -> JSON:
    """The metadata of the children named after the service itself, not a variant."""
    name = isvc.meta.name
    return {
        "name": name,
        "namespace": isvc.meta.namespace,
        "labels": common_labels(name),
        "ownerReferences": [owner_reference(isvc)],
    }


def _digest(data: str) -> str:
    return hashlib.sha256(data.encode()).hexdigest()[:16]


def object_digest(obj: JSON) -> str:
    """A stable fingerprint of a desired object, to skip applies that would change nothing."""
    return _digest(json.dumps(obj, sort_keys=True, separators=(",", ":")))


@dataclass(frozen=True)
class Children:
    """Every object one variant owns. ``config_map`` is None when flags suffice; ``pdb`` is
    None below two replicas, where a budget that allows one disruption protects nothing."""

    deployment: JSON
    pdb: JSON | None
    config_map: JSON | None
    # The adapters' list the pods follow; None without spec.adapters.
    adapters: JSON | None = None

    def all(self) -> list[JSON]:
        """Every child to exist, the ConfigMaps first: pods mount them."""
        optional = [self.pdb] if self.pdb is not None else []
        head = [cm for cm in (self.config_map, self.adapters) if cm is not None]
        return [*head, self.deployment, *optional]


def rollout_strategy(surge: bool, idle: bool = False) -> JSON:
    """Surge when the pool has room for a spare replica: a replica is only retired once its
    successor has loaded the model. Without that room, a surge pod could never be scheduled
    (or would break the quota), so replace one replica at a time instead. A variant that takes
    no traffic (``idle``) replaces all its replicas at once, in the GPUs they free."""
    if idle:
        return {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 0, "maxUnavailable": "100%"},
        }
    if surge:
        return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}


def template_hash(deployment: JSON) -> str:
    return str(deployment["metadata"].get("annotations", {}).get(TEMPLATE_HASH_ANNOTATION, ""))


@dataclass(frozen=True)
class Blueprint:
    """What one variant's pods run, whatever their number and however they roll: the pod
    template (and its digest, which says whether a live Deployment runs it) and the ConfigMap
    it mounts. A reconcile builds it once per variant."""

    source: InferenceService  # the service as this variant runs it
    variant: str
    template: JSON
    template_hash: str
    config_map: JSON | None
    adapters: JSON | None = None
    # A group's leader template (spec.parallelism.nodes > 1): the digest its pods carry, by
    # which their workers are made from this blueprint.
    group_digest: str = ""


def blueprint(
    isvc: InferenceService, pool: GPUPoolSpec | None, config: OperatorConfig, variant: str = STABLE
) -> Blueprint:
    spec = isvc.spec
    name = isvc.meta.name
    labels = common_labels(name, variant)
    pod_labels = {**labels, **({LABEL_POOL: spec.gpu_pool} if spec.gpu_pool else {})}
    engine = {**engine_config(isvc), **operator_settings(isvc, config)}
    engine_flags = render_flags(engine)
    cm_name = config_map_name(name, variant)
    config_map: JSON | None = None
    # What the pods' runtime follows (--lora-modules-file); its content is not in the
    # template, so that an adapter's change reaches the running pods.
    adapters_name = adapters_config_map_name(name, variant)
    adapters: JSON | None = None
    if spec.adapters is not None:
        listed = [{"name": a.name, "path": adapter_path(isvc, a)} for a in spec.adapters]
        rendered_adapters = json.dumps(listed, indent=1) + "\n"
        adapters = _config_map(isvc, adapters_name, labels, {ADAPTERS_FILE: rendered_adapters})
    template_annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(HTTP_PORT),
        "prometheus.io/path": "/metrics",
    }
    if len(" ".join(engine_flags)) > config.config_map_threshold_bytes:
        rendered = yaml.safe_dump(engine, sort_keys=False, default_flow_style=False)
        config_map = _config_map(isvc, cm_name, labels, {CONFIG_FILE: rendered})
        # ConfigMap edits do not restart pods by themselves; a changed hash rolls them.
        template_annotations[CONFIG_HASH_ANNOTATION] = _digest(rendered)
        engine_flags = ["--config", f"{CONFIG_MOUNT}/{CONFIG_FILE}"]
    template = pod_template(
        isvc,
        pool,
        config,
        labels=pod_labels,
        annotations=template_annotations,
        args=engine_flags,
        config_map=None if config_map is None else cm_name,
        profiles="profile-dir" in engine,
        adapters_config_map=None if adapters is None else adapters_name,
    )
    digest = ""
    if spec.parallelism.nodes > 1:
        digest = object_digest(template)
        secret = groups.secret_name(name)
        template = groups.leader_template(template, variant_name(name, variant), secret, digest)
    return Blueprint(isvc, variant, template, object_digest(template), config_map, adapters, digest)


def _config_map(isvc: InferenceService, name: str, labels: JSON, data: JSON) -> JSON:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name,
            "namespace": isvc.meta.namespace,
            "labels": labels,
            "ownerReferences": [owner_reference(isvc)],
        },
        "data": data,
    }


def refusal(bp: Blueprint, live: JSON | None, pods: Iterable[PodInfo]) -> str | None:
    """Why this blueprint's pods can never serve, if its runtime refused its settings: as its
    live Deployment remembers, or as one of its pods has just said."""
    annotations = ((live or {}).get("metadata") or {}).get("annotations") or {}
    if annotations.get(REFUSED_TEMPLATE_ANNOTATION) == bp.template_hash:
        return str(annotations.get(REFUSAL_ANNOTATION) or "settings refused")
    said = [p for p in pods if p.refused and p.variant == bp.variant and not p.worker]
    if not said:
        return None
    settings = runtime_settings(bp.template)
    return next((p.refused for p in said if p.settings == settings), None)


def children_of(
    bp: Blueprint,
    replicas: int,
    *,
    surge: bool = True,
    idle: bool = False,
    refused: str | None = None,
) -> Children:
    """The variant's children at ``replicas`` pods (already quota-limited), rolling as
    ``rollout_strategy`` says; none while its runtime ``refused`` its settings."""
    isvc, variant = bp.source, bp.variant
    name = isvc.meta.name
    namespace = isvc.meta.namespace
    owner = [owner_reference(isvc)]
    labels = common_labels(name, variant)
    annotations = {TEMPLATE_HASH_ANNOTATION: bp.template_hash}
    if refused is not None:
        replicas = 0
        annotations |= {REFUSED_TEMPLATE_ANNOTATION: bp.template_hash, REFUSAL_ANNOTATION: refused}
    deployment: JSON = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": variant_name(name, variant),
            "namespace": namespace,
            "labels": labels,
            "annotations": annotations,
            "ownerReferences": owner,
        },
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(name, variant)},
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": isvc.spec.startup_timeout_seconds + 120,
            "strategy": rollout_strategy(surge, idle),
            "template": bp.template,
        },
    }
    pdb: JSON = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": variant_name(name, variant),
            "namespace": namespace,
            "labels": labels,
            "ownerReferences": owner,
        },
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(name, variant)},
            # A pod that never became ready must not block node drains.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
    return Children(
        deployment=deployment,
        pdb=pdb if replicas >= 2 else None,
        config_map=bp.config_map,
        adapters=bp.adapters,
    )


def desired_children(
    isvc: InferenceService,
    pool: GPUPoolSpec | None,
    replicas: int,
    config: OperatorConfig,
    variant: str = STABLE,
    *,
    surge: bool = True,
    idle: bool = False,
) -> Children:
    """The children of one variant running ``replicas`` pods, blueprint and all."""
    return children_of(blueprint(isvc, pool, config, variant), replicas, surge=surge, idle=idle)


def group_children(bp: Blueprint, pods: Iterable[PodInfo]) -> list[JSON]:
    """A variant's groups (spec.parallelism.nodes > 1): its headless Service, and a set of
    workers for each leader that runs this blueprint's template and has a node and an address
    (a leader of another template keeps the set it was given until it goes, taking it along)."""
    if not bp.group_digest:
        return []
    isvc = bp.source
    name = variant_name(isvc.meta.name, bp.variant)
    service_name = groups.service_name(name)
    metadata = {**service_metadata(isvc), "name": service_name}
    metadata["labels"] = common_labels(isvc.meta.name, bp.variant)
    out = [groups.headless_service(metadata, name)]
    for pod in sorted(pods, key=lambda p: p.name):
        if pod.variant != bp.variant or pod.worker or pod.leads is None:
            continue
        uid, digest, node, ip = pod.leads
        if digest != bp.group_digest:
            continue
        template = groups.worker_template(bp.template, isvc.meta.name, pod.name, node, ip)
        out.append(
            groups.worker_set(
                name=groups.worker_set_name(name, uid),
                namespace=isvc.meta.namespace,
                nodes=isvc.spec.parallelism.nodes,
                service=service_name,
                template=template,
                leader_pod=pod.name,
                leader_uid=uid,
            )
        )
    return out
