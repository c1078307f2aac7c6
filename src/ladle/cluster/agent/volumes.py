"""A pod's volumes as host folders, which each container's sandbox binds at its mount paths.

emptyDir is a folder in the pod's directory (``medium: Memory`` one on /dev/shm); ConfigMap,
Secret, downwardAPI and projected volumes (the ServiceAccount token from TokenRequest among
them) are written the kubelet's way, by an atomic writer (``..data`` symlink swaps), and are
refreshed while the pod runs, so a rotated Secret reaches the process within a minute; a
PersistentVolumeClaim resolves to its bound PersistentVolume's ``hostPath`` or ``local`` path.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ladle.cluster.agent.kube import JSON, ApiError, Kube
from ladle.cluster.agent.podspec import PodFacts, expand, field_value, resource_value

DEFAULT_MODE = 0o644
TOKEN_SECONDS = 3600
# Re-read ConfigMaps and Secrets this often (the kubelet's sync period is a minute).
REFRESH_SECONDS = 30.0


class VolumeError(Exception):
    """A volume cannot be set up (yet); reported as a FailedMount event and retried."""


@dataclass(frozen=True)
class HostVolume:
    path: Path
    read_only: bool


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool


Payload = dict[str, tuple[bytes, int]]


def write_atomically(folder: Path, payload: Payload, group: int | None) -> bool:
    """The kubelet's AtomicWriter: files land in a timestamped folder, ``..data`` points at it
    and each top-level name is a symlink through ``..data``, so readers see the old set or the
    new one, never a mix. Returns False when nothing changed."""
    folder.mkdir(parents=True, exist_ok=True)
    data_link = folder / "..data"
    if data_link.is_symlink():
        current = folder / os.readlink(data_link)
        if _same(current, payload):
            return False
    else:
        current = None
    stamp = datetime.datetime.now(datetime.UTC).strftime("..%Y_%m_%d_%H_%M_%S.%f")
    fresh = folder / stamp
    fresh.mkdir(mode=0o755)
    for rel, (content, mode) in payload.items():
        target = fresh / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
        target.chmod(mode)
        if group is not None:
            os.chown(target, -1, group)
    if group is not None:
        os.chown(fresh, -1, group)
    tmp_link = folder / "..data_tmp"
    with contextlib.suppress(FileNotFoundError):
        tmp_link.unlink()
    tmp_link.symlink_to(stamp)
    tmp_link.replace(data_link)
    wanted = {Path(rel).parts[0] for rel in payload}
    for entry in folder.iterdir():
        if entry.name.startswith(".."):
            continue
        if entry.name not in wanted:
            entry.unlink()
    for name in wanted:
        link = folder / name
        if not link.is_symlink():
            link.symlink_to(f"..data/{name}")
    if current is not None and current.exists():
        shutil.rmtree(current)
    return True


def _same(current: Path, payload: Payload) -> bool:
    if not current.is_dir():
        return False
    existing = {
        str(p.relative_to(current))
        for p in current.rglob("*")
        if p.is_file() and not p.is_symlink()
    }
    if existing != set(payload):
        return False
    return all(
        (current / rel).read_bytes() == content and (current / rel).stat().st_mode & 0o7777 == mode
        for rel, (content, mode) in payload.items()
    )


def _items(
    data: Mapping[str, bytes], items: list[JSON] | None, default_mode: int, what: str
) -> Payload:
    if not items:
        return {key: (value, default_mode) for key, value in data.items()}
    payload: Payload = {}
    for item in items:
        if item["key"] not in data:
            raise VolumeError(f"configuration of {what} has no key {item['key']!r}")
        payload[item["path"]] = (data[item["key"]], int(item.get("mode", default_mode)))
    return payload


class PodVolumes:
    """The volumes of one pod, under ``root`` (the pod's folder on the host)."""

    def __init__(self, kube: Kube, pod: JSON, root: Path, facts: PodFacts, shm_prefix: str) -> None:
        self.kube = kube
        self.pod = pod
        self.root = root
        self.facts = facts
        self.shm_prefix = shm_prefix
        self.volumes: dict[str, HostVolume] = {}
        self._token_expiry: dict[str, float] = {}

    @property
    def namespace(self) -> str:
        return str(self.pod["metadata"]["namespace"])

    @property
    def fs_group(self) -> int | None:
        group = (self.pod["spec"].get("securityContext") or {}).get("fsGroup")
        return None if group is None else int(group)

    async def setup(self) -> None:
        """Create or refresh every volume; raises VolumeError naming the first that fails."""
        for volume in self.pod["spec"].get("volumes") or []:
            self.volumes[volume["name"]] = await self._volume(volume)

    async def _volume(self, volume: JSON) -> HostVolume:
        name = volume["name"]
        folder = self.root / "volumes" / name
        if "emptyDir" in volume:
            if (volume["emptyDir"] or {}).get("medium") == "Memory":
                folder = Path("/dev/shm") / f"{self.shm_prefix}{name}"
            if not folder.is_dir():
                folder.mkdir(parents=True)
                folder.chmod(0o777)  # as the kubelet makes them: any container user may write
                if self.fs_group is not None:
                    os.chown(folder, -1, self.fs_group)
            return HostVolume(folder, False)
        if "configMap" in volume:
            await self._write(folder, await self._config_map_payload(volume["configMap"]))
            return HostVolume(folder, True)
        if "secret" in volume:
            await self._write(folder, await self._secret_payload(volume["secret"]))
            return HostVolume(folder, True)
        if "downwardAPI" in volume:
            source = volume["downwardAPI"]
            mode = int(source.get("defaultMode", DEFAULT_MODE))
            await self._write(folder, self._downward_payload(source.get("items") or [], mode))
            return HostVolume(folder, True)
        if "projected" in volume:
            await self._write(folder, await self._projected_payload(name, volume["projected"]))
            return HostVolume(folder, True)
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]
            path = await self._claim_path(claim["claimName"])
            return HostVolume(path, bool(claim.get("readOnly")))
        if "hostPath" in volume:
            return HostVolume(_host_path(volume["hostPath"]), False)
        kinds = sorted(k for k in volume if k != "name")
        raise VolumeError(
            f"volume {name!r}: {', '.join(kinds)} volumes are not supported by the ladle node "
            "agent (emptyDir, configMap, secret, downwardAPI, projected, persistentVolumeClaim "
            "and hostPath are)"
        )

    async def _write(self, folder: Path, payload: Payload) -> None:
        write_atomically(folder, payload, self.fs_group)

    async def _get(self, kind: str, name: str) -> JSON | None:
        plural = {"ConfigMap": "configmaps", "Secret": "secrets"}[kind]
        try:
            obj: JSON = await self.kube.get(f"/api/v1/namespaces/{self.namespace}/{plural}/{name}")
        except ApiError as err:
            if err.status == 404:
                return None
            raise
        return obj

    async def _config_map_payload(self, source: JSON) -> Payload:
        obj = await self._get("ConfigMap", source["name"])
        if obj is None:
            if source.get("optional"):
                return {}
            raise VolumeError(f'configmap "{source["name"]}" not found')
        data = {k: str(v).encode() for k, v in (obj.get("data") or {}).items()}
        data.update((k, base64.b64decode(v)) for k, v in (obj.get("binaryData") or {}).items())
        mode = int(source.get("defaultMode", DEFAULT_MODE))
        return _items(data, source.get("items"), mode, f'configmap "{source["name"]}"')

    async def _secret_payload(self, source: JSON) -> Payload:
        name = source.get("secretName") or source.get("name", "")
        obj = await self._get("Secret", name)
        if obj is None:
            if source.get("optional"):
                return {}
            raise VolumeError(f'secret "{name}" not found')
        data = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        mode = int(source.get("defaultMode", DEFAULT_MODE))
        return _items(data, source.get("items"), mode, f'secret "{name}"')

    def _downward_payload(self, items: list[JSON], mode: int) -> Payload:
        payload: Payload = {}
        containers = {c["name"]: c for c in self.pod["spec"].get("containers", [])}
        for item in items:
            if "fieldRef" in item:
                value = field_value(self.facts, item["fieldRef"]["fieldPath"])
            else:
                ref = item["resourceFieldRef"]
                value = resource_value(self.facts, containers[ref["containerName"]], ref)
            payload[item["path"]] = (value.encode(), int(item.get("mode", mode)))
        return payload

    async def _projected_payload(self, volume_name: str, projected: JSON) -> Payload:
        mode = int(projected.get("defaultMode", DEFAULT_MODE))
        payload: Payload = {}
        for source in projected.get("sources") or []:
            if "serviceAccountToken" in source:
                payload.update(await self._token(volume_name, source["serviceAccountToken"], mode))
            elif "configMap" in source:
                payload.update(
                    await self._config_map_payload({"defaultMode": mode, **source["configMap"]})
                )
            elif "secret" in source:
                payload.update(
                    await self._secret_payload({"defaultMode": mode, **source["secret"]})
                )
            elif "downwardAPI" in source:
                payload.update(
                    self._downward_payload(source["downwardAPI"].get("items") or [], mode)
                )
            else:
                raise VolumeError(f"projected source {sorted(source)} is not supported")
        return payload

    async def _token(self, volume_name: str, source: JSON, mode: int) -> Payload:
        """A bound ServiceAccount token, renewed once 80% of its life has passed."""
        path = source.get("path", "token")
        key = f"{volume_name}/{path}"
        current = self.root / "volumes" / volume_name / path
        if self._token_expiry.get(key, 0.0) > time.time() and current.is_file():
            return {path: (current.read_bytes(), mode)}
        meta = self.pod["metadata"]
        seconds = int(source.get("expirationSeconds", TOKEN_SECONDS))
        audience = source.get("audience")
        request = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "audiences": [audience] if audience else [],
                "expirationSeconds": seconds,
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": meta["name"],
                    "uid": meta["uid"],
                },
            },
        }
        account = self.pod["spec"].get("serviceAccountName") or "default"
        issued = await self.kube.create(
            f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{account}/token", request
        )
        self._token_expiry[key] = time.time() + 0.8 * seconds
        return {path: (issued["status"]["token"].encode(), mode)}

    async def _claim_path(self, claim_name: str) -> Path:
        try:
            claim = await self.kube.get(
                f"/api/v1/namespaces/{self.namespace}/persistentvolumeclaims/{claim_name}"
            )
        except ApiError as err:
            if err.status == 404:
                raise VolumeError(f'persistentvolumeclaim "{claim_name}" not found') from err
            raise
        volume_name = claim["spec"].get("volumeName")
        if claim.get("status", {}).get("phase") != "Bound" or not volume_name:
            raise VolumeError(f'persistentvolumeclaim "{claim_name}" is not bound yet')
        pv = await self.kube.get(f"/api/v1/persistentvolumes/{volume_name}")
        spec = pv["spec"]
        if "hostPath" in spec:
            return _host_path(spec["hostPath"])
        if "local" in spec:
            return _host_path({"path": spec["local"]["path"], "type": "Directory"})
        kinds = sorted(k for k in ("csi", "nfs", "iscsi", "fc", "rbd", "cephfs") if k in spec)
        raise VolumeError(
            f"persistentvolume {volume_name!r} is {', '.join(kinds) or 'of an unknown kind'}; "
            "the ladle node agent binds only hostPath and local volumes"
        )

    def mounts(self, container: JSON, env: Mapping[str, str]) -> list[Mount]:
        """The container's volumeMounts as (host source, container target) binds."""
        result = []
        for item in container.get("volumeMounts") or []:
            volume = self.volumes.get(item["name"])
            if volume is None:
                raise VolumeError(f"volumeMount {item['name']!r} names no volume of the pod")
            source = volume.path
            sub = item.get("subPath") or expand(item.get("subPathExpr", ""), env)
            if sub:
                if Path(sub).is_absolute() or ".." in Path(sub).parts:
                    raise VolumeError(f"subPath {sub!r} must be a relative path inside the volume")
                source = source / sub
                if not source.exists() and not volume.read_only:
                    source.mkdir(parents=True)
                    source.chmod(0o777)
            result.append(
                Mount(
                    str(source), item["mountPath"], volume.read_only or bool(item.get("readOnly"))
                )
            )
        return result

    def remove(self) -> None:
        """Delete what the pod's volumes created (never a PVC's or hostPath's data)."""
        for volume in self.volumes.values():
            if volume.path.parent == Path("/dev/shm"):
                shutil.rmtree(volume.path, ignore_errors=True)


_HOST_PATH_CHECKS = {
    "Directory": os.path.isdir,
    "File": os.path.isfile,
    "Socket": lambda p: Path(p).is_socket(),
    "CharDevice": lambda p: Path(p).is_char_device(),
    "BlockDevice": lambda p: Path(p).is_block_device(),
}


def _host_path(source: Mapping[str, Any]) -> Path:
    path = Path(source["path"])
    kind = source.get("type") or ""
    # An unset type creates a missing folder, as Docker's binds do.
    if kind in ("DirectoryOrCreate", "") and not path.exists():
        path.mkdir(parents=True, mode=0o755)
    elif kind == "FileOrCreate" and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o644)
    check = _HOST_PATH_CHECKS.get(kind)
    if check is not None and not check(str(path)):
        raise VolumeError(f"hostPath type check failed: {path} is not a {kind}")
    return path
