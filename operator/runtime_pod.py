"""The runtime pod: one container running ``ladle serve`` with its flags, probes, volumes and
resources, locked down (non-root, read-only root filesystem, no API token), on the pool's nodes.

Deterministic, like every builder of ``desired``: the Deployment carries a digest of this
template, and a changed digest is a rollout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ladle.api import JSON, AdapterSpec, GPUPoolSpec, InferenceService
from ladle.operator.config import OperatorConfig
from ladle.quantity import parse_quantity

HTTP_PORT = 8000
MODEL_MOUNT = "/models"
CONFIG_MOUNT = "/etc/ladle/config"
CONFIG_FILE = "config.yaml"
# spec.adapters: the ConfigMap the runtime follows (--lora-modules-file), and where each
# adapter claim is mounted (a subfolder per claim).
ADAPTERS_MOUNT = "/etc/ladle/adapters"
ADAPTERS_FILE = "adapters.yaml"
ADAPTER_CLAIMS_MOUNT = "/adapters"
API_KEY_MOUNT = "/etc/ladle/auth"
API_KEY_FILE = "api-key"
CACHE_DIR = "/var/cache/ladle"
# The preStop pause lets endpoint removal reach clients before the server starts draining.
PRESTOP_SLEEP_SECONDS = 5
# Slack between the end of the drain and SIGKILL, for the process to flush and exit.
EXIT_SLACK_SECONDS = 10
# A loaded model waits up to one period for Ready: at 10 s, a pod that loaded in 11 s became
# Ready at 20, and at 2 s a 4.1 s load still read Ready at 6.3. A probe is one GET of a local
# endpoint, so the shortest period Kubernetes allows costs nothing.
STARTUP_PROBE_PERIOD_SECONDS = 1
RUNTIME_UID = 10001

# ladle.dev/profiling: "enabled": traces go to an emptyDir here, bounded so that a forgotten
# profile cannot fill the node's disk (past the limit the kubelet evicts the pod).
PROFILE_MOUNT = "/var/lib/ladle/profiles"
PROFILE_SIZE_LIMIT = "1Gi"


@dataclass(frozen=True)
class Probe:
    period: int
    timeout: int
    failures: int


@dataclass(frozen=True)
class RuntimeProbes:
    """The kubelet's side of the runtime's liveness and readiness probes (the startup probe
    follows spec.runtime.startupTimeoutSeconds)."""

    liveness: Probe
    readiness: Probe


PRODUCTION_PROBES = RuntimeProbes(liveness=Probe(10, 5, 3), readiness=Probe(5, 3, 2))
# Per operator --runtime-env-profile (None: none set). staging and prod are the defaults;
# dev gives a process paused in a debugger (which answers no probe) ten minutes, as its
# `ladle serve --env-profile dev` gives a stalled engine (liveness-timeout 600).
RUNTIME_PROBES: dict[str | None, RuntimeProbes] = {
    None: PRODUCTION_PROBES,
    "dev": RuntimeProbes(liveness=Probe(30, 10, 20), readiness=Probe(5, 3, 2)),
    "staging": PRODUCTION_PROBES,
    "prod": PRODUCTION_PROBES,
}


def adapter_claims(isvc: InferenceService) -> list[str]:
    """The claims that spec.adapters' PVC sources name besides the model's (mounted
    already), each once, in order."""
    spec = isvc.spec
    claims = {a.source.claim_name for a in spec.adapters or () if a.source.claim_name}
    return sorted(claims - {spec.source.claim_name})


def adapter_path(isvc: InferenceService, adapter: AdapterSpec) -> str:
    """Where the runtime finds an adapter's folder."""
    source, model = adapter.source, isvc.spec.source
    assert source.path is not None
    if source.kind == "image":
        return source.path
    if source.claim_name == model.claim_name:
        return f"{MODEL_MOUNT}/{source.path}"
    return f"{ADAPTER_CLAIMS_MOUNT}/{source.claim_name}/{source.path}"


def _resources(isvc: InferenceService, gpu_resource: str) -> JSON:
    res = isvc.spec.resources
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if res.cpu is not None:
        requests["cpu"] = res.cpu
    if res.memory is not None:
        requests["memory"] = res.memory
        limits["memory"] = res.memory
    if res.gpus > 0:
        requests[gpu_resource] = str(res.gpus)
        limits[gpu_resource] = str(res.gpus)
    out: JSON = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _threads(isvc: InferenceService) -> list[JSON]:
    """As many compute threads as the CPUs the pod is promised. Left alone, torch and the CPU
    kernels start one per CPU of the node; under contention a thread of a parallel region
    waits at every barrier for its siblings to be scheduled again, and a pod with a small CPU
    share steps several times slower than on one thread (5.4x, measured with two busy cores
    beside a pod-sized cgroup: docs/operator.md)."""
    cpu = isvc.spec.resources.cpu
    if cpu is None:
        return []
    return [{"name": "OMP_NUM_THREADS", "value": str(max(1, math.floor(parse_quantity(cpu))))}]


