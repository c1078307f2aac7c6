"""The images a local node can run: Ladle's own, mapped to the installed ``ladle`` entry points.

There is no container runtime and no registry here, so "pulling" an image means finding it in
``IMAGES``: the same ENTRYPOINT, CMD, ENV, USER and WORKDIR as its Dockerfile (a test compares
them), run from the Python environment the agent itself runs in, which has ``ladle``
installed. Any other image leaves its container Waiting with ``ErrImageNeverPull``.

Content an image carries beyond the ``ladle`` wheel is an ``ImageFile``: the host keeps it and
the container sees it, read-only, at the image's path. The runtime image bakes the converted
default model at ``/opt/ladle/models/SmolLM2-135M-Instruct`` (``LADLE_DEFAULT_MODEL_DIR``
points there), so a pod never converts the GGUF again: here that path is the host's converted
cache, produced once by the image's ``prepare`` step, which the agent runs as its "pull". The
CPU kernels, built for each x86-64 level, are baked the same way at ``/opt/ladle/kernels``
(``LADLE_KERNELS_DIR``), so a pod does not compile them either, and so are the default model's
AWQ calibrations for int8 and int4 at ``/opt/ladle/calibration`` (``LADLE_CALIBRATION_DIR``),
so a quantized pod does not calibrate.

The gateway runs from the operator image (the chart gives it ``command: [ladle, gateway]``),
so it needs no entry. Adding an image is one more ``Image`` in ``IMAGES`` with its Dockerfile's
name in ``dockerfile``; ``tests/cluster/test_node_agent_units.py`` then checks the entry against
that Dockerfile.
"""

from __future__ import annotations

import fcntl
import re
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ladle import __version__
from ladle.cluster.build import cache_root
from ladle.runtime.kernels import prebuilt
from ladle.runtime.quantization import bake

REGISTRY = "ghcr.io/ladle-dev"
# The folder name the runtime converts the default model into (runtime/models/loader.py).
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
BAKED_MODEL_DIR = f"/opt/ladle/models/{DEFAULT_MODEL_NAME}"
BAKED_KERNELS_DIR = "/opt/ladle/kernels"
BAKED_CALIBRATION_DIR = "/opt/ladle/calibration"
# What the python:3.11-slim base image puts on PATH, with the agent's environment first: that
# is where ``ladle`` is installed, as /usr/local/bin is in the image.
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
BASE_ENV = {"LANG": "C.UTF-8"}

_REFERENCE = re.compile(
    r"^(?P<name>[a-z0-9]+(?:[._/-][a-z0-9]+)*(?::\d+)?(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*)"
    r"(?::(?P<tag>[\w][\w.-]{0,127}))?(?:@(?P<digest>[a-z0-9]+:[0-9a-fA-F]{32,}))?$"
)


def host_model_dir() -> Path:
    """Where the host keeps the converted default model (``ladle serve`` converts into it)."""
    return cache_root() / "models" / DEFAULT_MODEL_NAME


@dataclass(frozen=True)
class ImageFile:
    """Content baked into an image that this host provides, bound read-only at ``path``."""

    path: str
    host_path: Path
    # Run once (as a pull) when ``host_path`` is missing; it must create it.
    prepare: tuple[str, ...]
    # Proof that ``host_path`` is complete, relative to it.
    marker: str
    describe: str

    def present(self) -> bool:
        return (self.host_path / self.marker).exists()

    def make_readable(self) -> None:
        """Let the image's user read it, as it could in the image (a cache converted by an
        older runtime was left 0700)."""
        for path in (self.host_path, *self.host_path.rglob("*")):
            mode = path.stat().st_mode
            wanted = mode | (0o555 if path.is_dir() else 0o444)
            if wanted != mode:
                path.chmod(wanted)


@dataclass(frozen=True)
class Image:
    repository: str
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    user: str = "0:0"
    workdir: str = "/"
    dockerfile: str | None = None
    files: tuple[ImageFile, ...] = ()

    @property
    def uid(self) -> int:
        return int(self.user.split(":")[0])

    @property
    def gid(self) -> int:
        parts = self.user.split(":")
        return int(parts[1]) if len(parts) > 1 else self.uid

    def environment(self) -> dict[str, str]:
        """The image's environment as a container starts with it."""
        path = f"{Path(sys.executable).parent}:{BASE_PATH}"
        return {"PATH": path, **BASE_ENV, "HOME": "/", **self.env}


