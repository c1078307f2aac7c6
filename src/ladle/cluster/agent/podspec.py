"""What a pod spec asks of a container, as pure functions: its environment (with ``valueFrom``
and ``$(VAR)`` expansion), its command line against the image, its user and security settings,
its ports, probes, GPUs and grace period. The kubelet's rules, with its error messages."""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from ladle.cluster.agent.images import Image
from ladle.cluster.agent.sandbox import capabilities
from ladle.operator.quantity import parse_quantity

JSON = dict[str, Any]
DEFAULT_GRACE_SECONDS = 30
DEFAULT_TERMINATION_MESSAGE_PATH = "/dev/termination-log"
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class ContainerConfigError(Exception):
    """The container cannot be configured yet (a missing Secret, say): it stays Waiting with
    ``CreateContainerConfigError`` and the kubelet's message, and is retried."""

    reason = "CreateContainerConfigError"


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: ``$$`` escapes, unknown references stay as written."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env.get(name, match.group(0))

    return _VAR.sub(replace, text)


def decode(data: Mapping[str, str] | None, key: str) -> str | None:
    """One value of a Secret's base64 ``data``."""
    if data is None or key not in data:
        return None
    return base64.b64decode(data[key]).decode(errors="replace")


@dataclass(frozen=True)
class PodFacts:
    """What the downward API can read about a pod once it has addresses."""

    pod: JSON
    pod_ip: str
    host_ip: str
    allocatable: Mapping[str, str]


def _selector(path: str, prefix: str) -> str | None:
    match = re.fullmatch(rf"{re.escape(prefix)}\['(.+)'\]", path)
    return match.group(1) if match else None


def field_value(facts: PodFacts, path: str) -> str:
    meta = facts.pod["metadata"]
    spec = facts.pod["spec"]
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.hostIP": facts.host_ip,
        "status.hostIPs": facts.host_ip,
        "status.podIP": facts.pod_ip,
        "status.podIPs": facts.pod_ip,
    }
    if path in simple:
        return str(simple[path])
    for prefix, source in (
        ("metadata.labels", meta.get("labels") or {}),
        ("metadata.annotations", meta.get("annotations") or {}),
    ):
        if (key := _selector(path, prefix)) is not None:
            return str(source.get(key, ""))
        if path == prefix:
            return "\n".join(f'{k}="{v}"' for k, v in sorted(source.items()))
    raise ContainerConfigError(f"unsupported fieldPath: {path}")


def resource_value(facts: PodFacts, container: JSON, ref: JSON) -> str:
    """``resourceFieldRef``: a limit (the node's allocatable when unset) or a request."""
    kind, _, name = ref["resource"].partition(".")
    resources = container.get("resources") or {}
    values = resources.get(kind) or {}
    raw = values.get(name)
    if raw is None:
        raw = facts.allocatable.get(name, "0") if kind == "limits" else "0"
    divisor = parse_quantity(str(ref.get("divisor") or "1"))
    if divisor == 0:
        divisor = Decimal(1)
    return str(math.ceil(parse_quantity(str(raw)) / divisor))


def env_sources(pod: JSON) -> tuple[set[str], set[str]]:
    """(Secret names, ConfigMap names) that the containers' env and envFrom read."""
    secrets: set[str] = set()
    config_maps: set[str] = set()
    for container in pod["spec"].get("containers", []):
        for item in container.get("envFrom") or []:
            if "secretRef" in item:
                secrets.add(item["secretRef"]["name"])
            if "configMapRef" in item:
                config_maps.add(item["configMapRef"]["name"])
        for var in container.get("env") or []:
            source = var.get("valueFrom") or {}
            if "secretKeyRef" in source:
                secrets.add(source["secretKeyRef"]["name"])
            if "configMapKeyRef" in source:
                config_maps.add(source["configMapKeyRef"]["name"])
    return secrets, config_maps


def _key_ref(
    kind: str,
    ref: JSON,
    objects: Mapping[str, JSON | None],
    namespace: str,
) -> str | None:
    obj = objects.get(ref["name"])
    optional = bool(ref.get("optional"))
    if obj is None:
        if optional:
            return None
        raise ContainerConfigError(f'{kind.lower()} "{ref["name"]}" not found')
    key = ref["key"]
    value = decode(obj.get("data"), key) if kind == "Secret" else (obj.get("data") or {}).get(key)
    if value is None:
        if optional:
            return None
        raise ContainerConfigError(f"couldn't find key {key} in {kind} {namespace}/{ref['name']}")
    return str(value)


