"""Build ``podnet.c`` (the wildcard-bind shim every container process preloads) once per source
and compiler, into the binary cache next to the Kubernetes binaries."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ladle.cluster.build import cache_root

SOURCE = Path(__file__).with_name("podnet.c")


class ShimError(RuntimeError):
    """No C compiler, or the shim did not compile."""


def build() -> Path:
    """The shim's path, compiling it first if this source and compiler have not been built."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise ShimError("the node agent needs a C compiler (cc or gcc) to build its bind shim")
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    key = hashlib.sha256(f"{SOURCE.read_text()}\0{version}".encode()).hexdigest()[:16]
    target = cache_root() / "node-agent" / f"podnet-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        proc = subprocess.run(
            [compiler, "-O2", "-shared", "-fPIC", "-o", str(built), str(SOURCE), "-ldl"],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise ShimError(f"compiling {SOURCE.name} failed:\n{proc.stderr}")
        built.chmod(0o755)
        os.replace(built, target)
    return target