PYTHON_ENV = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}
DEFAULT_MODEL = ImageFile(
    path=BAKED_MODEL_DIR,
    host_path=host_model_dir(),
    prepare=(
        sys.executable,
        "-c",
        "from ladle.runtime.models.loader import resolve_model; resolve_model(None)",
    ),
    marker="config.json",
    describe="converting the embedded default model (once per machine)",
)
_KERNELS_HOST_DIR = cache_root() / "kernels-prebuilt" / prebuilt.source_key()
PREBUILT_KERNELS = ImageFile(
    path=BAKED_KERNELS_DIR,
    host_path=_KERNELS_HOST_DIR,
    prepare=(sys.executable, "-m", "ladle.runtime.kernels.prebuilt", str(_KERNELS_HOST_DIR)),
    marker=prebuilt.library_name(prebuilt.LEVELS[-1][0]),  # built last
    describe="building the CPU kernels for each x86-64 level (once per machine and source)",
)
_CALIBRATION_HOST_DIR = cache_root() / "calibration-baked" / bake.source_key()
BAKED_CALIBRATION = ImageFile(
    path=BAKED_CALIBRATION_DIR,
    host_path=_CALIBRATION_HOST_DIR,
    prepare=(sys.executable, "-m", "ladle.runtime.quantization.bake", str(_CALIBRATION_HOST_DIR)),
    marker=bake.MARKER,
    describe="calibrating AWQ for the default model's int8 and int4 (once per machine)",
)
RUNTIME = Image(
    repository=f"{REGISTRY}/ladle-runtime",
    entrypoint=("ladle", "serve"),
    cmd=("--host", "0.0.0.0", "--port", "8000"),
    env={
        **PYTHON_ENV,
        "HOME": "/tmp",
        "XDG_CACHE_HOME": "/var/cache/ladle",
        "LADLE_DEFAULT_MODEL_DIR": BAKED_MODEL_DIR,
        prebuilt.ENV: BAKED_KERNELS_DIR,
        bake.ENV: BAKED_CALIBRATION_DIR,
    },
    user="10001:10001",
    dockerfile="Dockerfile.runtime",
    files=(DEFAULT_MODEL, PREBUILT_KERNELS, BAKED_CALIBRATION),
)
IMAGES: tuple[Image, ...] = (
    RUNTIME,
    Image(
        repository=f"{REGISTRY}/ladle-operator",
        entrypoint=("ladle", "operator"),
        env=PYTHON_ENV,
        user="10001:10001",
        dockerfile="Dockerfile.operator",
    ),
)


class ImageError(Exception):
    """The container cannot have this image; ``reason`` is the kubelet's Waiting reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def resolve(reference: str, version: str = __version__) -> Image:
    """The table entry for ``reference``, or ImageError saying why there is none."""
    match = _REFERENCE.match(reference)
    if match is None:
        raise ImageError("InvalidImageName", f'Failed to apply default image tag "{reference}"')
    name, tag = match["name"], match["tag"] or "latest"
    for image in IMAGES:
        if image.repository == name and tag == version and match["digest"] is None:
            return image
    known = ", ".join(f"{image.repository}:{version}" for image in IMAGES)
    raise ImageError(
        "ErrImageNeverPull",
        f'Container image "{reference}" is not present on this local node: the ladle node '
        f"agent runs only ladle's own images as processes ({known})",
    )


def pull_ahead(image: Image, say: Callable[[str], None]) -> None:
    """Make ``image``'s files present now, as on a node whose image was pulled in advance, so
    that a cold machine's first pod does not pull inside somebody's timeout. One process at a
    time (a file lock): a concurrent caller waits, then finds the files there."""
    lock = cache_root() / "image-files.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        for item in image.files:
            if not item.present():
                say(f"{image.repository}: {item.describe}")
                subprocess.run(item.prepare, check=True, stdin=subprocess.DEVNULL)
            item.make_readable()
