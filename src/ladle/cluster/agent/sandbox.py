"""The first program of every container process: it builds the container's view of the machine
and then becomes the container's command (``execve``), so the pid the agent started is the
container's own process.

``python -m ladle.cluster.agent.sandbox SPEC.json`` runs as root and, in order:

1. enters a private mount namespace and a UTS namespace (the hostname is the pod's name);
2. binds the host's ``/`` recursively onto the container's root folder;
3. makes the folders on the way to the interpreter traversable for the container's user, where
   the host's are not (``/root`` is 0700 here, and an image would have its Python
   world-readable): such a folder is replaced, in this namespace only, by a tmpfs holding bind
   mounts of all its entries;
4. creates every mount point the same way, so that ``/models`` or ``/etc/ladle/config``
   appear without one byte written to the host's filesystem;
5. makes the root read-only (``readOnlyRootFilesystem``), keeping ``/dev`` and ``/proc``
   writable as container runtimes do;
6. binds the volumes (read-only where asked), ``chroot``s, switches user, group and
   supplementary groups, sets ``no_new_privs``, drops capabilities from the bounding set, and
   ``execve``s the command, searched on the container's ``PATH``.

A failure before ``execve`` is written to the spec's ``error_file`` as JSON (reason, message)
and the process exits 128, which the agent reports as ``StartError``, like containerd.
Only the standard library: this runs once per container start.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
MS_BIND = 0x1000
MS_MOVE = 0x2000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
AT_FDCWD = -100
AT_RECURSIVE = 0x8000
MOUNT_ATTR_RDONLY = 0x1
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (a post-2019 syscall)
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
START_ERROR_EXIT = 128

# What a container gets without capabilities.add/drop: containerd's and Docker's default set.
DEFAULT_CAPABILITIES = frozenset(
    {
        "CHOWN",
        "DAC_OVERRIDE",
        "FSETID",
        "FOWNER",
        "MKNOD",
        "NET_RAW",
        "SETGID",
        "SETUID",
        "SETFCAP",
        "SETPCAP",
        "NET_BIND_SERVICE",
        "SYS_CHROOT",
        "KILL",
        "AUDIT_WRITE",
    }
)
CAPABILITY_NUMBERS = {
    "CHOWN": 0,
    "DAC_OVERRIDE": 1,
    "DAC_READ_SEARCH": 2,
    "FOWNER": 3,
    "FSETID": 4,
    "KILL": 5,
    "SETGID": 6,
    "SETUID": 7,
    "SETPCAP": 8,
    "LINUX_IMMUTABLE": 9,
    "NET_BIND_SERVICE": 10,
    "NET_BROADCAST": 11,
    "NET_ADMIN": 12,
    "NET_RAW": 13,
    "IPC_LOCK": 14,
    "IPC_OWNER": 15,
    "SYS_MODULE": 16,
    "SYS_RAWIO": 17,
    "SYS_CHROOT": 18,
    "SYS_PTRACE": 19,
    "SYS_PACCT": 20,
    "SYS_ADMIN": 21,
    "SYS_BOOT": 22,
    "SYS_NICE": 23,
    "SYS_RESOURCE": 24,
    "SYS_TIME": 25,
    "SYS_TTY_CONFIG": 26,
    "MKNOD": 27,
    "LEASE": 28,
    "AUDIT_WRITE": 29,
    "AUDIT_CONTROL": 30,
    "SETFCAP": 31,
    "MAC_OVERRIDE": 32,
    "MAC_ADMIN": 33,
    "SYSLOG": 34,
    "WAKE_ALARM": 35,
    "BLOCK_SUSPEND": 36,
    "AUDIT_READ": 37,
    "PERFMON": 38,
    "BPF": 39,
    "CHECKPOINT_RESTORE": 40,
}

_libc = ctypes.CDLL(None, use_errno=True)


class SandboxError(Exception):
    """Why the container could not be started; ``reason`` becomes the status reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class _MountAttr(ctypes.Structure):
    _fields_ = (
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    )


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    _check(
        _libc.mount(
            None if source is None else source.encode(),
            target.encode(),
            None if fstype is None else fstype.encode(),
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {source} on {target}",
    )


def set_readonly(path: str, readonly: bool) -> None:
    """Set or clear the read-only flag on ``path`` and every mount below it, in one call."""
    attr = _MountAttr(
        attr_set=MOUNT_ATTR_RDONLY if readonly else 0,
        attr_clr=0 if readonly else MOUNT_ATTR_RDONLY,
    )
    _check(
        _libc.syscall(
            SYS_MOUNT_SETATTR,
            AT_FDCWD,
            path.encode(),
            AT_RECURSIVE,
            ctypes.byref(attr),
            ctypes.sizeof(attr),
        ),
        f"mount_setattr {path}",
    )


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


class RootBuilder:
    """The container's root: the host's tree, bound under ``root``, grown without host writes."""

    def __init__(self, root: Path, scratch: Path) -> None:
        self.root = root
        self.scratch = scratch
        self._scratch_count = 0
        self._owned_devices: set[int] = set()  # tmpfs shadows we made: free to write in
        self._volumes: list[tuple[str, int]] = []  # (host path of a bound volume, its st_dev)

    def start(self) -> None:
        mount(None, "/", None, MS_REC | MS_PRIVATE)
        mount("/", str(self.root), None, MS_BIND | MS_REC)
        mount("tmpfs", str(self.scratch), "tmpfs", 0, "mode=0700")

    # -- paths inside the root -----------------------------------------------------------------
    def resolve(self, path: str) -> Path:
        """``path`` as seen inside the root, with symlinks resolved against the root
        (``/var/run`` → ``/run`` must land in the root, not on the host)."""
        parts = [p for p in path.split("/") if p]
        resolved: list[str] = []
        hops = 0
        while parts:
            name = parts.pop(0)
            if name == ".":
                continue
            if name == "..":
                if resolved:
                    resolved.pop()
                continue
            candidate = self.root.joinpath(*resolved, name)
            if candidate.is_symlink():
                hops += 1
                if hops > 40:
                    raise OSError(errno.ELOOP, f"too many symlinks in {path}")
                target = os.readlink(candidate)
                if target.startswith("/"):
                    resolved = []
                parts = [p for p in target.split("/") if p] + parts
                continue
            resolved.append(name)
        return self.root.joinpath(*resolved)

    def _writable_here(self, folder: Path) -> bool:
        """May we create entries in ``folder`` (a path under the root) without touching the host?"""
        dev = folder.stat().st_dev
        if dev in self._owned_devices:
            return True
        return any(
            dev == vol_dev and (folder == Path(vol) or Path(vol) in folder.parents)
            for vol, vol_dev in self._volumes
        )

    def _new_tmpfs(self, mode: int, uid: int, gid: int) -> Path:
        self._scratch_count += 1
        target = self.scratch / str(self._scratch_count)
        target.mkdir()
        mount("tmpfs", str(target), "tmpfs", 0, f"mode={mode:o},uid={uid},gid={gid}")
        self._owned_devices.add(target.stat().st_dev)
        return target

    def shadow(self, folder: Path, extra_mode: int = 0) -> None:
        """Replace ``folder`` (under the root) by a tmpfs that binds each of its entries, so new
        entries can be made in it, or its own mode widened, in this namespace alone."""
        info = folder.stat()
        if info.st_dev in self._owned_devices and not extra_mode:
            return
        tmp = self._new_tmpfs(stat.S_IMODE(info.st_mode) | extra_mode, info.st_uid, info.st_gid)
        for entry in os.scandir(folder):
            dest = tmp / entry.name
            if entry.is_symlink():
                os.symlink(os.readlink(entry.path), dest)
            elif entry.is_dir(follow_symlinks=False):
                dest.mkdir()
                mount(entry.path, str(dest), None, MS_BIND | MS_REC)
            else:
                dest.touch()
                mount(entry.path, str(dest), None, MS_BIND | MS_REC)
        mount(str(tmp), str(folder), None, MS_MOVE)

    def ensure(self, path: str, directory: bool) -> Path:
        """Make ``path`` exist inside the root (a folder or an empty file) and return it."""
        target = self.resolve(path)
        if target.exists():
            return target
        missing: list[str] = []
        parent = target
        while not parent.exists():
            missing.insert(0, parent.name)
            parent = parent.parent
        if not self._writable_here(parent):
            self.shadow(parent)
        current = parent
        for index, name in enumerate(missing):
            current = current / name
            if index < len(missing) - 1 or directory:
                current.mkdir(mode=0o755)
            else:
                current.touch(mode=0o644)
        return target

    def make_traversable(self, host_path: str, uid: int, gids: set[int]) -> None:
        """Widen every folder on the way to ``host_path`` that ``uid`` could not pass."""
        current = Path("/")
        for name in Path(host_path).parts[1:]:
            current = current / name
            inside = self.resolve(str(current))
            if not inside.is_dir():
                return
            info = inside.stat()
            if uid == info.st_uid:
                ok = info.st_mode & stat.S_IXUSR
            elif info.st_gid in gids:
                ok = info.st_mode & stat.S_IXGRP
            else:
                ok = info.st_mode & stat.S_IXOTH
            if not ok:
                self.shadow(inside, extra_mode=stat.S_IXOTH | stat.S_IXGRP)

    def bind(self, source: str, target: str, readonly: bool) -> None:
        directory = Path(source).is_dir()
        inside = self.ensure(target, directory)
        mount(source, str(inside), None, MS_BIND | MS_REC)
        if readonly:
            set_readonly(str(inside), True)
        elif directory:
            self._volumes.append((str(inside), inside.stat().st_dev))


def _drop_capabilities(keep: set[str]) -> None:
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    kept = {CAPABILITY_NUMBERS[name] for name in keep}
    for number in range(last + 1):
        if number not in kept:
            _check(_libc.prctl(PR_CAPBSET_DROP, number, 0, 0, 0), f"drop capability {number}")


def capabilities(security: dict[str, Any], privileged: bool) -> set[str]:
    """The capability names a container keeps, from its securityContext."""
    if privileged:
        return set(CAPABILITY_NUMBERS)
    caps = security.get("capabilities") or {}
    drops = {c.upper().removeprefix("CAP_") for c in caps.get("drop") or []}
    adds = {c.upper().removeprefix("CAP_") for c in caps.get("add") or []}
    keep = set(DEFAULT_CAPABILITIES) if "ALL" not in drops else set()
    keep -= drops
    keep |= set(CAPABILITY_NUMBERS) if "ALL" in adds else adds
    return keep


def run(spec: dict[str, Any]) -> None:
    """Build the container and ``execve`` its command; returns only by raising."""
    root = Path(spec["root"])
    builder = RootBuilder(root, Path(spec["scratch"]))
    try:
        unshare(CLONE_NEWNS | CLONE_NEWUTS)
        _check(_libc.sethostname(spec["hostname"].encode(), len(spec["hostname"])), "sethostname")
        builder.start()
        uid, gid = int(spec["uid"]), int(spec["gid"])
        groups = [int(g) for g in spec.get("groups", [])]
        if uid != 0:
            for path in spec.get("reachable", []):
                builder.make_traversable(path, uid, {gid, *groups})
        mounts = sorted(spec["mounts"], key=lambda m: len(Path(m["target"]).parts))
        for item in mounts:
            builder.ensure(item["target"], Path(item["source"]).is_dir())
        # A missing working directory is created, as runc does: before the root turns
        # read-only, unless a volume holds it (then in the volume, once it is bound).
        workdir = Path(spec.get("workdir") or "/")
        targets = [Path(m["target"]) for m in mounts]
        if not any(t == workdir or t in workdir.parents for t in targets):
            builder.ensure(str(workdir), True)
        if spec.get("read_only_root"):
            set_readonly(str(root), True)
            for writable in ("/dev", "/proc"):
                set_readonly(str(builder.resolve(writable)), False)
        for item in mounts:
            builder.bind(item["source"], item["target"], bool(item.get("read_only")))
        builder.ensure(str(workdir), True)
    except OSError as err:
        raise SandboxError("CreateContainerError", f"preparing the container: {err}") from err
    os.chroot(root)
    try:
        os.chdir(workdir)
    except OSError as err:
        raise SandboxError("StartError", f"working directory {workdir}: {err.strerror}") from err
    keep = set(spec.get("capabilities", []))
    _drop_capabilities(keep)
    os.setgroups(groups)
    os.setgid(gid)
    os.setuid(uid)
    if spec.get("no_new_privs"):
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    argv = spec["argv"]
    try:
        os.execvpe(argv[0], argv, spec["env"])
    except OSError as err:
        if err.errno in (errno.ENOENT, errno.ENOTDIR):
            message = f'exec: "{argv[0]}": executable file not found in $PATH'
        else:
            message = f'exec: "{argv[0]}": {err.strerror}'
        raise SandboxError("StartError", message) from err


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    if "exec_fd" in spec:
        os.set_inheritable(spec["exec_fd"], False)  # closed by execve: the agent sees EOF
    # Opened now: after chroot and setuid the path may be read-only or out of reach. The
    # descriptor is close-on-exec, so the command never sees it.
    error_fd = os.open(spec["error_file"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        run(spec)
    except SandboxError as err:
        os.write(error_fd, json.dumps({"reason": err.reason, "message": err.message}).encode())
        print(f"ladle node agent: {err.message}", file=sys.stderr, flush=True)
    return START_ERROR_EXIT


if __name__ == "__main__":
    sys.exit(main(sys.argv))
