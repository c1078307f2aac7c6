"""Build the pinned Kubernetes components from Go modules and cache them by version.

There is no Docker and no binary download on our machines, so kind, k3d and setup-envtest are
out; the wrapper modules in ``hack/k8s/`` pin every component and ``go build`` does the rest.
The cache folder is keyed by a hash of those modules, so a version bump builds afresh and an
unchanged pin reuses the binaries.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ladle.words import plural

# Bump when the way binaries are built changes (flags, layout), so old caches are not reused.
RECIPE = "1"

REPO_ROOT = Path(__file__).resolve().parents[4]
HACK_DIR = REPO_ROOT / "hack" / "k8s"

# kwok has had no built-in stages since v0.8; these come from the module's kustomize/stage/.
KWOK_STAGES = (
    "node/fast/node-initialize.yaml",
    "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "pod/fast/pod-ready.yaml",
    "pod/fast/pod-complete.yaml",
    "pod/fast/pod-delete.yaml",
)


@dataclass(frozen=True)
class Tool:
    """One binary: which wrapper module builds it and which ``-X`` flags make it truthful."""

    name: str
    module_dir: str
    package: str
    version_module: str
    xflags: tuple[str, ...] = field(default=())
    tags: tuple[str, ...] = field(default=())
    # runc's nsenter is C, and seccomp needs libseccomp: the one binary built with cgo.
    cgo: bool = False


def _kube_xflags() -> tuple[str, ...]:
    # Without these, every component reports v0.0.0-master. Values are filled in per build.
    names = ("gitVersion", "gitMajor", "gitMinor", "gitTreeState", "buildDate")
    pkgs = ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
    return tuple(f"{pkg}.{name}" for pkg in pkgs for name in names)


TOOLS = (
    *(
        Tool(
            name, "kubernetes", f"k8s.io/kubernetes/cmd/{name}", "k8s.io/kubernetes", _kube_xflags()
        )
        for name in (
            "kube-apiserver",
            "kube-controller-manager",
            "kube-scheduler",
            "kubectl",
            "kubelet",
            "kube-proxy",
        )
    ),
    *(
        Tool(
            name,
            "containerd",
            f"github.com/containerd/containerd/v2/cmd/{name}",
            "github.com/containerd/containerd/v2",
            ("github.com/containerd/containerd/v2/version.Version",),
        )
        for name in ("containerd", "containerd-shim-runc-v2", "ctr")
    ),
    Tool(
        "runc",
        "runc",
        "github.com/opencontainers/runc",
        "github.com/opencontainers/runc",
        ("main.version",),
        ("seccomp",),
        cgo=True,
    ),
    # Ladle's own fake NVIDIA device plugin for the local nodes' kubelets.
    Tool("gpu-plugin", "gpu-plugin", "ladle.local/hack/k8s/gpu-plugin", "k8s.io/kubelet"),
    Tool(
        "crictl",
        "cri-tools",
        "sigs.k8s.io/cri-tools/cmd/crictl",
        "sigs.k8s.io/cri-tools",
        ("sigs.k8s.io/cri-tools/pkg/version.Version",),
    ),
    Tool("etcd", "etcd", "go.etcd.io/etcd/server/v3", "go.etcd.io/etcd/server/v3"),
    Tool("kwok", "kwok", "sigs.k8s.io/kwok/cmd/kwok", "sigs.k8s.io/kwok"),
    Tool(
        "helm",
        "helm",
        "helm.sh/helm/v3/cmd/helm",
        "helm.sh/helm/v3",
        ("helm.sh/helm/v3/internal/version.version",),
    ),
)


class BuildError(RuntimeError):
    """The toolchain is missing or a ``go`` command failed; the message carries its output."""


def cache_root() -> Path:
    """``$LADLE_CACHE_DIR``, else ``$XDG_CACHE_HOME/ladle``, else ``~/.cache/ladle``."""
    if env := os.environ.get("LADLE_CACHE_DIR"):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "ladle"


def versions_hash(tools: Sequence[Tool] = TOOLS, recipe: str = RECIPE) -> str:
    """Hash of every wrapper go.mod/go.sum plus the recipe and platform: the cache key."""
    digest = hashlib.sha256(f"{recipe} {sys.platform} {platform.machine()}".encode())
    for module_dir in sorted({tool.module_dir for tool in tools}):
        for name in ("go.mod", "go.sum"):
            path = HACK_DIR / module_dir / name
            if not path.is_file():
                raise BuildError(f"{path} is missing; is this a Ladle checkout?")
            digest.update(f"{module_dir}/{name}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def build_dir() -> Path:
    """The versioned cache folder; ``bin/`` and ``stages/`` live inside it."""
    return cache_root() / "k8s" / versions_hash()


def bin_dir() -> Path:
    return build_dir() / "bin"


def stages_dir() -> Path:
    return build_dir() / "stages"


def missing() -> list[str]:
    """Names of binaries (and ``stages``) that a build would still have to produce."""
    names = [tool.name for tool in TOOLS if not (bin_dir() / tool.name).is_file()]
    if not all((stages_dir() / Path(stage).name).is_file() for stage in KWOK_STAGES):
        names.append("stages")
    return names


def binary(name: str) -> Path:
    """Path of a built binary; raises if it has not been built yet."""
    path = bin_dir() / name
    if not path.is_file():
        raise BuildError(f"{path} is missing; run `ladle cluster build` first")
    return path


def find_go() -> str:
    go = shutil.which("go") or "/usr/local/go/bin/go"
    if not Path(go).is_file():
        raise BuildError("no Go toolchain: put `go` (1.26+) on PATH or in /usr/local/go/bin")
    return go


def _go_env(cgo: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        CGO_ENABLED="1" if cgo else "0",
        # Never fetch a different toolchain behind our back; use the one we were given.
        GOTOOLCHAIN="local",
        GOFLAGS="-mod=readonly -buildvcs=false",
    )
    return env


def _nice() -> list[str]:
    # The build is background work on a shared 2-core machine; keep tests and editors responsive.
    nice = shutil.which("nice")
    return [nice, "-n", "10"] if nice else []


def _go_json(go: str, module_dir: str, *args: str) -> dict[str, object]:
    proc = subprocess.run(
        [go, *args],
        cwd=HACK_DIR / module_dir,
        env=_go_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise BuildError(f"go {' '.join(args)} failed in {module_dir}:\n{proc.stderr}")
    result: dict[str, object] = json.loads(proc.stdout)
    return result


def module_info(go: str, module_dir: str, module: str) -> tuple[str, str, Path]:
    """Version, release time and source folder of ``module`` as resolved by the wrapper."""
    info = _go_json(go, module_dir, "list", "-m", "-json", module)
    if "Dir" not in info:
        _go_json(go, module_dir, "mod", "download", "-json", module)
        info = _go_json(go, module_dir, "list", "-m", "-json", module)
    return str(info["Version"]), str(info.get("Time", "")), Path(str(info["Dir"]))


def _xvalue(flag: str, version: str, released: str) -> str:
    name = flag.rsplit(".", 1)[1]
    major, minor = version.lstrip("v").split(".")[:2]
    return {
        "gitVersion": version,
        "gitMajor": major,
        "gitMinor": minor,
        "gitTreeState": "clean",
        "buildDate": released,
        "version": version,
        # github.com/prometheus/common/version
        "Version": version,
        "BuildDate": released,
    }[name]


def _log(message: str) -> None:
    print(message, flush=True)


def _run_build(cmd: list[str], cwd: Path, label: str, cgo: bool = False) -> None:
    """Run ``go build -v`` and report how many packages it has compiled every 30 s."""
    tail: deque[str] = deque(maxlen=60)
    count = 0
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=_go_env(cgo),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    done = threading.Event()

    def heartbeat() -> None:
        while not done.wait(30):
            packages = plural(count, "package")
            _log(f"      {label}: {packages} compiled, {time.monotonic() - start:.0f}s")

    ticker = threading.Thread(target=heartbeat, daemon=True)
    ticker.start()
    assert proc.stdout is not None
    for line in proc.stdout:
        tail.append(line.rstrip())
        count += 1
    rc = proc.wait()
    done.set()
    ticker.join()
    if rc != 0:
        raise BuildError(f"building {label} failed (exit {rc}):\n" + "\n".join(tail))


def build(force: bool = False) -> Path:
    """Build whatever is missing from the versioned cache and return its ``bin/`` folder.

    Each binary is written under a temporary name and renamed, so an interrupted build resumes
    where it stopped and never leaves a truncated binary that looks complete.
    """
    target = bin_dir()
    todo = [tool.name for tool in TOOLS] + ["stages"] if force else missing()
    if not todo:
        _log(f"cluster binaries up to date in {target}")
        return target
    total_start = time.monotonic()
    build_tools([tool for tool in TOOLS if tool.name in todo], target, len(todo))
    if "stages" in todo:
        _copy_stages(find_go())
        _log(f"[{len(todo)}/{len(todo)}] kwok stages copied to {stages_dir()}")
    _log(f"done in {time.monotonic() - total_start:.0f}s: {target}")
    prune(build_dir())
    return target


@dataclass(frozen=True)
class ToolSet:
    """Binaries that tests run beside the cluster, built with the cluster's recipe but cached
    under a key of their own: pinning one set anew never rebuilds another, or Kubernetes."""

    folder: str
    tools: tuple[Tool, ...]
    recipe: str = "1"

    def bin_dir(self) -> Path:
        return cache_root() / self.folder / versions_hash(self.tools, self.recipe) / "bin"

    def missing(self) -> list[str]:
        return [tool.name for tool in self.tools if not (self.bin_dir() / tool.name).is_file()]

    def build_missing(self, force: bool = False) -> Path:
        """Build whatever is missing (everything with ``force``); returns the ``bin/`` folder."""
        target = self.bin_dir()
        todo = [tool for tool in self.tools if force or tool.name in self.missing()]
        if not todo:
            names = ", ".join(tool.name for tool in self.tools)
            _log(f"{names} up to date in {target}")
            return target
        build_tools(todo, target)
        prune(target.parent)
        return target


def prune(current: Path) -> None:
    """Remove the binaries of other pins beside ``current`` (about 800 MB each): a bumped pin
    would otherwise leave every earlier build in the cache for good."""
    for sibling in current.parent.iterdir():
        if sibling != current and sibling.is_dir() and not sibling.name.startswith("."):
            shutil.rmtree(sibling, ignore_errors=True)


def build_tools(tools: Sequence[Tool], target: Path, steps: int | None = None) -> None:
    """Build ``tools`` into ``target``, with progress; ``steps`` counts extra steps to come."""
    go = find_go()
    target.mkdir(parents=True, exist_ok=True)
    total = steps or len(tools)
    names = ", ".join(tool.name for tool in tools)
    _log(f"building {names} into {target} ({total} steps)")
    downloaded: set[str] = set()
    for index, tool in enumerate(tools, 1):
        if tool.cgo:
            _check_cgo(tool)
        if tool.module_dir not in downloaded:
            t0 = time.monotonic()
            _log(f"[{index}/{total}] downloading modules for hack/k8s/{tool.module_dir}")
            _download(go, tool.module_dir)
            downloaded.add(tool.module_dir)
            _log(f"      modules ready in {time.monotonic() - t0:.0f}s")
        version, released, _ = module_info(go, tool.module_dir, tool.version_module)
        xflags = [f"-X {flag}={_xvalue(flag, version, released)}" for flag in tool.xflags]
        ldflags = " ".join(["-s", "-w", *xflags])
        # Per-process name: two builds racing into one cache never write the same file.
        partial = target / f".{tool.name}.{os.getpid()}.partial"
        cmd = [*_nice(), go, "build", "-v", "-trimpath", "-ldflags", ldflags]
        if tool.tags:
            cmd += ["-tags", ",".join(tool.tags)]
        cmd += ["-o", str(partial), tool.package]
        _log(f"[{index}/{total}] {tool.name} ({tool.version_module} {version})")
        t0 = time.monotonic()
        _run_build(cmd, HACK_DIR / tool.module_dir, tool.name, tool.cgo)
        partial.replace(target / tool.name)
        size = (target / tool.name).stat().st_size / 2**20
        _log(f"      {tool.name} built in {time.monotonic() - t0:.0f}s ({size:.0f} MiB)")


def _check_cgo(tool: Tool) -> None:
    """What a cgo build needs from the system, said before Go fails on it less clearly."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        raise BuildError(f"building {tool.name} needs a C compiler: install gcc")
    if "seccomp" in tool.tags:
        found = (
            subprocess.run(
                ["pkg-config", "--exists", "libseccomp"], capture_output=True, check=False
            )
            if shutil.which("pkg-config")
            else None
        )
        if found is None or found.returncode != 0:
            raise BuildError(
                f"building {tool.name} needs libseccomp's headers: install Debian's "
                "libseccomp-dev and pkg-config packages (make system-packages)"
            )


def _download(go: str, module_dir: str) -> None:
    proc = subprocess.run(
        [go, "mod", "download"],
        cwd=HACK_DIR / module_dir,
        env=_go_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise BuildError(f"go mod download failed in hack/k8s/{module_dir}:\n{proc.stderr}")


def _copy_stages(go: str) -> None:
    """Copy kwok's stage files out of the module cache, so `up` never needs Go."""
    _, _, source = module_info(go, "kwok", "sigs.k8s.io/kwok")
    dest = stages_dir()
    dest.mkdir(parents=True, exist_ok=True)
    for stage in KWOK_STAGES:
        shutil.copyfile(source / "kustomize" / "stage" / stage, dest / Path(stage).name)
