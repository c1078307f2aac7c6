"""What the kubelet does for one pod, with processes for containers.

A ``PodWorker`` owns a pod bound to its node: it gives the pod an address, sets up its volumes,
runs one ``ContainerSupervisor`` per container, posts the pod's status whenever it changes, and
on deletion stops the containers (preStop, SIGTERM, the grace period, SIGKILL) and deletes the
pod with grace 0. A supervisor starts its container, probes it, restarts it per
``restartPolicy`` with the kubelet's back-off (immediately the first time, then 10 s doubling
to 5 min), and records every exit in ``lastState``.

Cancelling a worker (the agent is stopping) leaves its processes running: the next agent
adopts them from the records written here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

import ladle
from ladle.cluster.agent import images, podspec, probes
from ladle.cluster.agent.allocators import AddressAllocator, Exhausted, GpuAllocator
from ladle.cluster.agent.config import CLUSTER_ENV, AgentConfig, NodeConfig
from ladle.cluster.agent.containers import ContainerRecord, Process, launch
from ladle.cluster.agent.events import EventRecorder
from ladle.cluster.agent.kube import JSON, TRANSIENT, ApiError, Kube
from ladle.cluster.agent.node import now
from ladle.cluster.agent.status import ContainerView, pod_status
from ladle.cluster.agent.volumes import REFRESH_SECONDS, Mount, PodVolumes, VolumeError
from ladle.cluster.nodes import GPU_RESOURCE

log = logging.getLogger("ladle.node_agent")

BACKOFF_INITIAL = 10.0
BACKOFF_MAX = 300.0
# A container that ran this long without failing starts its back-off afresh.
BACKOFF_RESET_SECONDS = 600.0
# Even a grace period of 0 gets this long after SIGTERM (the kubelet's minimum).
MIN_STOP_SECONDS = 2.0
# An image or configuration error is re-checked this often, or when the pod changes.
RECHECK_SECONDS = 10.0
TERMINATION_MESSAGE_LIMIT = 4096


@dataclass
class NodeContext:
    """Everything a pod worker needs from its node and agent."""

    config: AgentConfig
    node: NodeConfig
    kube: Kube
    events: EventRecorder
    ips: AddressAllocator
    gpus: GpuAllocator
    shim: Path
    http: aiohttp.ClientSession
    pulls: Pulls
    allocatable: dict[str, str]
    workers: dict[str, PodWorker] = field(default_factory=dict)

    @property
    def pods_dir(self) -> Path:
        return Path(self.config.state_dir) / "pods"

    def service_env(self) -> dict[str, str]:
        """The ``kubernetes`` Service's variables, pointing at the real API server."""
        host, port = self.config.api_host, self.config.api_port
        url = f"tcp://{host}:{port}"
        return {
            "KUBERNETES_SERVICE_HOST": host,
            "KUBERNETES_SERVICE_PORT": str(port),
            "KUBERNETES_SERVICE_PORT_HTTPS": str(port),
            "KUBERNETES_PORT": url,
            f"KUBERNETES_PORT_{port}_TCP": url,
            f"KUBERNETES_PORT_{port}_TCP_PROTO": "tcp",
            f"KUBERNETES_PORT_{port}_TCP_PORT": str(port),
            f"KUBERNETES_PORT_{port}_TCP_ADDR": host,
        }

    def reachable(self) -> list[str]:
        """Host paths a container's user must be able to reach: the interpreter, its
        environment, the ladle sources and the bind shim."""
        package = Path(ladle.__file__).resolve().parent
        paths = {
            os.path.realpath(sys.executable),
            sys.prefix,
            sys.base_prefix,
            str(package),
            str(self.shim),
        }
        paths.update(str(p.resolve()) for p in package.iterdir() if p.is_symlink())
        return sorted(paths)


class Pulls:
    """Makes an image's files present once per agent (the "pull"), one at a time per file."""

    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}

    async def ensure(self, image: images.Image, notify: Callable[[str, str], None]) -> bool:
        """True when something had to be prepared (a real pull), False when all was there."""
        pulled = False
        for item in image.files:
            if item.present():
                item.make_readable()
                continue
            async with self._locks.setdefault(item.path, asyncio.Lock()):
                if item.present():
                    continue
                pulled = True
                notify("Pulling", f'Pulling image "{image.repository}": {item.describe}')
                proc = await asyncio.create_subprocess_exec(
                    *item.prepare,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.STDOUT,
                )
                output, _ = await proc.communicate()
                if proc.returncode != 0 or not item.present():
                    tail = output.decode(errors="replace").strip()[-1500:]
                    raise images.ImageError("ErrImagePull", f"{item.describe} failed: {tail}")
                item.make_readable()
        return pulled


