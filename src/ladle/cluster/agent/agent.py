"""The node agent process: registers its local Nodes, keeps their Leases, serves the kubelet
endpoint, and runs a ``PodWorker`` for each pod bound to them.

Start-up adopts what a previous agent left: pods it ran that still exist keep their processes,
addresses and restart counts; pods deleted meanwhile have their processes stopped; any process
carrying this cluster's marker that no record explains is killed. SIGTERM stops the agent and
leaves the containers running (as stopping a kubelet does); ``ladle cluster down`` ends them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp
import psutil

from ladle import logs
from ladle.cluster.agent import podnet
from ladle.cluster.agent.allocators import AddressAllocator, GpuAllocator
from ladle.cluster.agent.config import AgentConfig
from ladle.cluster.agent.containers import ContainerRecord, kill_session, marked_processes
from ladle.cluster.agent.events import EventRecorder
from ladle.cluster.agent.kube import JSON, TRANSIENT, Kube, WatchExpired
from ladle.cluster.agent.node import NodeHeartbeat, capacity
from ladle.cluster.agent.pods import NodeContext, PodRecord, PodWorker, Pulls
from ladle.cluster.agent.server import KubeletServer, server_context
from ladle.logs import Recurring

log = logging.getLogger("ladle.node_agent")


class AgentError(RuntimeError):
    """The agent cannot run on this machine; the message says what to fix."""


def check_sandbox(state_dir: Path) -> None:
    """Run one empty container: fails with a clear message where mount namespaces are denied."""
    if os.geteuid() != 0:
        raise AgentError(
            "the ladle node agent must run as root: it gives every container a private mount "
            "namespace (unshare) and binds its volumes"
        )
    with tempfile.TemporaryDirectory(dir=state_dir, prefix="check-") as tmp:
        folder = Path(tmp)
        for name in ("root", "scratch"):
            (folder / name).mkdir()
        spec = {
            "root": str(folder / "root"),
            "scratch": str(folder / "scratch"),
            "hostname": "check",
            "uid": 0,
            "gid": 0,
            "mounts": [{"source": str(folder), "target": "/ladle-check", "read_only": True}],
            "read_only_root": True,
            "argv": ["test", "-d", "/ladle-check/root"],
            "env": {"PATH": "/usr/bin:/bin"},
            "error_file": str(folder / "error"),
            "capabilities": [],
        }
        (folder / "spec.json").write_text(json.dumps(spec))
        proc = subprocess.run(
            [sys.executable, "-m", "ladle.cluster.agent.sandbox", str(folder / "spec.json")],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if proc.returncode != 0:
            raise AgentError(
                "this machine does not let the node agent build a container (a private mount "
                f"namespace with bind mounts): {(proc.stderr or proc.stdout).strip()}"
            )


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.state_dir = Path(config.state_dir)
        self.stop = asyncio.Event()
        self.ready = False
        self.contexts: list[NodeContext] = []
        self._tasks: list[asyncio.Task[None]] = []

    def find(self, namespace: str, name: str) -> PodWorker | None:
        for ctx in self.contexts:
            for worker in ctx.workers.values():
                meta = worker.pod["metadata"]
                if meta.get("namespace") == namespace and meta["name"] == name:
                    return worker
        return None

    async def run(self) -> int:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "pods").mkdir(exist_ok=True)
        check_sandbox(self.state_dir)
        shim = podnet.build()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop.set)
        cfg = self.config
        kube = Kube(cfg.server, cfg.ca_file, cfg.cert_file, cfg.key_file)
        http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0))
        server = KubeletServer(self.find, lambda: self.ready)
        try:
            version = str((await kube.get("/version"))["gitVersion"])
            pulls = Pulls()
            for node in cfg.nodes:
                heartbeat = NodeHeartbeat(kube, node, cfg.kubelet_port, version, self.state_dir)
                await heartbeat.register()
                self._tasks.append(asyncio.create_task(heartbeat.run()))
                disk = shutil.disk_usage(self.state_dir).total
                self.contexts.append(
                    NodeContext(
                        config=cfg,
                        node=node,
                        kube=kube,
                        events=EventRecorder(kube, node.name),
                        ips=AddressAllocator(node.pod_cidr),
                        gpus=GpuAllocator(node.gpus),
                        shim=shim,
                        http=http,
                        pulls=pulls,
                        allocatable=capacity(node, disk),
                    )
                )
            context = server_context(
                cfg.serving_cert_file, cfg.serving_key_file, cfg.client_ca_file
            )
            await server.start([n.ip for n in cfg.nodes], cfg.kubelet_port, context)
            synced = [asyncio.Event() for _ in self.contexts]
            for ctx, event in zip(self.contexts, synced, strict=True):
                self._tasks.append(asyncio.create_task(self._reflect(ctx, kube, event)))
            await asyncio.gather(*(e.wait() for e in synced))
            self._sweep_orphans()
            self.ready = True
            log.info("node agent ready", extra={"nodes": [n.name for n in cfg.nodes]})
            await self.stop.wait()
        finally:
            await self._shutdown()
            await server.stop()
            await http.close()
            await kube.close()
        log.info("node agent stopped; containers keep running")
        return 0

    async def _shutdown(self) -> None:
        """Stop watching and heartbeating, leave every container process as it is."""
        workers = [w for ctx in self.contexts for w in ctx.workers.values()]
        tasks = [*self._tasks, *(w.task for w in workers if w.task)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for worker in workers:
            for supervisor in worker.all_supervisors():
                if supervisor.process is not None:
                    supervisor.process.detach()
        for ctx in self.contexts:
            await ctx.events.flush()

    async def _reflect(self, ctx: NodeContext, kube: Kube, synced: asyncio.Event) -> None:
        """List then watch the node's pods, forever, relisting when the watch expires."""
        path = "/api/v1/pods"
        params = {"fieldSelector": f"spec.nodeName={ctx.node.name}"}
        health = Recurring(
            log,
            "listing or watching pods failed; retrying every second",
            "pods listed and watched again",
            node=ctx.node.name,
        )
        while True:
            try:
                listing = await kube.get(path, params)
            except TRANSIENT as err:
                health.failed(err)
                await asyncio.sleep(1)
                continue
            health.recovered()
            version = listing["metadata"]["resourceVersion"]
            seen = set()
            for pod in listing["items"]:
                seen.add(pod["metadata"]["uid"])
                self._observe(ctx, pod)
            for uid, worker in list(ctx.workers.items()):
                if uid not in seen:
                    worker.vanish()
            if not synced.is_set():
                self._forget_deleted(ctx, seen)
                synced.set()
            while True:
                try:
                    async for kind, obj in kube.watch(path, version, params):
                        health.recovered()
                        version = obj["metadata"]["resourceVersion"]
                        if kind == "DELETED":
                            if (gone := ctx.workers.get(obj["metadata"]["uid"])) is not None:
                                gone.vanish()
                        elif kind in ("ADDED", "MODIFIED"):
                            self._observe(ctx, obj)
                except WatchExpired:
                    break
                except TRANSIENT as err:
                    health.failed(err)
                    await asyncio.sleep(1)

    def _observe(self, ctx: NodeContext, pod: JSON) -> None:
        uid = pod["metadata"]["uid"]
        worker = ctx.workers.get(uid)
        if worker is not None:
            worker.update(pod)
            return
        phase = (pod.get("status") or {}).get("phase")
        known = (ctx.pods_dir / uid / "pod.json").is_file()
        if (
            phase in ("Succeeded", "Failed")
            and not known
            and not pod["metadata"].get("deletionTimestamp")
        ):
            return
        worker = PodWorker(ctx, pod)
        ctx.workers[uid] = worker
        worker.update(pod)
        worker.start()

    def _forget_deleted(self, ctx: NodeContext, existing: set[str]) -> None:
        """Stop the containers of pods that were deleted while no agent ran."""
        for pod_dir in ctx.pods_dir.iterdir() if ctx.pods_dir.is_dir() else []:
            record = PodRecord.load(pod_dir / "pod.json")
            if record is None or record.node != ctx.node.name or record.uid in existing:
                continue
            for path in pod_dir.glob("containers/*/record.json"):
                container = ContainerRecord.load(path)
                if container is not None:
                    _kill_recorded(container)
            log.info("cleaned up a pod deleted while the agent was away", extra={"uid": record.uid})
            for shm in Path("/dev/shm").glob(f"ladle-{self.config.cluster_id}-{record.uid}-*"):
                shutil.rmtree(shm, ignore_errors=True)
            shutil.rmtree(pod_dir, ignore_errors=True)

    def _sweep_orphans(self) -> None:
        """Kill marked processes that belong to no container we know of."""
        sessions = {
            s.process.pid
            for ctx in self.contexts
            for w in ctx.workers.values()
            for s in w.supervisors.values()
            if s.process is not None
        }
        for path in self.state_dir.glob("pods/*/containers/*/record.json"):
            if (record := ContainerRecord.load(path)) is not None:
                sessions.add(record.pid)
        for proc in marked_processes(self.config.cluster_id):
            with contextlib.suppress(OSError, psutil.Error):
                if os.getsid(proc.pid) not in sessions:
                    log.warning("killing an orphaned container process", extra={"pid": proc.pid})
                    proc.kill()


def _kill_recorded(record: ContainerRecord) -> None:
    with contextlib.suppress(psutil.Error):
        proc = psutil.Process(record.pid)
        if abs(proc.create_time() - record.create_time) <= 1.0:
            proc.kill()
            kill_session(record.pid)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m ladle.cluster.agent CONFIG.json", file=sys.stderr)
        return 2
    logs.configure("info")
    try:
        return asyncio.run(Agent(AgentConfig.load(Path(argv[1]))).run())
    except (AgentError, podnet.ShimError) as err:
        print(f"ladle node agent: {err}", file=sys.stderr)
        return 1
