"""bench/gpu_check.py, the one script a session with a lent GPU runs, works end to end.

It runs on a GPU only now and then, with minutes of device time at stake, so its plumbing is
proven here: ``--smoke`` runs every section on tiny shapes, on the CPU under the interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"
SECTIONS = {
    "ceiling", "correct", "decode", "prefill", "fused", "quant", "engine", "throughput", "parallel"
}  # fmt: skip


@pytest.mark.slow
def test_smoke_run_fills_every_section_and_passes(tmp_path: Path) -> None:
    out, models = tmp_path / "out", tmp_path / "models"
    args = ["--smoke", "--budget", "1500", "--out", str(out), "--models-dir", str(models)]
    # One thread per process: the plumbing is what is checked, and beside the other worker's
    # tests and the cluster's pods a parallel region's threads wait at each barrier for one
    # another to be scheduled. (Its peak memory, 1.0 GB, is bounded in the script itself.)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert {r["section"] for r in rows} >= SECTIONS
    broken = [r["name"] for r in rows if r["value"] is None or r["ok"] is False]
    assert not broken, broken
    names = [r["name"] for r in rows]
    # The last section drives `ladle bench throughput --profile` through the real CLI.
    assert {"bench throughput A ladle", "bench throughput B ladle"} <= set(names)
    # Two CPU ranks stand in for the GPUs: the same greedy tokens as one.
    assert "greedy identical, tp 2 vs 1" in names
    assert (
        (out / "table.txt").read_text().splitlines()[-1].startswith(f"{len(rows)} rows, 0 failed")
    )
