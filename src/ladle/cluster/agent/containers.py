"""Container processes: start one through the sandbox, find one again after an agent restart,
wait for its exit, signal it, and remember enough on disk to do all that again.

A container is the process the sandbox ``execve``d into, in a session of its own; everything it
spawns stays in that session, so stopping a container ends the whole session (a container
runtime tears down the pid namespace the same way). Its stdout and stderr go straight to a log
file, so they keep flowing while the agent restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from ladle.cluster.agent.config import CLUSTER_ENV

JSON = dict[str, Any]


@dataclass
class ContainerRecord:
    """What survives an agent restart about one container (``record.json``)."""

    name: str
    container_id: str
    pid: int
    create_time: float
    restart_count: int
    started_at: str
    image: str
    image_id: str
    gpus: list[int] = field(default_factory=list)
    uid: int = 0
    gid: int = 0
    env: dict[str, str] = field(default_factory=dict)
    last_state: JSON = field(default_factory=dict)
    # The terminated state once this instance has ended (an agent restart must not rerun a
    # finished init container, nor forget an exit it has not acted on yet).
    exited: JSON = field(default_factory=dict)

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> ContainerRecord | None:
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None


def exit_code(status: int) -> int:
    """A wait status as Kubernetes reports it: the exit code, or 128 + the signal number."""
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


class Process:
    """A running container process: our child (its exit code is known) or one adopted after
    an agent restart (it is not our child, so only its end can be seen)."""

    def __init__(self, pid: int, create_time: float, child: bool) -> None:
        self.pid = pid
        self.create_time = create_time
        self.child = child
        self._fd = os.pidfd_open(pid)
        self._exit: asyncio.Future[int | None] | None = None
        self.exec_fd = -1  # see launch()

    @classmethod
    def adopt(cls, pid: int, create_time: float) -> Process | None:
        """The recorded process if it is still that process (a reused pid is not)."""
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - create_time) > 1.0 or proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return cls(pid, create_time, child=False)
        except (psutil.Error, OSError):
            return None

    def wait(self) -> asyncio.Future[int | None]:
        """Resolves with the exit code (None when unknown) once the process has ended."""
        if self._exit is None:
            loop = asyncio.get_running_loop()
            self._exit = loop.create_future()
            loop.add_reader(self._fd, self._reap)
        return self._exit

    def _reap(self) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._fd)
        code: int | None = None
        if self.child:
            with contextlib.suppress(ChildProcessError):
                _, status = os.waitpid(self.pid, 0)
                code = exit_code(status)
        os.close(self._fd)
        self._fd = -1
        assert self._exit is not None
        if not self._exit.done():
            self._exit.set_result(code)

    async def executed(self) -> None:
        """Returns once the sandbox has exec'd the command (or died trying)."""
        if self.exec_fd < 0:
            return
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            if not os.read(self.exec_fd, 64) and not done.done():
                done.set_result(None)

        loop.add_reader(self.exec_fd, readable)
        try:
            await done
        finally:
            loop.remove_reader(self.exec_fd)
            os.close(self.exec_fd)
            self.exec_fd = -1

    def signal(self, sig: int) -> None:
        if self._fd >= 0:
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(self._fd, sig)

    def kill_session(self) -> None:
        """SIGKILL every process left in the container's session (the pid is its id)."""
        kill_session(self.pid)

    def detach(self) -> None:
        """Stop watching without touching the process (the agent is stopping)."""
        if self._fd >= 0:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1


def kill_session(sid: int) -> None:
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getsid(proc.pid) == sid:
                proc.kill()
        except (OSError, psutil.Error):
            continue


def launch(spec: JSON, spec_path: Path, log_path: Path) -> Process:
    """Start the sandbox on ``spec``; it becomes the container's command.

    The sandbox holds the write end of a pipe until its ``execve`` closes it (close-on-exec),
    so ``Process.executed`` tells when the container is really built: probing earlier would
    enter a half-built container (the host's mounts, the host's root)."""
    read_fd, write_fd = os.pipe()
    spec_path.write_text(json.dumps({**spec, "exec_fd": write_fd}))
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "PYTHONPATH")}
    try:
        with log_path.open("ab") as log:
            popen = subprocess.Popen(
                [sys.executable, "-m", "ladle.cluster.agent.sandbox", str(spec_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
                cwd="/",
                start_new_session=True,
                pass_fds=(write_fd,),
            )
    finally:
        os.close(write_fd)
    # We reap it ourselves through its pidfd; Popen must not try again later.
    popen.returncode = 0
    process = Process(popen.pid, psutil.Process(popen.pid).create_time(), child=True)
    process.exec_fd = read_fd
    return process


def marked_processes(cluster_id: str) -> list[psutil.Process]:
    """Every process carrying this cluster's container marker in its environment."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get(CLUSTER_ENV) == cluster_id:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def recorded_sessions(state_dir: Path) -> set[int]:
    """Session ids of the containers an agent recorded under ``state_dir``: a recorded pid whose
    number now belongs to another process is left out."""
    sessions = set()
    for path in state_dir.glob("pods/*/containers/*/record.json"):
        record = ContainerRecord.load(path)
        if record is None:
            continue
        try:
            if abs(psutil.Process(record.pid).create_time() - record.create_time) > 1.0:
                continue
        except psutil.NoSuchProcess:
            pass  # the leader is gone; what is left of its session is still ours
        except psutil.Error:
            continue
        sessions.add(record.pid)
    return sessions


def stop_all(cluster_id: str, state_dir: Path, grace: float = 10.0) -> int:
    """End every container of a cluster: SIGTERM, ``grace`` seconds, then SIGKILL, including
    everything in their sessions. For ``ladle cluster down``; returns how many processes."""
    sessions = recorded_sessions(state_dir)
    targets = {p.pid: p for p in marked_processes(cluster_id)}
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getsid(proc.pid) in sessions:
                targets[proc.pid] = proc
        except (OSError, psutil.Error):
            continue
    procs = list(targets.values())
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=grace)
    # Memory-backed emptyDirs live outside the state folder.
    for folder in Path("/dev/shm").glob(f"ladle-{cluster_id}-*"):
        shutil.rmtree(folder, ignore_errors=True)
    return len(procs)
