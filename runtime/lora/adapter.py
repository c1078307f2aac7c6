"""Read a PEFT LoRA adapter folder (``adapter_config.json`` plus ``adapter_model.safetensors``)
into per-projection A and B matrices, checked against the base model.

Everything a user can get wrong is found here, at load, with a message that names it: a rank
above ``--max-lora-rank``, a missing file, a module we cannot serve, or shapes that show the
adapter was made for another base model. The scaling (``lora_alpha / r``, or ``/ sqrt(r)`` for
rsLoRA, per module where ``alpha_pattern`` says so) is folded into B, so the kernels compute
``y += (x @ A.T) @ B.T``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ladle.runtime.errors import RequestError
from ladle.runtime.models.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# HF module name -> (our fused projection, slice within it), as the model fuses them.
MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


class LoRAError(RequestError):
    """An adapter that cannot be served; the message says what to fix."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "lora_path")


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter's weights on the CPU: ``(layer, HF module) -> (A [r, in], B [out, r])``,
    B already scaled."""

    name: str
    path: Path
    rank: int
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    base_model: str | None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection an adapter may target."""
    h, i = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (h, config.q_size),
        "k_proj": (h, config.kv_size),
        "v_proj": (h, config.kv_size),
        "o_proj": (config.q_size, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def load_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> LoRAAdapter:
    folder = Path(path)
    where = f"LoRA adapter {name!r} at {folder}"
    settings = _read_config(folder, where)
    _check_supported(settings, where)
    tensors = _read_tensors(folder, where)
    shapes = module_shapes(config)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoRAError(
                f"{where}: cannot serve the weight {key!r}; adapters may target "
                f"{', '.join(MODULES)} of the model's layers"
            )
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        if module not in MODULES:
            raise LoRAError(
                f"{where}: cannot serve a LoRA on {module!r}; "
                f"supported modules: {', '.join(MODULES)}"
            )
        if layer >= config.num_layers:
            raise LoRAError(
                f"{where}: has layer {layer}, but the base model has {config.num_layers} layers; "
                "the adapter was made for another base model"
            )
        pairs.setdefault((layer, module), {})[which] = tensor.float()
    if not pairs:
        raise LoRAError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    ranks = set()
    for (layer, module), ab in sorted(pairs.items()):
        label = f"layers.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"{where}: {label} has lora_{''.join(ab)} but not both A and B")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = shapes[module]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != fan_in or b.shape[0] != fan_out:
            raise LoRAError(
                f"{where}: {label} maps {a.shape[-1]} -> {b.shape[0]} features where the base "
                f"model's maps {fan_in} -> {fan_out}; the adapter was made for another base model"
            )
        rank = a.shape[0]
        if b.shape[1] != rank:
            raise LoRAError(f"{where}: {label} has A of rank {rank} but B of rank {b.shape[1]}")
        if rank > max_rank:
            raise LoRAError(
                f"{where}: rank {rank} exceeds --max-lora-rank {max_rank}; raise it or use an "
                "adapter of lower rank"
            )
        ranks.add(rank)
        scale = _scaling(settings, f"model.layers.{layer}.{module}", rank)
        modules[(layer, module)] = (a.contiguous(), (b * scale).contiguous())
    base = settings.get("base_model_name_or_path")
    return LoRAAdapter(name, folder, max(ranks), modules, base if isinstance(base, str) else None)


def _read_config(folder: Path, where: str) -> dict[str, Any]:
    if not folder.is_dir():
        raise LoRAError(f"{where}: no such folder")
    file = folder / CONFIG_FILE
    try:
        settings = json.loads(file.read_text())
    except FileNotFoundError:
        raise LoRAError(f"{where}: {CONFIG_FILE} is missing; expected a PEFT adapter") from None
    except (OSError, ValueError) as exc:
        raise LoRAError(f"{where}: cannot read {CONFIG_FILE}: {exc}") from None
    if not isinstance(settings, dict):
        raise LoRAError(f"{where}: {CONFIG_FILE} must hold a JSON object")
    return settings


def _check_supported(settings: dict[str, Any], where: str) -> None:
    peft_type = settings.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(f"{where}: peft_type {peft_type!r} is not supported (only LORA)")
    refused = {
        "use_dora": "DoRA",
        "modules_to_save": "modules_to_save (fully trained extra modules)",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D weights)",
    }
    for key, what in refused.items():
        if settings.get(key):
            raise LoRAError(f"{where}: {what} is not supported")
    if settings.get("bias", "none") != "none":
        raise LoRAError(f"{where}: bias {settings['bias']!r} is not supported (only none)")
    if not isinstance(settings.get("lora_alpha", 8), int | float):
        raise LoRAError(f"{where}: lora_alpha must be a number")


def _read_tensors(folder: Path, where: str) -> dict[str, torch.Tensor]:
    file = folder / WEIGHTS_FILE
    if not file.is_file():
        found = (
            "adapter_model.bin is there, but only safetensors are read; "
            if (folder / "adapter_model.bin").is_file()
            else ""
        )
        raise LoRAError(f"{where}: {WEIGHTS_FILE} is missing; {found}save with safe_serialization")
    try:
        with safe_open(str(file), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a mapping
    except (OSError, SafetensorError) as exc:
        raise LoRAError(f"{where}: cannot read {WEIGHTS_FILE}: {exc}") from None


def _scaling(settings: dict[str, Any], module: str, rank: int) -> float:
    """PEFT's rule: ``alpha_pattern`` (a key matching the module's name or a suffix of it)
    overrides ``lora_alpha``; rsLoRA divides by sqrt(r) instead of r."""
    alpha = float(settings.get("lora_alpha", 8))
    for pattern, value in (settings.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?{pattern}$", module):
            alpha = float(value)
            break
    return alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
