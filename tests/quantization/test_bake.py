"""Calibrations baked ahead of time (``python -m ladle.runtime.quantization.bake``): a quantized
engine loads them instead of calibrating, and only for the model and settings they were made
for."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from ladle.runtime import LLM, SamplingParams
from ladle.runtime.quantization import awq, bake

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = [5, 17, 300, 42, 9, 1000, 3, 3, 64]


@pytest.fixture
def tiny_llama(tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch) -> Path:
    # A short calibration: what is tested is where it comes from, not how good it is.
    monkeypatch.setattr(awq, "CALIBRATION_SEQUENCES", 4)
    monkeypatch.setattr(awq, "CALIBRATION_LENGTH", 64)
    return tiny_model("llama")


@pytest.fixture
def baked(tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The calibrations ``bake`` made for the tiny model, in ``tmp_path / "baked"``."""
    monkeypatch.setenv("LADLE_CACHE_DIR", str(tmp_path / "bake-cache"))
    return bake.bake(tmp_path / "baked", str(tiny_llama))


def greedy(model: Path, quantization: str) -> list[int]:
    llm = LLM(str(model), quantization=quantization, num_gpu_blocks_override=32, block_size=4)
    outputs = llm.generate({"prompt_token_ids": PROMPT}, GREEDY, use_tqdm=False)
    return list(outputs[0].outputs[0].token_ids)


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == awq.__name__]


def test_an_engine_loads_the_baked_calibration_and_quantizes_as_if_it_had_calibrated(
    tiny_llama: Path,
    baked: list[Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    files, baked_dir = baked, baked[0].parent
    listing = json.loads((baked_dir / bake.MARKER).read_text())
    assert listing == {c.describe(): f.name for c, f in zip(bake.DEFAULTS, files, strict=True)}
    assert set(listing) == {"int8-awq", "int4-awq-g32"}  # int4 defaults to groups of 32
    assert all(f.is_file() for f in files)

    for quantization in ("int8", "int4"):
        # A pod: the image's folder, read-only, and an empty cache of its own.
        cache = tmp_path / f"pod-cache-{quantization}"
        monkeypatch.setenv("LADLE_CACHE_DIR", str(cache))
        monkeypatch.setenv(bake.ENV, str(baked_dir))
        baked_dir.chmod(0o555)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=awq.__name__):
            from_baked = greedy(tiny_llama, quantization)
        baked_dir.chmod(0o755)
        assert messages(caplog) == ["using the baked AWQ calibration"], messages(caplog)
        assert not (cache / "calibration").exists()
        # The same tokens as an engine that calibrated itself from nothing.
        monkeypatch.delenv(bake.ENV)
        monkeypatch.setenv("LADLE_CACHE_DIR", str(tmp_path / f"fresh-{quantization}"))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=awq.__name__):
            assert greedy(tiny_llama, quantization) == from_baked
        assert "calibrating AWQ on the Python language reference" in messages(caplog)


def test_a_calibration_baked_for_other_model_files_is_not_taken(
    tiny_llama: Path,
    baked: list[Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The same weights, written again: the files' times are part of the name.
    other = tmp_path / "other"
    shutil.copytree(tiny_llama, other, copy_function=shutil.copy)
    monkeypatch.setenv("LADLE_CACHE_DIR", str(tmp_path / "pod-cache"))
    monkeypatch.setenv(bake.ENV, str(baked[0].parent))
    with caplog.at_level(logging.INFO, logger=awq.__name__):
        greedy(other, "int8")
    assert "calibrating AWQ on the Python language reference" in messages(caplog)
    assert len(list((tmp_path / "pod-cache" / "calibration").glob("awq-*.safetensors"))) == 1
