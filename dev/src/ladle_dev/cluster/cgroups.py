"""The cgroup subtree a local node's kubelet is given, made before it starts and removed after.

Several kubelets share this machine, so each gets a ``cgroupRoot`` of its own
(``/ladle/<cluster>/<node>``) under which it makes its QoS and pod cgroups and runc makes the
containers'. Both cgroup v1 hierarchies (this machine's: one per controller) and the unified v2
tree are handled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

MOUNTS = Path("/proc/self/mounts")
CPUS = os.cpu_count() or 1
V2_MARKER = Path("/sys/fs/cgroup/cgroup.controllers")


def hierarchies() -> list[Path]:
    """Where each mounted cgroup hierarchy is: the unified tree alone on a v2 host, else every
    v1 hierarchy (controllers and named ones alike) and, on a hybrid host like this one, the
    controller-less v2 tree beside them, which runc mirrors its cgroups into."""
    if V2_MARKER.is_file():
        return [V2_MARKER.parent]
    found = []
    for line in MOUNTS.read_text().splitlines():
        _, mount_point, fs_type, *_ = line.split()
        if fs_type in ("cgroup", "cgroup2"):
            found.append(Path(mount_point))
    return found


def create(relative: str) -> None:
    """``relative`` (``/a/b``) in every hierarchy. A new v1 cpuset cgroup starts with no CPUs
    and no memory nodes, so each level copies its parent's. Each level weighs, for the CPU, as
    much as the machine's CPUs' worth of busy host threads (at the default, all local pods
    together would weigh as one thread of the host's, and starve under load)."""
    weights = {"cpu.shares": 1024 * CPUS, "cpu.weight": min(100 * CPUS, 10000)}
    for root in hierarchies():
        (root / relative.strip("/")).mkdir(parents=True, exist_ok=True)
        if V2_MARKER.is_file():
            _enable_controllers(root, relative)
        path = root
        for part in relative.strip("/").split("/"):
            parent, path = path, path / part
            for name in ("cpuset.cpus", "cpuset.mems"):
                mine, theirs = path / name, parent / name
                if mine.is_file() and not mine.read_text().strip():
                    mine.write_text(theirs.read_text())
            for name, weight in weights.items():
                if (path / name).is_file():
                    (path / name).write_text(str(weight))


def _enable_controllers(root: Path, relative: str) -> None:
    """On v2, a child can use only the controllers its parent delegates."""
    path = root
    for part in relative.strip("/").split("/"):
        available = (path / "cgroup.controllers").read_text().split()
        with contextlib.suppress(OSError):
            (path / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in available))
        path = path / part


def processes(relative: str) -> set[int]:
    """Every process in ``relative`` or below, in any hierarchy."""
    pids: set[int] = set()
    for root in hierarchies():
        top = root / relative.strip("/")
        if top.is_dir():
            for procs in top.rglob("cgroup.procs"):
                with contextlib.suppress(OSError):
                    pids |= {int(pid) for pid in procs.read_text().split()}
    return pids


def remove(relative: str, timeout: float = 10.0) -> None:
    """Kill whatever still runs in ``relative`` and remove it, deepest cgroups first."""
    deadline = time.monotonic() + timeout
    while pids := processes(relative):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise OSError(f"processes {sorted(pids)} outlived SIGKILL in cgroup {relative}")
        time.sleep(0.1)
    for root in hierarchies():
        top = root / relative.strip("/")
        if not top.is_dir():
            continue
        for path in sorted((p for p in top.rglob("*") if p.is_dir()), key=_depth, reverse=True):
            _rmdir(path, deadline)
        _rmdir(top, deadline)
    # Empty parents (``/ladle/<cluster>``, ``/ladle``) go too, unless another cluster uses them.
    for parent in Path(relative.strip("/")).parents:
        if str(parent) != ".":
            for root in hierarchies():
                with contextlib.suppress(OSError):
                    (root / parent).rmdir()


def _depth(path: Path) -> int:
    return len(path.parts)


def _rmdir(path: Path, deadline: float) -> None:
    """rmdir, retried while the kernel still counts a dying task in it (EBUSY)."""
    while True:
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