@dataclass
class PodRecord:
    uid: str
    namespace: str
    name: str
    node: str
    ip: str
    start_time: str

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> PodRecord | None:
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None


class PodWorker:
    def __init__(self, ctx: NodeContext, pod: JSON) -> None:
        self.ctx = ctx
        self.pod = pod
        self.uid: str = pod["metadata"]["uid"]
        self.dir = ctx.pods_dir / self.uid
        self.record = PodRecord.load(self.dir / "pod.json")
        self.ip = ""
        self.sandbox_ready = False
        self.terminating = asyncio.Event()
        self.gone = False
        self._updated = asyncio.Event()
        self._dirty = asyncio.Event()
        self._posted: JSON | None = None
        self.supervisors: dict[str, ContainerSupervisor] = {}
        self.init_supervisors: dict[str, ContainerSupervisor] = {}
        self.initialized = False
        self.volumes: PodVolumes | None = None
        self.task: asyncio.Task[None] | None = None

    # -- inputs from the watch --------------------------------------------------------------------
    @property
    def name(self) -> str:
        return f"{self.pod['metadata'].get('namespace')}/{self.pod['metadata']['name']}"

    def update(self, pod: JSON) -> None:
        self.pod = pod
        if pod["metadata"].get("deletionTimestamp"):
            self.terminating.set()
        self._updated.set()
        for supervisor in self.all_supervisors():
            supervisor.spec_changed()

    def vanish(self) -> None:
        """The pod object is gone (force-deleted, or its namespace went): stop everything."""
        self.gone = True
        self.terminating.set()
        self._updated.set()

    def changed(self) -> None:
        self._dirty.set()

    async def sleep(self, seconds: float) -> None:
        """Sleep, waking early when the pod is being deleted."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.terminating.wait(), seconds)

    async def wait_update(self, seconds: float) -> None:
        self._updated.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._updated.wait(), seconds)

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=f"pod {self.name}")

    async def _run(self) -> None:
        try:
            await self._lifecycle()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("pod worker failed", extra={"pod": self.name})
        finally:
            if self.ctx.workers.get(self.uid) is self:
                self.ctx.workers.pop(self.uid, None)

    async def _lifecycle(self) -> None:
        phase = (self.pod.get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed"):
            # It has run to completion: nothing runs again, and its owner deletes it.
            await self.terminating.wait()
            if self.record is not None:
                self._release()
            await self._delete()
            return
        if self.record is None and self.terminating.is_set():
            await self._delete()  # deleted before it ever ran here
            return
        adopted = self.record is not None
        self._prepare_sandbox()
        spec = self.pod["spec"]
        self.init_supervisors = {
            c["name"]: ContainerSupervisor(self, c, init=True)
            for c in spec.get("initContainers") or []
        }
        self.supervisors = {c["name"]: ContainerSupervisor(self, c) for c in spec["containers"]}
        for supervisor in self.all_supervisors():
            supervisor.adopt()
        self.initialized = all(s.succeeded for s in self.init_supervisors.values())
        # A pod a previous agent ran keeps its sandbox: no condition flaps on an agent restart.
        self.sandbox_ready = adopted
        children: list[asyncio.Task[Any]] = [asyncio.create_task(self._status_loop())]
        self.changed()
        try:
            await self._setup_volumes()
            children.append(asyncio.create_task(self._refresh_volumes()))
            runs = await self._initialize(children)
            if self.initialized:
                runs += [asyncio.create_task(s.run()) for s in self.supervisors.values()]
            else:
                runs = []  # an init container failed for good: nothing else starts
            ended = asyncio.create_task(self.terminating.wait())
            finished = asyncio.create_task(_all(runs))
            children += [*runs, ended, finished]
            await asyncio.wait([ended, finished], return_when="FIRST_COMPLETED")
            if not self.terminating.is_set():
                await self._flush_status()  # every container is done for good
                await self.terminating.wait()
            await self.stop_containers()
            await finished
            await self._flush_status()
        finally:
            for child in children:
                child.cancel()
        self._release()
        await self._delete()

    def all_supervisors(self) -> list[ContainerSupervisor]:
        return [*self.init_supervisors.values(), *self.supervisors.values()]

    async def _initialize(self, children: list[asyncio.Task[Any]]) -> list[asyncio.Task[None]]:
        """Run the init containers in order, each to completion (a sidecar only until it has
        started); returns the tasks still running (sidecars). ``initialized`` stays False when
        one fails for good or the pod is deleted meanwhile."""
        running: list[asyncio.Task[None]] = []
        if self.initialized:
            return [
                asyncio.create_task(s.run()) for s in self.init_supervisors.values() if s.sidecar
            ]
        for supervisor in self.init_supervisors.values():
            if supervisor.succeeded and not supervisor.sidecar:
                continue  # it finished before an agent restart
            task = asyncio.create_task(supervisor.run())
            children.append(task)
            running.append(task)
            while not (supervisor.succeeded or task.done() or self.terminating.is_set()):
                await asyncio.wait([task], timeout=0.2)
            if not supervisor.succeeded:
                return running
        self.initialized = True
        self.changed()
        return [t for t in running if not t.done()]

    def _prepare_sandbox(self) -> None:
        meta = self.pod["metadata"]
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.record is not None:
            self.ip = self.record.ip
            self.ctx.ips.reserve(self.ip)
        else:
            self.ip = (
                self.ctx.node.ip if self.pod["spec"].get("hostNetwork") else self.ctx.ips.allocate()
            )
            self.record = PodRecord(
                self.uid, meta["namespace"], meta["name"], self.ctx.node.name, self.ip, now()
            )
            self.record.save(self.dir / "pod.json")
        spec = self.pod["spec"]
        hostname = spec.get("hostname") or meta["name"]
        fqdn = f"{hostname}.{spec['subdomain']}" if spec.get("subdomain") else hostname
        (self.dir / "etc-hosts").write_text(
            "# Kubernetes-managed hosts file (the ladle node agent).\n"
            "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
            f"{self.ip}\t{fqdn} {hostname}\n"
        )

    def facts(self) -> podspec.PodFacts:
        return podspec.PodFacts(self.pod, self.ip, self.ctx.node.ip, self.ctx.allocatable)

    async def _setup_volumes(self) -> None:
        shm_prefix = f"ladle-{self.ctx.config.cluster_id}-{self.uid}-"
        self.volumes = PodVolumes(self.ctx.kube, self.pod, self.dir, self.facts(), shm_prefix)
        delay = 1.0
        while not self.terminating.is_set():
            try:
                await self.volumes.setup()
            except (VolumeError, podspec.ContainerConfigError, *TRANSIENT) as err:
                message = getattr(err, "message", None) or str(err)
                self.ctx.events.emit(
                    self.pod, "FailedMount", f"MountVolume.SetUp failed: {message}", warning=True
                )
                await self.sleep(delay)
                delay = min(delay * 2, 30.0)
                continue
            self.sandbox_ready = True
            self.changed()
            return

    async def _refresh_volumes(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_SECONDS)
            if self.volumes is None:
                continue
            try:
                await self.volumes.setup()
            except (VolumeError, podspec.ContainerConfigError, *TRANSIENT) as err:
                log.warning("volume refresh failed", extra={"pod": self.name, "error": str(err)})

    async def stop_containers(self) -> None:
        """Stop the app containers, then the sidecars (the kubelet's order)."""
        grace = podspec.grace_seconds(self.pod)
        for supervisor in self.all_supervisors():
            supervisor.view.ready = False
        self.changed()
        await asyncio.gather(*(s.stop(grace) for s in self.supervisors.values()))
        await asyncio.gather(*(s.stop(grace) for s in self.init_supervisors.values()))

    def _release(self) -> None:
        self.ctx.gpus.release(self.uid)
        if not self.pod["spec"].get("hostNetwork"):
            self.ctx.ips.release(self.ip)
        if self.volumes is not None:
            self.volumes.remove()
        shutil.rmtree(self.dir, ignore_errors=True)
        self.ctx.events.forget(self.uid)

    async def _delete(self) -> None:
        if self.gone:
            return
        meta = self.pod["metadata"]
        if not meta.get("deletionTimestamp"):
            return  # a finished pod stays until its owner deletes it
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
        body = {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}}
        for _ in range(10):
            try:
                await self.ctx.kube.delete(path, body)
                return
            except ApiError as err:
                if err.status in (404, 409):
                    return
                await asyncio.sleep(1)
            except TRANSIENT:
                await asyncio.sleep(1)

    # -- status -----------------------------------------------------------------------------------
    def status(self) -> JSON:
        views = [s.view for s in self.supervisors.values()]
        if not self.initialized:
            for view in views:
                if "waiting" in view.state:
                    view.state = {"waiting": {"reason": "PodInitializing"}}
        assert self.record is not None
        return pod_status(
            self.pod,
            views,
            init_containers=[s.view for s in self.init_supervisors.values()],
            sidecars={s.name for s in self.init_supervisors.values() if s.sidecar},
            initialized=self.initialized,
            pod_ip=self.ip,
            host_ip=self.ctx.node.ip,
            start_time=self.record.start_time,
            sandbox_ready=self.sandbox_ready,
            now=now(),
        )

    async def _status_loop(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            await self._post_status()
            await asyncio.sleep(0.05)  # coalesce bursts of changes into one write

    async def _flush_status(self) -> None:
        self._dirty.clear()
        await self._post_status()

    async def _post_status(self) -> None:
        if self.gone:
            return
        status = self.status()
        comparable = {
            **status,
            "conditions": [dict(c, lastTransitionTime="") for c in status["conditions"]],
        }
        if comparable == self._posted:
            return
        meta = self.pod["metadata"]
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status"
        try:
            updated = await self.ctx.kube.patch(path, {"status": status})
        except ApiError as err:
            if err.status == 404:
                self.vanish()
                return
            log.warning("status update failed", extra={"pod": self.name, "error": str(err)})
            self._retry_status()
            return
        except TRANSIENT as err:
            log.warning("status update failed", extra={"pod": self.name, "error": str(err)})
            self._retry_status()
            return
        self._posted = comparable
        if updated.get("metadata", {}).get("uid") == self.uid:
            self.pod = {**self.pod, "status": updated.get("status", {})}

    def _retry_status(self) -> None:
        asyncio.get_running_loop().call_later(1.0, self._dirty.set)


class ContainerSupervisor:
    """One container of a pod: start, probe, restart, stop."""

    def __init__(self, pod: PodWorker, spec: JSON, init: bool = False) -> None:
        self.pod = pod
        self.ctx = pod.ctx
        self.spec = spec
        self.name: str = spec["name"]
        self.init = init
        # An init container with restartPolicy Always is a sidecar: it keeps running.
        self.sidecar = init and spec.get("restartPolicy") == "Always"
        self.dir: Path = pod.dir / "containers" / self.name
        self._exit: int | None = None  # an exit the previous agent recorded, still to handle
        self.view = ContainerView(self.name, spec.get("image", ""))
        self.process: Process | None = None
        self.record: ContainerRecord | None = None
        self.image: images.Image | None = None
        self.target: probes.Target | None = None
        self._stopping: asyncio.Task[None] | None = None
        self._kill: asyncio.Task[None] | None = None
        self._backoff = 0.0
        self._started_monotonic = 0.0
        self._reported: tuple[str, str] | None = None

    # -- paths ------------------------------------------------------------------------------------
    def log_path(self, restart: int) -> Path:
        return self.dir / "logs" / f"{restart}.log"

    @property
    def running(self) -> bool:
        return self.process is not None

    def spec_changed(self) -> None:
        kind = "initContainers" if self.init else "containers"
        for container in self.pod.pod["spec"].get(kind) or []:
            if container["name"] == self.name and container.get("image") != self.spec.get("image"):
                self.spec = container
                if self.process is not None and self._kill is None:
                    message = f"Container {self.name} definition changed, will be restarted"
                    self._kill = asyncio.create_task(self._stop_for_restart(message))

    # -- the loop ---------------------------------------------------------------------------------
    async def run(self) -> None:
        """Run until the container is done for good (or the pod is deleted)."""
        policy = podspec.restart_policy(self.pod.pod)
        while not self.pod.terminating.is_set():
            code = self._exit
            if code is None:
                if self.process is None and not await self._start():
                    continue
                assert self.process is not None
                probing = asyncio.create_task(self._probe_all())
                try:
                    code = await self.process.wait()
                finally:
                    probing.cancel()
                self._exited(code)
            self._exit = None
            if self._stopping is not None or self.pod.terminating.is_set():
                break
            if not self._restarts(policy, code):
                self.view.final = True
                self.pod.changed()
                return
            await self._back_off()
        self.view.final = True
        self.pod.changed()

    def _restarts(self, policy: str, code: int | None) -> bool:
        # A probe kill restarts unless the policy is Never, whatever the exit code.
        killed, self._kill = self._kill is not None, None
        if self.sidecar:
            return True
        if self.init:
            return code != 0 and policy != "Never"
        return policy != "Never" if killed else podspec.should_restart(policy, code)

    @property
    def succeeded(self) -> bool:
        """An init container that has run to completion (or a sidecar that has started)."""
        if self.sidecar:
            return self.view.started
        terminated = self.view.state.get("terminated") or {}
        return self.view.final and terminated.get("exitCode") == 0

    def adopt(self) -> None:
        """Take over the process a previous agent started, if it still runs."""
        self.dir.mkdir(parents=True, exist_ok=True)
        record = ContainerRecord.load(self.dir / "record.json")
        if record is None:
            return
        self.record = record
        self.view.restart_count = record.restart_count
        self.view.last_state = record.last_state
        self.view.container_id = record.container_id
        self.view.image_id = record.image_id
        self.ctx.gpus.reserve((self.pod.uid, self.name), record.gpus)
        process = Process.adopt(record.pid, record.create_time)
        if process is None and record.exited:
            self.view.state = {"terminated": record.exited}
            if self.init and not self.sidecar and record.exited.get("exitCode") == 0:
                self.view.final = True  # a finished init container never runs again
                return
            # It ended while a previous agent watched; decide its restart as that agent would.
            self._exit = int(record.exited.get("exitCode", 137))
            return
        if process is None:
            self.view.state = {"waiting": {"reason": "ContainerCreating"}}
            self.view.last_state = {
                "terminated": {
                    "exitCode": 137,
                    "reason": "ContainerStatusUnknown",
                    "message": "The container exited while the node agent was not running",
                    "startedAt": record.started_at,
                    "finishedAt": now(),
                    "containerID": record.container_id,
                }
            }
            self.view.restart_count += 1
            return
        self.process = process
        self.target = probes.Target(self.pod.ip, record.pid, record.uid, record.gid, record.env)
        self._started_monotonic = asyncio.get_running_loop().time()
        self.view.state = {"running": {"startedAt": record.started_at}}
        # Keep what was last reported, so an agent restart does not flap Ready.
        kind = "initContainerStatuses" if self.init else "containerStatuses"
        for status in (self.pod.pod.get("status") or {}).get(kind) or []:
            if status.get("name") == self.name and status.get("containerID") == record.container_id:
                self.view.started = bool(status.get("started"))
                self.view.ready = bool(status.get("ready"))
        self.pod.changed()

    async def _start(self) -> bool:
        """Start one instance; False (after waiting a while) when it cannot start yet."""
        try:
            self.image = images.resolve(str(self.spec.get("image", "")))
            pulled = await self.ctx.pulls.ensure(self.image, self._pull_event)
        except images.ImageError as err:
            self._waiting(err.reason, err.message)
            await self.pod.wait_update(RECHECK_SECONDS)
            return False
        try:
            spec, env, sec, gpus = await self._configure(self.image)
        except (podspec.ContainerConfigError, VolumeError, Exhausted, ValueError) as err:
            self._waiting(podspec.ContainerConfigError.reason, str(err))
            await self.pod.wait_update(RECHECK_SECONDS)
            return False
        except TRANSIENT as err:
            log.warning("container configuration failed", extra={"error": str(err)})
            await self.pod.sleep(1.0)
            return False
        if self.pod.terminating.is_set():
            return False
        self._pull_event(
            "Pulled",
            f'Successfully prepared image "{self.spec["image"]}"'
            if pulled
            else f'Container image "{self.spec["image"]}" already present on machine',
        )
        restart = self.view.restart_count
        for old in (self.dir / "logs").glob("*.log"):
            if int(old.stem) < restart - 1:
                old.unlink()
        (self.dir / "logs").mkdir(exist_ok=True)
        for folder in ("root", "scratch"):
            (self.dir / folder).mkdir(exist_ok=True)
        (self.dir / "error").unlink(missing_ok=True)
        (self.dir / "termination-log").write_text("")
        self.process = launch(spec, self.dir / "spec.json", self.log_path(restart))
        await self.process.executed()
        self._started_monotonic = asyncio.get_running_loop().time()
        started_at = now()
        self.view.container_id = f"ladle://{secrets.token_hex(32)}"
        self.view.image_id = f"ladle-node-agent://{self.image.repository}@ladle-{ladle.__version__}"
        self.view.state = {"running": {"startedAt": started_at}}
        self.view.started = False
        self.view.ready = False
        self.target = probes.Target(self.pod.ip, self.process.pid, sec.uid, sec.gid, env)
        self.record = ContainerRecord(
            name=self.name,
            container_id=self.view.container_id,
            pid=self.process.pid,
            create_time=self.process.create_time,
            restart_count=restart,
            started_at=started_at,
            image=str(self.spec.get("image")),
            image_id=self.view.image_id,
            gpus=gpus,
            uid=sec.uid,
            gid=sec.gid,
            env=env,
            last_state=self.view.last_state,
        )
        self.record.save(self.dir / "record.json")
        self._reported = None
        self.ctx.events.emit(
            self.pod.pod, "Created", f"Created container: {self.name}", container=self.name
        )
        self.ctx.events.emit(
            self.pod.pod, "Started", f"Started container {self.name}", container=self.name
        )
        self.pod.changed()
        return True

    def _pull_event(self, reason: str, message: str) -> None:
        self.ctx.events.emit(self.pod.pod, reason, message, container=self.name)

    def _waiting(self, reason: str, message: str) -> None:
        self.view.state = {"waiting": {"reason": reason, "message": message}}
        if self._reported != (reason, message):
            self._reported = (reason, message)
            self.ctx.events.emit(
                self.pod.pod,
                reason if reason.startswith("Err") else "Failed",
                message if reason.startswith("Err") else f"Error: {message}",
                warning=True,
                container=self.name,
            )
        self.pod.changed()

    async def _configure(
        self, image: images.Image
    ) -> tuple[JSON, dict[str, str], podspec.Security, list[int]]:
        """The sandbox spec for one start: environment, command, mounts, identity, GPUs."""
        pod = self.pod.pod
        secret_names, config_map_names = podspec.env_sources({"spec": {"containers": [self.spec]}})
        secret_objs = {n: await self._get("secrets", n) for n in secret_names}
        config_map_objs = {n: await self._get("configmaps", n) for n in config_map_names}
        pod_env = podspec.container_env(
            self.pod.facts(),
            self.spec,
            secrets=secret_objs,
            config_maps=config_map_objs,
            service_env=self.ctx.service_env(),
        )
        argv = podspec.command_line(image, self.spec, pod_env)
        sec = podspec.security(pod, self.spec, image)
        gpus = self.ctx.gpus.allocate(
            (self.pod.uid, self.name), podspec.gpu_count(self.spec, GPU_RESOURCE)
        )
        visible = ",".join(str(g) for g in gpus)
        preload = " ".join(p for p in (str(self.ctx.shim), pod_env.get("LD_PRELOAD", "")) if p)
        env = {
            **image.environment(),
            "HOSTNAME": pod["spec"].get("hostname") or pod["metadata"]["name"],
            **pod_env,
            "LD_PRELOAD": preload,
            "LADLE_POD_IP": self.pod.ip,
            "CUDA_VISIBLE_DEVICES": visible,
            "NVIDIA_VISIBLE_DEVICES": visible or "void",
            CLUSTER_ENV: self.ctx.config.cluster_id,
        }
        assert self.pod.volumes is not None
        mounts = self.pod.volumes.mounts(self.spec, pod_env)
        mounts.append(Mount(str(self.pod.dir / "etc-hosts"), "/etc/hosts", False))
        message_path = self.spec.get("terminationMessagePath") or (
            podspec.DEFAULT_TERMINATION_MESSAGE_PATH
        )
        mounts.append(Mount(str(self.dir / "termination-log"), message_path, False))
        mounts += [Mount(str(f.host_path), f.path, True) for f in image.files]
        spec = {
            "root": str(self.dir / "root"),
            "scratch": str(self.dir / "scratch"),
            "hostname": env["HOSTNAME"],
            "uid": sec.uid,
            "gid": sec.gid,
            "groups": list(sec.groups),
            "reachable": self.ctx.reachable(),
            "mounts": [asdict(m) for m in mounts],
            "read_only_root": sec.read_only_root,
            "workdir": self.spec.get("workingDir") or image.workdir,
            "capabilities": list(sec.capabilities),
            "no_new_privs": sec.no_new_privs,
            "argv": argv,
            "env": env,
            "error_file": str(self.dir / "error"),
        }
        return spec, env, sec, gpus

    async def _get(self, plural: str, name: str) -> JSON | None:
        namespace = self.pod.pod["metadata"]["namespace"]
        try:
            obj: JSON = await self.ctx.kube.get(f"/api/v1/namespaces/{namespace}/{plural}/{name}")
        except ApiError as err:
            if err.status == 404:
                return None
            raise
        return obj

    def _exited(self, code: int | None) -> None:
        """Record how the instance ended and clear out what it left behind."""
        assert self.process is not None
        self.process.kill_session()
        self.process = None
        started = (self.view.state.get("running") or {}).get("startedAt", now())
        terminated: JSON = {
            "exitCode": 137 if code is None else code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": started,
            "finishedAt": now(),
            "containerID": self.view.container_id,
        }
        if code is None:
            terminated["reason"] = "ContainerStatusUnknown"
            terminated["message"] = "the process ended while the node agent was not its parent"
        if code is not None and code > 128:
            terminated["signal"] = code - 128
        error = _read_json(self.dir / "error")
        message = _read_text(self.dir / "termination-log", TERMINATION_MESSAGE_LIMIT)
        if error:
            terminated.update(reason=error["reason"], message=error["message"])
        elif message:
            terminated["message"] = message
        elif code != 0 and self.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            tail = _read_text(self.log_path(self.view.restart_count), 2048, tail=True)
            terminated["message"] = "\n".join(tail.splitlines()[-80:])
        self.view.state = {"terminated": terminated}
        self.view.ready = False
        self.view.started = False
        if self.record is not None:
            self.record.exited = terminated
            self.record.save(self.dir / "record.json")
        self.pod.changed()

    async def _back_off(self) -> None:
        ran = asyncio.get_running_loop().time() - self._started_monotonic
        if ran >= BACKOFF_RESET_SECONDS:
            self._backoff = 0.0
        delay = self._backoff
        self._backoff = BACKOFF_INITIAL if delay == 0 else min(delay * 2, BACKOFF_MAX)
        self.view.last_state = {"terminated": self.view.state["terminated"]}
        self.view.restart_count += 1
        if delay > 0:
            pod = self.pod.pod["metadata"]
            pod_name = f"{pod['name']}_{pod['namespace']}({pod['uid']})"
            self.view.state = {
                "waiting": {
                    "reason": "CrashLoopBackOff",
                    "message": f"back-off {delay:g}s restarting failed container={self.name} "
                    f"pod={pod_name}",
                }
            }
            self.ctx.events.emit(
                self.pod.pod,
                "BackOff",
                f"Back-off restarting failed container {self.name} in pod {pod_name}",
                warning=True,
                container=self.name,
            )
            self.pod.changed()
            await self.pod.sleep(delay)

    # -- probes -----------------------------------------------------------------------------------
    async def _probe_all(self) -> None:
        startup = podspec.probe(self.spec.get("startupProbe"))
        liveness = podspec.probe(self.spec.get("livenessProbe"))
        readiness = podspec.probe(self.spec.get("readinessProbe"))
        if not self.view.started:
            if startup is not None and not await self._probe_loop(startup, "Startup"):
                return
            self.view.started = True
            if readiness is None:
                self.view.ready = True
            self.pod.changed()
        loops = [
            self._probe_loop(p, kind)
            for p, kind in ((liveness, "Liveness"), (readiness, "Readiness"))
            if p
        ]
        await asyncio.gather(*loops)

    async def _probe_loop(self, probe: podspec.Probe, kind: str) -> bool:
        """Probe until startup succeeds (True), or until the container is killed (False)."""
        loop = asyncio.get_running_loop()
        wait = probe.initial_delay - (loop.time() - self._started_monotonic)
        if wait > 0:
            await asyncio.sleep(wait)
        successes = failures = 0
        while True:
            if self.pod.terminating.is_set() and kind != "Startup":
                return False
            result = await self._attempt(probe)
            if result.ok:
                successes, failures = successes + 1, 0
                if kind == "Startup":
                    return True
                if (
                    kind == "Readiness"
                    and successes >= probe.success_threshold
                    and not self.view.ready
                ):
                    self.view.ready = True
                    self.pod.changed()
            else:
                successes, failures = 0, failures + 1
                self.ctx.events.emit(
                    self.pod.pod,
                    "Unhealthy",
                    f"{kind} probe failed: {result.message}",
                    warning=True,
                    container=self.name,
                )
                if kind == "Readiness" and failures >= probe.failure_threshold and self.view.ready:
                    self.view.ready = False
                    self.pod.changed()
                if kind != "Readiness" and failures >= probe.failure_threshold:
                    message = (
                        f"Container {self.name} failed {kind.lower()} probe, will be restarted"
                    )
                    self._kill = asyncio.create_task(
                        self._stop_for_restart(message, probe.termination_grace)
                    )
                    return False
            await asyncio.sleep(probe.period)

    async def _attempt(self, probe: podspec.Probe) -> probes.Result:
        assert self.target is not None
        port: int | None = None
        try:
            if probe.action in ("httpGet", "tcpSocket"):
                port = podspec.container_port(self.spec, probe.handler.get("port", 0))
        except ValueError as err:
            return probes.Result(False, str(err))
        return await probes.run_handler(
            self.ctx.http, self.target, probe.action, probe.handler, port, probe.timeout
        )

    # -- stopping ---------------------------------------------------------------------------------
    async def _stop_for_restart(self, message: str, grace: int | None = None) -> None:
        await self._terminate(
            float(grace if grace is not None else podspec.grace_seconds(self.pod.pod)), message
        )

    async def stop(self, grace: float) -> None:
        """Stop for good (the pod is being deleted)."""
        if self._kill is not None and not self._kill.done():
            await self._kill  # a probe kill already runs the whole sequence
        if self._stopping is None:
            self._stopping = asyncio.create_task(
                self._terminate(grace, f"Stopping container {self.name}")
            )
        await self._stopping

    async def _terminate(self, grace: float, message: str) -> None:
        """preStop hook, then the stop signal, then SIGKILL once the grace period is over."""
        process = self.process
        if process is None:
            return
        self.ctx.events.emit(self.pod.pod, "Killing", message, container=self.name)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        exited = process.wait()
        hook = (self.spec.get("lifecycle") or {}).get("preStop")
        if hook and self.target is not None:
            kind = next(k for k in ("exec", "httpGet", "tcpSocket", "sleep") if k in hook)
            port = None
            if kind in ("httpGet", "tcpSocket"):
                port = podspec.container_port(self.spec, hook[kind].get("port", 0))
            attempt = asyncio.create_task(
                probes.run_handler(self.ctx.http, self.target, kind, hook[kind], port, grace)
            )
            racers: list[asyncio.Future[Any]] = [attempt, exited]
            await asyncio.wait(racers, timeout=grace, return_when="FIRST_COMPLETED")
            if attempt.done() and not attempt.result().ok:
                self.ctx.events.emit(
                    self.pod.pod,
                    "FailedPreStopHook",
                    f"PreStopHook failed: {attempt.result().message}",
                    warning=True,
                    container=self.name,
                )
            attempt.cancel()
        if not exited.done():
            process.signal(_stop_signal(self.spec))
            remaining = max(deadline - loop.time(), MIN_STOP_SECONDS)
            await asyncio.wait([exited], timeout=remaining)
        if not exited.done():
            process.signal(signal.SIGKILL)
            process.kill_session()
            await exited


async def _all(tasks: list[asyncio.Task[None]]) -> None:
    await asyncio.gather(*tasks, return_exceptions=True)


def _stop_signal(container: JSON) -> int:
    name = (container.get("lifecycle") or {}).get("stopSignal")
    return int(getattr(signal, name)) if name else int(signal.SIGTERM)


def _read_text(path: Path, limit: int, tail: bool = False) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    data = data[-limit:] if tail else data[:limit]
    return data.decode(errors="replace").strip()


def _read_json(path: Path) -> Any:
    text = _read_text(path, 65536)
    try:
        return json.loads(text) if text else None
    except json.JSONDecodeError:
        return None
