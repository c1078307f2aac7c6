"""Replicas that span nodes (``spec.parallelism.nodes``): each is a group of pods, a leader that
serves and workers that run their share of the ranks headless (``ladle serve --node-rank N``).

The shape is LeaderWorkerSet's, built from core kinds because its module is not served here:

- the **leader** is a pod of the variant's Deployment, so that everything that counts, rolls,
  scales and routes replicas (status, the scale subresource, the gateway, canaries) counts
  groups by their leaders without knowing about workers;
- its **workers** are a StatefulSet of ``nodes - 1`` pods made for that one leader and owned by
  it (ordinals from 1: a worker's pod index is its node rank), on other nodes than the leader
  and each other; the variant's headless Service governs them.

Rendezvous goes to the leader's pod IP, which the operator reads from the leader pod and writes
into its workers' set: no cluster DNS is needed, nor its propagation awaited, and a replaced
leader (a new pod, a new address) gets a new set while the old one goes with its owner. A group
restarts as a whole without the operator: a worker that dies fails the leader's engine (and its
liveness probe), and workers whose leader went away exit and reconnect.

Moving to LeaderWorkerSet is a change of this renderer only: its leaderTemplate is the
Deployment's template, its workerTemplate ``worker_template``'s.
"""

from __future__ import annotations

import copy
import hashlib

from ladle.api import (
    GROUP_TEMPLATE_ANNOTATION,
    JSON,
    LABEL_GROUP,
    LABEL_ISVC,
    LABEL_LEADER,
    LABEL_WORKER_OF,
)
from ladle.runtime.parallel.secret import SECRET_VARIABLE

# torch.distributed's store on the leader; its rank channels listen on the next port.
MASTER_PORT = 29500
# The Secret whose bytes authenticate the ranks to each other (the plans they exchange are
# pickled: no pod without it may connect).
SECRET_KEY = "secret"
NODE_RANK_VARIABLE = "LADLE_NODE_RANK"
MASTER_ADDR_VARIABLE = "LADLE_MASTER_ADDR"
# The kubelet expands these from each pod's own environment: one template, every rank.
RANK_ARGS = [
    "--node-rank",
    f"$({NODE_RANK_VARIABLE})",
    "--master-addr",
    f"$({MASTER_ADDR_VARIABLE})",
]
# Set by the StatefulSet controller on each pod: with ordinals from 1, the node rank.
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
HOSTNAME_KEY = "kubernetes.io/hostname"


def group_settings(nodes: int) -> dict[str, int]:
    """The engine flags every pod of a group shares."""
    return {"nnodes": nodes, "master-port": MASTER_PORT} if nodes > 1 else {}


def secret_name(isvc_name: str) -> str:
    return f"{isvc_name}-group"


def service_name(variant_name: str) -> str:
    return f"{variant_name}-group"


def _field(path: str) -> JSON:
    return {"fieldRef": {"fieldPath": path}}


def leader_template(template: JSON, group: str, secret: str, digest: str) -> JSON:
    """A variant's pod template (whose digest is ``digest``) as a group's leader: node rank 0,
    its own address as the master's, the secret, the group's label, and the digest its
    workers are made from."""
    out = copy.deepcopy(template)
    out["metadata"]["labels"][LABEL_GROUP] = group
    out["metadata"]["annotations"][GROUP_TEMPLATE_ANNOTATION] = digest
    container = out["spec"]["containers"][0]
    container["args"] = [*container["args"], *RANK_ARGS]
    container["env"] = [
        *container["env"],
        {"name": NODE_RANK_VARIABLE, "value": "0"},
        {"name": MASTER_ADDR_VARIABLE, "valueFrom": _field("status.podIP")},
        {
            "name": SECRET_VARIABLE,
            "valueFrom": {"secretKeyRef": {"name": secret, "key": SECRET_KEY}},
        },
    ]
    return out


def template_digest(template: JSON) -> str:
    return str(template["metadata"]["annotations"].get(GROUP_TEMPLATE_ANNOTATION, ""))


def worker_template(leader: JSON, isvc_name: str, leader_pod: str, node: str, ip: str) -> JSON:
    """The pod template of one leader's workers: the leader's, less what serves (probes,
    ports, scrape annotations: a worker answers no HTTP), labelled so that no Service, gateway
    or scale selector counts it, pointed at the leader's address, and kept off the leader's
    node and its siblings'."""
    out = copy.deepcopy(leader)
    meta = out["metadata"]
    labels = {k: v for k, v in meta["labels"].items() if k != LABEL_ISVC}
    labels.update(
        {
            "app.kubernetes.io/component": "inference-worker",
            LABEL_WORKER_OF: isvc_name,
            LABEL_LEADER: leader_pod,
        }
    )
    meta["labels"] = labels
    meta["annotations"] = {}
    container = out["spec"]["containers"][0]
    for key in ("ports", "startupProbe", "livenessProbe", "readinessProbe", "lifecycle"):
        container.pop(key, None)
    overrides = {
        NODE_RANK_VARIABLE: {
            "name": NODE_RANK_VARIABLE,
            "valueFrom": _field(f"metadata.labels['{POD_INDEX_LABEL}']"),
        },
        MASTER_ADDR_VARIABLE: {"name": MASTER_ADDR_VARIABLE, "value": ip},
    }
    container["env"] = [overrides.get(e["name"], e) for e in container["env"]]
    away = {"key": HOSTNAME_KEY, "operator": "NotIn", "values": [node]}
    siblings = {"matchLabels": {LABEL_LEADER: leader_pod}}
    out["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [away]}]
            }
        },
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": siblings, "topologyKey": HOSTNAME_KEY}
            ]
        },
    }
    return out


def worker_set_name(variant_name: str, leader_uid: str) -> str:
    """Short enough for a StatefulSet (its pods' revision label adds 11 characters), unique
    per leader pod."""
    return f"{variant_name[:40]}-{hashlib.sha256(leader_uid.encode()).hexdigest()[:8]}"


def worker_set(
    *,
    name: str,
    namespace: str,
    nodes: int,
    service: str,
    template: JSON,
    leader_pod: str,
    leader_uid: str,
) -> JSON:
    """A leader's workers, owned by the leader pod: they go when it does."""
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": template["metadata"]["labels"],
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": leader_pod,
                    "uid": leader_uid,
                    "controller": True,
                }
            ],
        },
        "spec": {
            "replicas": nodes - 1,
            "ordinals": {"start": 1},
            "serviceName": service,
            # Every worker starts at once: a group waits for its slowest pod either way.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": {LABEL_LEADER: leader_pod}},
            "template": template,
        },
    }


def headless_service(metadata: JSON, group: str) -> JSON:
    """Names the group's pods (``<set>-<n>.<service>`` where cluster DNS runs), ready or not:
    a group is whole before any of it is Ready."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {LABEL_GROUP: group},
        },
    }


def secret(metadata: JSON, value: str) -> JSON:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata,
        "type": "Opaque",
        "stringData": {SECRET_KEY: value},
    }