def _probe(path: str, period: int, timeout: int, failures: int) -> JSON:
    return {
        "httpGet": {"path": path, "port": "http", "scheme": "HTTP"},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def pod_template(
    isvc: InferenceService,
    pool: GPUPoolSpec | None,
    config: OperatorConfig,
    *,
    labels: dict[str, str],
    annotations: dict[str, str],
    args: list[str],
    config_map: str | None,
    profiles: bool,
    adapters_config_map: str | None = None,
) -> JSON:
    """The pod template of one variant. ``config_map`` names the ConfigMap holding the engine's
    settings when ``args`` point at it; ``profiles`` mounts the bounded profile directory;
    ``adapters_config_map``, the adapters' list that the runtime follows. Only the claims the
    adapters live on are in the template, not the adapters: an adapter added on a mounted
    claim reaches the pods without a restart."""
    spec = isvc.spec
    gpu_resource = pool.resource_name if pool is not None else config.default_gpu_resource
    volumes: list[JSON] = [
        {"name": "tmp", "emptyDir": {}},
        {"name": "cache", "emptyDir": {}},
    ]
    mounts: list[JSON] = [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cache", "mountPath": CACHE_DIR},
    ]
    if config_map is not None:
        volumes.append({"name": "config", "configMap": {"name": config_map}})
        mounts.append({"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True})
    if spec.source.kind == "pvc":
        volumes.append(
            {
                "name": "model",
                "persistentVolumeClaim": {"claimName": spec.source.claim_name, "readOnly": True},
            }
        )
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    if adapters_config_map is not None:
        volumes.append({"name": "adapters", "configMap": {"name": adapters_config_map}})
        mounts.append({"name": "adapters", "mountPath": ADAPTERS_MOUNT, "readOnly": True})
    for i, claim in enumerate(adapter_claims(isvc)):
        mount = f"{ADAPTER_CLAIMS_MOUNT}/{claim}"
        volumes.append(
            {
                "name": f"adapters-{i}",
                "persistentVolumeClaim": {"claimName": claim, "readOnly": True},
            }
        )
        mounts.append({"name": f"adapters-{i}", "mountPath": mount, "readOnly": True})
    if spec.api_key_secret is not None:
        volumes.append(
            {
                "name": "api-key",
                "secret": {
                    "secretName": spec.api_key_secret.name,
                    "items": [{"key": spec.api_key_secret.key, "path": API_KEY_FILE}],
                },
            }
        )
        mounts.append({"name": "api-key", "mountPath": API_KEY_MOUNT, "readOnly": True})
    if profiles:
        volumes.append({"name": "profiles", "emptyDir": {"sizeLimit": PROFILE_SIZE_LIMIT}})
        mounts.append({"name": "profiles", "mountPath": PROFILE_MOUNT})

    drain = spec.engine.drain_timeout_seconds
    probes = RUNTIME_PROBES[config.runtime_env_profile]
    live, ready = probes.liveness, probes.readiness
    container: JSON = {
        "name": "runtime",
        "image": spec.runtime_image or config.runtime_image,
        "command": ["ladle", "serve"],
        "args": ["--host", "0.0.0.0", "--port", str(HTTP_PORT), *args],
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
        "env": [{"name": "XDG_CACHE_HOME", "value": CACHE_DIR}, *_threads(isvc)],
        "resources": _resources(isvc, gpu_resource),
        "volumeMounts": mounts,
        # A runtime that refuses its settings exits with one JSON error line: the kubelet
        # keeps it as the termination message, which the service's conditions quote.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        # Startup covers model load; liveness only takes over once the model is ready.
        "startupProbe": _probe(
            "/health/ready",
            STARTUP_PROBE_PERIOD_SECONDS,
            5,
            max(1, math.ceil(spec.startup_timeout_seconds / STARTUP_PROBE_PERIOD_SECONDS)),
        ),
        "livenessProbe": _probe("/health/live", live.period, live.timeout, live.failures),
        "readinessProbe": _probe("/health/ready", ready.period, ready.timeout, ready.failures),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_SECONDS}}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    pod_spec: JSON = {
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": PRESTOP_SLEEP_SECONDS + drain + EXIT_SLACK_SECONDS,
        # The runtime never calls the API server, and hundreds of Services would otherwise
        # become hundreds of environment variables in every pod.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUNTIME_UID,
            "runAsGroup": RUNTIME_UID,
            "fsGroup": RUNTIME_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if pool is not None:
        selector = pool.scheduling_selector()
        if selector:
            pod_spec["nodeSelector"] = selector
        if pool.tolerations:
            pod_spec["tolerations"] = [dict(t) for t in pool.tolerations]
    return {"metadata": {"labels": labels, "annotations": annotations}, "spec": pod_spec}
