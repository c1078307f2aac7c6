"""Ladle's images, built for real: buildah runs ``Dockerfile.runtime`` and
``Dockerfile.operator`` as written, and the local nodes' containerd imports the result.

No container registry is reachable here, so two images that a user's cluster would pull are
made locally instead:

- the Dockerfiles' ``PYTHON_IMAGE`` base, a Debian bookworm root filesystem with Python 3.11
  and pip made by mmdebstrap from Debian's packages (what ``python:3.11-slim-bookworm`` is),
  passed as a build argument, so the Dockerfiles stay valid for ``docker build`` unchanged;
- the pod sandbox ("pause") image, Kubernetes' own ``pause.c`` compiled statically.

Everything is cached by content, like the Go binaries: buildah's layer cache (``--layers``)
under ``$LADLE_CACHE_DIR/images``, so a change to Ladle's code rebuilds only the layers after
its wheel, and the base and pause images under a label holding the hash of their recipe. Built
images are saved, their layers uncompressed, into one OCI layout that the nodes import from.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ladle import __version__
from ladle_dev.cluster.build import REPO_ROOT, BuildError, cache_root

REGISTRY = "ghcr.io/ladle-dev"
# Stands in for python:3.11-slim-bookworm, which cannot be pulled here.
BASE = "localhost/ladle/python:3.11-bookworm"
PAUSE = "localhost/ladle/pause:3.10"
DEBIAN_SUITE = "bookworm"
# What python:3.11-slim-bookworm has that matters to the Dockerfiles: python, pip (Debian's,
# made to install as the official image's does), CA certificates, netbase and tzdata.
BASE_PACKAGES = (
    "python3",
    "python3-pip",
    "python-is-python3",
    "ca-certificates",
    "netbase",
    "tzdata",
)
# Debian marks its Python as externally managed (PEP 668); the official image's is not, and the
# Dockerfiles pip-install into it as root.
BASE_HOOK = "rm -f $1/usr/lib/python3.11/EXTERNALLY-MANAGED"
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
RECIPE_LABEL = "dev.ladle.recipe"
# Bump when the recipes below change in a way their inputs do not show.
RECIPE = "1"
# The host's CA bundle, bound read-only into every RUN step (never into the image), so that
# pip and apt work behind a TLS-intercepting proxy, as on our machines.
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
# buildah's and skopeo's run-time state (locks), on the tmpfs.
RUN_ROOT = Path("/run/ladle/buildah")
REF_NAME = "org.opencontainers.image.ref.name"


@dataclass(frozen=True)
class Image:
    """One of Ladle's images, built from its Dockerfile in the checkout."""

    name: str
    dockerfile: str

    @property
    def reference(self) -> str:
        return f"{REGISTRY}/{self.name}:{__version__}"


RUNTIME = Image("ladle-runtime", "Dockerfile.runtime")
OPERATOR = Image("ladle-operator", "Dockerfile.operator")
IMAGES = (OPERATOR, RUNTIME)


@dataclass(frozen=True)
class Built:
    """A built image: its reference, id and size."""

    reference: str
    image_id: str
    size: int


def store() -> Path:
    return cache_root() / "images"


def _log(message: str) -> None:
    print(message, flush=True)


def buildah_argv(*args: str) -> list[str]:
    """``buildah`` on Ladle's own storage, so the layer cache lives beside the Go binaries."""
    buildah = shutil.which("buildah")
    if buildah is None:
        raise BuildError("no buildah: install Debian's buildah package (apt-get install buildah)")
    return [
        buildah,
        "--root",
        str(store() / "storage"),
        "--runroot",
        str(RUN_ROOT),
        "--storage-driver",
        "overlay",
        *args,
    ]


def _buildah(*args: str) -> str:
    proc = subprocess.run(
        buildah_argv(*args), capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL
    )
    if proc.returncode != 0:
        raise BuildError(f"buildah {args[0]} failed: {proc.stderr.strip()}")
    return proc.stdout.strip()


