"""CPU kernels built ahead of time, one library per x86-64 level, for images to ship.

A pod that builds the kernels itself (``-march=native``, on first use) spends about 11 s of
CPU on it every time it starts, since its cache folder starts empty. An image cannot build for
``native``: it does not know the CPU it will run on. It can build for the x86-64
microarchitecture levels of the psABI, which the kernels' instruction-set paths map onto (v4
has AVX-512 F, the ``__AVX512F__`` tiles; v3 has AVX2 and FMA; the baseline runs the portable
C). At start the runtime takes the highest level this CPU supports from
``$LADLE_KERNELS_DIR``, and builds for ``native`` only when there is none.

Build them with ``python -m ladle.runtime.kernels.prebuilt DIR`` (``Dockerfile.runtime`` does,
and so does the local node agent's image). This module imports neither torch nor the kernels.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

_HERE = Path(__file__).parent
SOURCES = tuple(
    _HERE / name for name in ("cpu_kernels.c", "quant_kernels.c", "a8_kernels.c", "decode_step.c")
)
HEADER = _HERE / "kernels.h"
# Everything but the target; the caller adds -march.
COMMON_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
_V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
# Highest first, each with the /proc/cpuinfo flags a CPU needs to run it (abm is LZCNT).
LEVELS: tuple[tuple[str, frozenset[str]], ...] = (
    ("x86-64-v4", _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
    ("x86-64-v3", _V3),
    ("x86-64", frozenset()),
)
ENV = "LADLE_KERNELS_DIR"


def source_key() -> str:
    """Names the sources and flags a library was built from, so that a stale one is not found."""
    text = "\0".join([*(s.read_text() for s in (*SOURCES, HEADER)), *COMMON_FLAGS])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def library_name(level: str, key: str | None = None) -> str:
    return f"cpu_kernels-{key or source_key()}-{level}.so"


def compile_library(compiler: str, flags: tuple[str, ...], target: Path) -> None:
    """Build into ``target`` atomically: a concurrent builder finds a whole file or none."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run(
            [compiler, *flags, "-o", str(built), *map(str, SOURCES), "-lm"],
            capture_output=True,
            text=True,
            check=True,
        )
        os.replace(built, target)


def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def find() -> tuple[str, Path] | None:
    """(level, library) for this CPU from ``$LADLE_KERNELS_DIR``, or None."""
    directory = os.environ.get(ENV)
    if not directory or platform.machine() not in ("x86_64", "AMD64"):
        return None
    flags, key = cpu_flags(), source_key()
    for level, needs in LEVELS:
        path = Path(directory) / library_name(level, key)
        if needs <= flags and path.is_file():
            return level, path
    return None


def prebuild(
    directory: Path, compiler: str = "cc", levels: Sequence[str] | None = None
) -> list[Path]:
    """Each level's library (every level by default) in ``directory``, the baseline last: its
    presence means all are there."""
    key = source_key()
    built = []
    for level, _ in LEVELS:
        if levels is not None and level not in levels:
            continue
        target = directory / library_name(level, key)
        compile_library(compiler, (*COMMON_FLAGS, f"-march={level}", "-mtune=generic"), target)
        built.append(target)
    return built


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m ladle.runtime.kernels.prebuilt DIR", file=sys.stderr)
        return 2
    compiler = os.environ.get("CC", "cc")
    try:
        for path in prebuild(Path(argv[0]), compiler):
            print(path)
    except (OSError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", None) or str(err)
        print(f"could not build the CPU kernels with {compiler}: {detail.strip()}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
