"""Kernels built ahead of time per x86-64 level: which one a CPU takes, and that a prebuilt
library is what the runtime then loads instead of compiling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ladle.runtime.kernels import prebuilt

V3 = prebuilt.LEVELS[1][1]
V4 = prebuilt.LEVELS[0][1]


def fake_libraries(directory: Path, levels: list[str], key: str | None = None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for level in levels:
        (directory / prebuilt.library_name(level, key)).write_bytes(b"")


@pytest.mark.parametrize(
    ("flags", "present", "expected"),
    [
        (V4, ["x86-64-v4", "x86-64-v3", "x86-64"], "x86-64-v4"),
        (V3, ["x86-64-v4", "x86-64-v3", "x86-64"], "x86-64-v3"),  # no AVX-512: not v4
        (V3 - {"fma"}, ["x86-64-v4", "x86-64-v3", "x86-64"], "x86-64"),
        (V4, ["x86-64"], "x86-64"),  # an image that built the baseline only
        (V4, [], None),
    ],
)
def test_a_cpu_takes_the_highest_level_it_runs(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    flags: frozenset[str],
    present: list[str],
    expected: str | None,
) -> None:
    fake_libraries(tmp_path, present)
    monkeypatch.setenv(prebuilt.ENV, str(tmp_path))
    monkeypatch.setattr(prebuilt, "cpu_flags", lambda: flags)
    monkeypatch.setattr(prebuilt.platform, "machine", lambda: "x86_64")
    found = prebuilt.find()
    assert (found[0] if found else None) == expected
    if found:
        assert found[1] == tmp_path / prebuilt.library_name(expected or "")


def test_libraries_of_other_sources_or_no_folder_are_not_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prebuilt, "cpu_flags", lambda: V4)
    monkeypatch.setattr(prebuilt.platform, "machine", lambda: "x86_64")
    fake_libraries(tmp_path, ["x86-64-v4", "x86-64"], key="0123456789abcdef")
    monkeypatch.setenv(prebuilt.ENV, str(tmp_path))
    assert prebuilt.find() is None
    monkeypatch.delenv(prebuilt.ENV)
    assert prebuilt.find() is None


def test_the_runtime_loads_a_prebuilt_library_instead_of_compiling(tmp_path: Path) -> None:
    # The baseline level only (one compiler run): its portable C path is what the library
    # reports, where a native build on this machine would report AVX2 or AVX-512.
    kernels, cache = tmp_path / "kernels", tmp_path / "cache"
    out = subprocess.run(
        [sys.executable, "-m", "ladle.runtime.kernels.prebuilt"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 2
    assert out.stderr == "usage: python -m ladle.runtime.kernels.prebuilt DIR\n"
    [library] = prebuilt.prebuild(kernels, os.environ.get("CC", "cc"), levels=["x86-64"])
    assert library.name == prebuilt.library_name("x86-64")
    probe = (
        "import json, torch\n"
        "from ladle.runtime.kernels import cpu_kernels, quant_ops\n"
        "from ladle.runtime.quantization.formats import quantize_groups\n"
        "lib = cpu_kernels.load()\n"
        "w = torch.randn(20, 64)\n"
        "q = quantize_groups(w, 32)\n"
        "x = torch.randn(3, 64)\n"
        "err = (quant_ops.linear(lib, x, q, None) - x @ q.dequantize().T).abs().max()\n"
        "print(json.dumps([quant_ops.ISA_NAMES[lib.ladle_quant_isa()], float(err)]))\n"
    )
    env = {**os.environ, prebuilt.ENV: str(kernels), "LADLE_CACHE_DIR": str(cache)}
    run = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True
    )
    isa, err = json.loads(run.stdout.splitlines()[-1])
    assert isa == "portable"
    assert err < 1e-4
    assert not (cache / "kernels").exists()  # nothing was compiled
