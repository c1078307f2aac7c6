"""bench/quantization.py runs end to end (tiny model, one round): the speed and memory table
the lead publishes from a quiet machine must not rot."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "quantization.py"


@pytest.mark.slow
def test_quantization_benchmark_reports_ratios_bytes_and_kv_tokens(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    out = tmp_path / "bench.json"
    argv = [sys.executable, str(SCRIPT), "--model", str(tiny_model("llama"))]
    argv += ["--configs", "fp32", "int8+kv-int8", "--batches", "1", "2"]
    argv += ["--rounds", "2", "--steps", "2", "--json", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())["configs"]
    assert set(results) == {"fp32", "int8+kv-int8"}
    for entry in results.values():
        for batch in ("1", "2"):
            timing = entry["batches"][batch]
            assert len(timing["ms_per_step"]) == 2
            assert timing["median_ms"] > 0
    assert results["fp32"]["batches"]["1"]["speedup"] == 1.0
    assert results["int8+kv-int8"]["weight_bytes"] < results["fp32"]["weight_bytes"] / 3
    # head_dim 16: 16 int8 bytes + a 4-byte scale per row against 64 bytes of fp32.
    kv_ratio = results["int8+kv-int8"]["kv_tokens_per_gib"] / results["fp32"]["kv_tokens_per_gib"]
    assert kv_ratio == pytest.approx(64 / 20)
    assert "KV tokens/GiB" in proc.stdout