def inspect(reference: str) -> dict[str, object] | None:
    """buildah's view of a stored image, or None when there is none by that name."""
    proc = subprocess.run(
        buildah_argv("inspect", "--type", "image", reference),
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        return None
    result: dict[str, object] = json.loads(proc.stdout)
    return result


def labels(reference: str) -> dict[str, str]:
    info = inspect(reference)
    if info is None:
        return {}
    config = info.get("OCIv1") or {}
    assert isinstance(config, dict)
    found: dict[str, str] = (config.get("config") or {}).get("Labels") or {}
    return found


def _recipe_key(*parts: str | bytes) -> str:
    digest = hashlib.sha256(RECIPE.encode())
    for part in parts:
        digest.update(part if isinstance(part, bytes) else part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _current(reference: str, key: str) -> bool:
    return labels(reference).get(RECIPE_LABEL) == key


def _commit_rootfs(reference: str, rootfs: Path, key: str, config: Sequence[str]) -> None:
    """A one-layer image of ``rootfs`` (a folder or a tar archive) with ``config``."""
    container = _buildah("from", "scratch")
    try:
        _buildah("add", container, str(rootfs), "/")
        _buildah("config", *config, "--label", f"{RECIPE_LABEL}={key}", container)
        _buildah("commit", "--quiet", container, reference)
    finally:
        with contextlib.suppress(BuildError):
            _buildah("rm", container)


def build_base() -> None:
    """The Dockerfiles' base: Debian's Python in an mmdebstrap root filesystem."""
    key = _recipe_key(DEBIAN_SUITE, *BASE_PACKAGES, BASE_HOOK, BASE_PATH)
    if _current(BASE, key):
        return
    mmdebstrap = shutil.which("mmdebstrap")
    if mmdebstrap is None:
        raise BuildError("no mmdebstrap: install Debian's mmdebstrap package")
    with tempfile.TemporaryDirectory(dir=_scratch()) as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        _run_logged(
            [
                mmdebstrap,
                "--variant=minbase",
                f"--include={','.join(BASE_PACKAGES)}",
                f"--customize-hook={BASE_HOOK}",
                DEBIAN_SUITE,
                str(rootfs),
            ],
            "base",
            lambda line: line if line.startswith("I: ") and "..." in line else None,
        )
        _commit_rootfs(
            BASE,
            rootfs,
            key,
            ["--env", f"PATH={BASE_PATH}", "--env", "LANG=C.UTF-8", "--cmd", "python3"],
        )


def pause_source() -> Path:
    """Kubernetes' pause.c, from the module the cluster binaries are built from."""
    from ladle_dev.cluster.build import find_go, module_info

    _, _, source = module_info(find_go(), "kubernetes", "k8s.io/kubernetes")
    return source / "build" / "pause" / "linux" / "pause.c"


def build_pause() -> None:
    """The pod sandbox image: Kubernetes' pause.c, linked statically, alone in the image."""
    source = pause_source()
    version = PAUSE.rsplit(":", 1)[1]
    key = _recipe_key(source.read_bytes(), version)
    if _current(PAUSE, key):
        return
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise BuildError("no C compiler to build the pause image: install gcc")
    with tempfile.TemporaryDirectory(dir=_scratch()) as tmp:
        rootfs = Path(tmp) / "rootfs"
        rootfs.mkdir()
        subprocess.run(
            [
                cc,
                "-Os",
                "-static",
                "-Wall",
                f"-DVERSION=v{version}",
                "-o",
                rootfs / "pause",
                source,
            ],
            check=True,
            capture_output=True,
        )
        _commit_rootfs(PAUSE, rootfs, key, ["--entrypoint", '["/pause"]', "--user", "65535:65535"])


def _scratch() -> Path:
    path = store() / "tmp"
    path.mkdir(parents=True, exist_ok=True)
    return path


def revision() -> str:
    """The checkout's commit, with ``-dirty`` when it has uncommitted changes."""
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}-dirty" if dirty else head


def build_image(image: Image) -> set[str]:
    """``buildah bud`` of the image's Dockerfile on the base, reusing every cached layer;
    returns the ids of the images its steps made or reused (the cache the next build needs)."""
    dockerfile = REPO_ROOT / image.dockerfile
    if not dockerfile.is_file():
        raise BuildError(f"{dockerfile} is missing: images are built from a Ladle checkout")
    args = ["bud", "--layers", "--isolation", "chroot", "--network", "host"]
    if HOST_CA_BUNDLE.is_file():
        args += ["--volume", f"{HOST_CA_BUNDLE}:{HOST_CA_BUNDLE}:ro"]
    # The Dockerfiles label the version and revision from these build arguments; buildah 1.28's
    # layer cache does not count an argument's value in a LABEL step's key (a new commit kept
    # the last one's label), so they are also set as labels of the image it commits.
    commit = revision()
    args += [
        *("--build-arg", f"PYTHON_IMAGE={BASE}"),
        *("--build-arg", f"VERSION={__version__}"),
        *("--build-arg", f"REVISION={commit}"),
        *("--label", f"org.opencontainers.image.version={__version__}"),
        *("--label", f"org.opencontainers.image.revision={commit}"),
        *("-f", str(dockerfile)),
        *("-t", image.reference),
        str(REPO_ROOT),
    ]
    output = _run_logged(buildah_argv(*args), image.name, _running_steps())
    # Each step ends with "--> <id>" or "--> Using cache <id>".
    return {line.split()[-1] for line in output if line.startswith("--> ")}


def _running_steps() -> Callable[[str], str | None]:
    """Picks buildah's "STEP n/m" lines of the steps that run, not of those its layer cache
    answers: a step's line is shown once the next line is not "--> Using cache"."""
    pending: list[str] = []

    def pick(line: str) -> str | None:
        shown = None
        if pending and not line.startswith("--> Using cache"):
            shown = pending.pop()
        pending.clear()
        if line.startswith("[") and "STEP " in line:
            pending.append(line)
        return shown

    return pick


def _run_logged(argv: list[str], label: str, shown: Callable[[str], str | None]) -> list[str]:
    """Run a build, keep its whole output in the store's log folder, print what ``shown``
    picks from each line as progress, and raise with the output's tail if it fails."""
    logs = store() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    start = time.monotonic()
    with (logs / f"{label}.log").open("w") as log:
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            lines.append(line.rstrip())
            if (progress := shown(line)) is not None:
                _log(f"      {label}: {progress.strip()[:100]} ({time.monotonic() - start:.0f}s)")
        rc = proc.wait()
    if rc != 0:
        tail = "\n".join(lines[-40:])
        raise BuildError(f"building {label} failed (exit {rc}; log: {logs / label}.log):\n{tail}")
    return lines


def image_id(reference: str) -> str:
    info = inspect(reference)
    if info is None:
        raise BuildError(f"{reference} is not built: run `ladle cluster build`")
    return str(info["FromImageID"])


def layout() -> Path:
    """The OCI image layout the nodes import from: every image, its layers uncompressed, so
    that saving a rebuilt image writes only the layers the layout does not have yet, and a
    node imports without decompressing anything."""
    return store() / "layout"


def save(reference: str) -> None:
    """Copy ``reference`` into the layout under its own name (replacing its older manifest).

    skopeo, because it can keep layers uncompressed in a layout; ``buildah push`` would
    compress every layer, the unchanged ones too (a minute for the runtime image)."""
    skopeo = shutil.which("skopeo")
    if skopeo is None:
        raise BuildError("no skopeo: install Debian's skopeo package (apt-get install skopeo)")
    source = f"containers-storage:[overlay@{store() / 'storage'}+{RUN_ROOT}]{reference}"
    layout().mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [skopeo, "copy", "--quiet", "--dest-oci-accept-uncompressed-layers", source,
         f"oci:{layout()}:{reference}"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise BuildError(f"saving {reference} into {layout()} failed: {proc.stderr.strip()}")


def _blob_path(digest: str) -> Path:
    algorithm, _, hexdigest = digest.partition(":")
    return layout() / "blobs" / algorithm / hexdigest


def _manifest(entry: dict[str, Any]) -> dict[str, Any]:
    manifest: dict[str, Any] = json.loads(_blob_path(entry["digest"]).read_text())
    return manifest


def _blobs(entry: dict[str, Any]) -> set[str]:
    """The digests an index entry refers to: its manifest, config and layers."""
    manifest = _manifest(entry)
    return {
        entry["digest"],
        manifest["config"]["digest"],
        *(layer["digest"] for layer in manifest["layers"]),
    }


def _index() -> list[dict[str, Any]]:
    path = layout() / "index.json"
    if not path.is_file():
        return []
    manifests: list[dict[str, Any]] = json.loads(path.read_text())["manifests"]
    return manifests


def manifest_descriptor(reference: str) -> dict[str, Any]:
    """The layout's index entry for ``reference``."""
    for entry in _index():
        if (entry.get("annotations") or {}).get(REF_NAME) == reference:
            return entry
    raise BuildError(f"{reference} is not in {layout()}: run `ladle cluster build`")


@dataclass(frozen=True)
class Blobs:
    """Where an image's blobs are in the layout: its manifest and config, and its layers."""

    descriptor: dict[str, Any]
    metadata: list[tuple[str, Path]]  # the manifest, then the config
    layers: list[tuple[str, Path]]

    @property
    def config(self) -> Path:
        return self.metadata[1][1]


def image_blobs(reference: str) -> Blobs:
    """The layout's index entry for ``reference`` and (digest, file) of each of its blobs."""
    entry = manifest_descriptor(reference)
    manifest = _manifest(entry)
    digests = [entry["digest"], manifest["config"]["digest"]]
    return Blobs(
        descriptor=entry,
        metadata=[(digest, _blob_path(digest)) for digest in digests],
        layers=[(layer["digest"], _blob_path(layer["digest"])) for layer in manifest["layers"]],
    )


def chain_ids(reference: str) -> list[str]:
    """The chain id of each of the image's layers, bottom first: what a snapshotter names the
    layer's snapshot by (the OCI image spec's ChainID, from the config's diff ids)."""
    config = json.loads(image_blobs(reference).config.read_text())
    first, *rest = config["rootfs"]["diff_ids"]
    chain: list[str] = [first]
    for diff_id in rest:
        chain.append("sha256:" + hashlib.sha256(f"{chain[-1]} {diff_id}".encode()).hexdigest())
    return chain


def _collect_layout(references: Sequence[str]) -> None:
    """Keep only ``references`` in the layout's index (a manifest saved over leaves its older
    one there, nameless), then delete the blobs no manifest refers to any more."""
    path = layout() / "index.json"
    index = json.loads(path.read_text())
    index["manifests"] = [
        entry
        for entry in index["manifests"]
        if (entry.get("annotations") or {}).get(REF_NAME) in references
    ]
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(index))
    partial.replace(path)
    keep: set[str] = set()
    for entry in index["manifests"]:
        keep |= _blobs(entry)
    for path in (layout() / "blobs").glob("*/*"):
        if f"{path.parent.name}:{path.name}" not in keep:
            path.unlink()


def _collect_storage(used: set[str]) -> None:
    """Remove the images that carry no name and were no step of the last builds: the layer
    cache keeps what the next build can reuse, and a change to the code does not leave the
    previous build's model, kernels and calibrations behind (over half a gigabyte a time)."""
    listed = json.loads(_buildah("images", "--all", "--json") or "[]")
    stale = [
        image["id"]
        for image in listed
        if not image.get("names") and not any(image["id"].startswith(step) for step in used)
    ]
    if stale:
        _buildah("rmi", "--force", *stale)


@contextlib.contextmanager
def locked(shared: bool = False) -> Iterator[None]:
    """A build holds the store alone; a node importing from the layout shares it, so that a
    build in another process never deletes the layers it reads."""
    path = store() / "store.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield


def build_all() -> list[Built]:
    """Build (or reuse) the base, the pause image and Ladle's images, and save them for the
    nodes; returns what a local node imports, pause first."""
    if os.geteuid() != 0:
        raise BuildError("building images needs root (buildah, mmdebstrap): run as root")
    steps: list[tuple[str, Callable[[], set[str] | None]]] = [
        ("the base image (Debian's Python, by mmdebstrap)", build_base),
        ("the pause image (Kubernetes' pause.c)", build_pause),
        *(
            (f"{image.reference} ({image.dockerfile})", functools.partial(build_image, image))
            for image in IMAGES
        ),
    ]
    references = (PAUSE, *(image.reference for image in IMAGES))
    with locked():
        used: set[str] = set()
        for index, (title, step) in enumerate(steps, 1):
            start = time.monotonic()
            _log(f"[{index}/{len(steps)}] {title}")
            used |= step() or set()
            _log(f"      ready in {time.monotonic() - start:.0f}s")
        _collect_storage(used)
        for reference in references:
            save(reference)
        _collect_layout(references)
        return [Built(ref, image_id(ref), unpacked_size(ref)) for ref in references]


def unpacked_size(reference: str) -> int:
    """The image's unpacked size in bytes: the sum of its (uncompressed) layers."""
    return sum(int(layer["size"]) for layer in _manifest(manifest_descriptor(reference))["layers"])
