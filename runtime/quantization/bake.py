"""Bake the default model's AWQ calibrations into an image: ``python -m
ladle.runtime.quantization.bake DIR``.

A pod's cache folder starts empty, so a pod quantizing with AWQ calibrates at every start:
6-19 s for SmolLM2-135M on two cores (int8, by CPU), before it can serve. The runtime image
(``Dockerfile.runtime``) and the local node agent's image bake the calibrations for what
``--quantization int8`` and ``--quantization int4`` mean by default, into ``DIR``, which
``$LADLE_CALIBRATION_DIR`` then names. A calibration's file name carries the model's files and
the settings, so one baked for another model or other settings is never taken; those still
calibrate at start.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from ladle import logs
from ladle.runtime.config import EngineArgs, QuantizationConfig

# What --quantization int8 and --quantization int4 are with no other quantization flag.
DEFAULTS = tuple(EngineArgs(quantization=w).quantization_config() for w in ("int8", "int4"))
# Written last: its presence says the folder is complete.
MARKER = "baked.json"
# The folder of baked calibrations a runtime reads (read-only) before its own cache.
ENV = "LADLE_CALIBRATION_DIR"


def source_key() -> str:
    """Names the calibration code a folder was baked by (without importing it, or torch), so
    that a host keeps one folder per version of it."""
    source = Path(__file__).with_name("awq.py").read_bytes()
    return hashlib.sha256(source).hexdigest()[:16]


def bake(
    folder: Path, model: str | None = None, configs: Sequence[QuantizationConfig] = DEFAULTS
) -> list[Path]:
    """Calibrate ``model`` (the embedded default when None) for each of ``configs`` into
    ``folder``, which a later calibration run also reads."""
    from ladle.runtime.engine import LLMEngine
    from ladle.runtime.quantization import awq

    files = []
    for config in configs:
        # A fresh full-precision model each time: calibrate from the weights as loaded.
        engine = LLMEngine(EngineArgs(model=model, kv_cache_memory=16 << 20, max_model_len=256))
        awq.calibration_for(engine.model, config, engine.model_path, folder)
        files.append(folder / awq.calibration_file(engine.model_path, config))
    listing = {c.describe(): f.name for c, f in zip(configs, files, strict=True)}
    (folder / MARKER).write_text(json.dumps(listing, indent=1) + "\n")
    return files


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="where the calibrations go")
    args = parser.parse_args(argv)
    # The calibration logs its progress as JSON lines (under a minute for the two).
    logs.configure("info")
    for path in bake(args.folder):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
