"""The kernels compile for a Hopper GPU (sm_90) without spilling registers.

The interpreter runs the kernels' Python, not the GPU compiler: dot-shape limits, dtype rules
and register pressure show up only here. Triton ships ptxas and cuobjdump, so no GPU is needed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "compile_check.py"
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


@pytest.mark.slow
@pytest.mark.skipif(not (TOOLS / "ptxas").exists(), reason="triton without its CUDA toolchain")
def test_kernels_compile_for_sm90_without_spills(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from an earlier cache
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 problem(s)" in proc.stdout
    assert proc.stdout.count("mma=True") >= 4  # 16-bit dots go to the tensor cores