def container_env(
    facts: PodFacts,
    container: JSON,
    *,
    secrets: Mapping[str, JSON | None],
    config_maps: Mapping[str, JSON | None],
    service_env: Mapping[str, str],
) -> dict[str, str]:
    """The variables the pod spec defines, in the kubelet's order: service variables, then
    ``envFrom``, then ``env`` (each value expanded against what came before it)."""
    namespace = facts.pod["metadata"].get("namespace", "")
    env: dict[str, str] = dict(service_env)
    for item in container.get("envFrom") or []:
        prefix = item.get("prefix", "")
        if "configMapRef" in item:
            ref = item["configMapRef"]
            obj = config_maps.get(ref["name"])
            if obj is None and not ref.get("optional"):
                raise ContainerConfigError(f'configmap "{ref["name"]}" not found')
            data = {k: str(v) for k, v in ((obj or {}).get("data") or {}).items()}
        else:
            ref = item["secretRef"]
            obj = secrets.get(ref["name"])
            if obj is None and not ref.get("optional"):
                raise ContainerConfigError(f'secret "{ref["name"]}" not found')
            raw = (obj or {}).get("data") or {}
            data = {k: decode(raw, k) or "" for k in raw}
        env.update((prefix + key, value) for key, value in data.items())
    for var in container.get("env") or []:
        name = var["name"]
        source = var.get("valueFrom")
        if source is None:
            env[name] = expand(str(var.get("value", "")), env)
            continue
        value: str | None
        if "fieldRef" in source:
            value = field_value(facts, source["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in source:
            value = resource_value(facts, container, source["resourceFieldRef"])
        elif "secretKeyRef" in source:
            value = _key_ref("Secret", source["secretKeyRef"], secrets, namespace)
        elif "configMapKeyRef" in source:
            value = _key_ref("ConfigMap", source["configMapKeyRef"], config_maps, namespace)
        else:
            raise ContainerConfigError(f"unsupported valueFrom for {name}: {sorted(source)}")
        if value is not None:
            env[name] = value
    return env


def command_line(image: Image, container: JSON, env: Mapping[str, str]) -> list[str]:
    """Docker's rules: ``command`` replaces ENTRYPOINT (and drops CMD), ``args`` replaces CMD;
    ``$(VAR)`` in either is expanded against the pod-defined variables."""
    command = container.get("command")
    args = container.get("args")
    if command:
        argv = [*command, *(args or [])]
    else:
        argv = [*image.entrypoint, *(image.cmd if args is None else args)]
    if not argv:
        raise ContainerConfigError("no command specified")
    return [expand(str(part), env) for part in argv]


@dataclass(frozen=True)
class Security:
    uid: int
    gid: int
    groups: tuple[int, ...]
    read_only_root: bool
    no_new_privs: bool
    capabilities: tuple[str, ...]


def security(pod: JSON, container: JSON, image: Image) -> Security:
    """The process identity and confinement from the pod's and container's securityContext."""
    pod_ctx = pod["spec"].get("securityContext") or {}
    ctx = container.get("securityContext") or {}

    def pick(key: str) -> Any:
        return ctx.get(key, pod_ctx.get(key))

    uid = pick("runAsUser")
    uid = image.uid if uid is None else int(uid)
    gid = pick("runAsGroup")
    gid = (image.gid if pick("runAsUser") is None else 0) if gid is None else int(gid)
    if pick("runAsNonRoot") and uid == 0:
        raise ContainerConfigError(
            "container has runAsNonRoot and image will run as root "
            f'(pod: "{pod["metadata"]["name"]}_{pod["metadata"].get("namespace", "")}'
            f'({pod["metadata"].get("uid", "")})", container: {container["name"]})'
        )
    groups = {gid, *(int(g) for g in pod_ctx.get("supplementalGroups") or [])}
    if pod_ctx.get("fsGroup") is not None:
        groups.add(int(pod_ctx["fsGroup"]))
    privileged = bool(ctx.get("privileged"))
    return Security(
        uid=uid,
        gid=gid,
        groups=tuple(sorted(groups)),
        read_only_root=bool(ctx.get("readOnlyRootFilesystem")),
        # Kubernetes' default: escalation is allowed unless the container says otherwise.
        no_new_privs=ctx.get("allowPrivilegeEscalation") is False and not privileged,
        capabilities=tuple(sorted(capabilities(ctx, privileged))),
    )


def container_port(container: JSON, port: int | str) -> int:
    """A probe's or hook's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for item in container.get("ports") or []:
        if item.get("name") == port:
            return int(item["containerPort"])
    raise ValueError(f"port {port!r} is not one of the container's named ports")


@dataclass(frozen=True)
class Probe:
    action: str  # httpGet, tcpSocket, exec or grpc
    handler: JSON
    initial_delay: float
    period: float
    timeout: float
    success_threshold: int
    failure_threshold: int
    termination_grace: int | None


def probe(spec: JSON | None) -> Probe | None:
    """A probe with the API's defaults filled in (period 10 s, timeout 1 s, thresholds 1/3)."""
    if not spec:
        return None
    action = next(k for k in ("httpGet", "tcpSocket", "exec", "grpc") if k in spec)
    return Probe(
        action=action,
        handler=spec[action],
        initial_delay=float(spec.get("initialDelaySeconds", 0)),
        period=float(spec.get("periodSeconds", 10)),
        timeout=float(spec.get("timeoutSeconds", 1)),
        success_threshold=int(spec.get("successThreshold", 1)),
        failure_threshold=int(spec.get("failureThreshold", 3)),
        termination_grace=spec.get("terminationGracePeriodSeconds"),
    )


def gpu_count(container: JSON, resource: str) -> int:
    resources = container.get("resources") or {}
    raw = (resources.get("limits") or {}).get(resource) or (resources.get("requests") or {}).get(
        resource
    )
    return int(parse_quantity(str(raw))) if raw is not None else 0


def grace_seconds(pod: JSON) -> int:
    """How long termination may take: the deletion's own grace, else the spec's."""
    meta_grace = pod["metadata"].get("deletionGracePeriodSeconds")
    if meta_grace is not None:
        return int(meta_grace)
    return int(pod["spec"].get("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS))


def restart_policy(pod: JSON) -> str:
    return str(pod["spec"].get("restartPolicy", "Always"))


def should_restart(policy: str, exit_code: int | None) -> bool:
    if policy == "Always":
        return True
    if policy == "OnFailure":
        return exit_code != 0
    return False
