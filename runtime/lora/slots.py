"""The resident adapters' weights on the model's device, as one stack per projection.

Each of the model's four fused projections gets ``a [max_loras, slices * max_rank, in]`` and
``b [max_loras, out, max_rank]``, zero where an adapter has a lower rank or leaves a slice
alone. A batch then needs only each row's slot to apply every adapter in one kernel call (the
punica/S-LoRA layout), and the stacks never move, so the fused CPU decode step can hold their
addresses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ladle.runtime.lora.adapter import MODULES, LoRAAdapter
from ladle.runtime.models.config import ModelConfig

PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")


@dataclass
class ProjectionLoRA:
    """One fused projection's stacks; slice ``i`` covers outputs ``bounds[i]`` and reads
    columns ``[i * rank, (i + 1) * rank)`` of the shrunk activations."""

    a: torch.Tensor  # [max_loras, slices * rank, in]
    b: torch.Tensor  # [max_loras, out, rank]
    bounds: tuple[tuple[int, int], ...]
    rank: int
    # The slices each slot's adapter targets; empty for a free slot.
    targets: list[frozenset[int]]

    @property
    def in_features(self) -> int:
        return self.a.shape[2]

    @property
    def slice_ends(self) -> tuple[int, ...]:
        return tuple(hi for _, hi in self.bounds)


@dataclass
class LayerLoRA:
    qkv: ProjectionLoRA
    o_proj: ProjectionLoRA
    gate_up: ProjectionLoRA
    down: ProjectionLoRA

    def projections(self) -> dict[str, ProjectionLoRA]:
        return {name: getattr(self, name) for name in PROJECTIONS}


def _slices(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Output sizes of each fused projection's slices, in ``MODULES`` order."""
    i = config.intermediate_size
    return {
        "qkv": (config.q_size, config.kv_size, config.kv_size),
        "o_proj": (config.hidden_size,),
        "gate_up": (i, i),
        "down": (config.hidden_size,),
    }


def _in_features(config: ModelConfig) -> dict[str, int]:
    h = config.hidden_size
    return {"qkv": h, "o_proj": config.q_size, "gate_up": h, "down": config.intermediate_size}


class LoRASlots:
    """``max_loras`` slots of adapter weights, one :class:`LayerLoRA` per model layer."""

    def __init__(
        self,
        config: ModelConfig,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.max_loras = max_loras
        self.rank = max_rank
        slices, fan_in = _slices(config), _in_features(config)
        self.layers: list[LayerLoRA] = []
        for _ in range(config.num_layers):
            parts = {}
            for name in PROJECTIONS:
                sizes = slices[name]
                ends = [sum(sizes[: j + 1]) for j in range(len(sizes))]
                bounds = tuple((end - size, end) for size, end in zip(sizes, ends, strict=True))
                a = torch.zeros(
                    max_loras, len(sizes) * max_rank, fan_in[name], dtype=dtype, device=device
                )
                b = torch.zeros(max_loras, ends[-1], max_rank, dtype=dtype, device=device)
                parts[name] = ProjectionLoRA(a, b, bounds, max_rank, [frozenset()] * max_loras)
            self.layers.append(LayerLoRA(**parts))

    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put an adapter's weights in a slot, replacing whatever was there."""
        targeted: dict[tuple[int, str], set[int]] = {}
        for layer in self.layers:
            for proj in layer.projections().values():
                proj.a[slot].zero_()
                proj.b[slot].zero_()
        for (layer_index, module), (a, b) in adapter.modules.items():
            name, index = MODULES[module]
            proj = getattr(self.layers[layer_index], name)
            rank, (lo, hi) = a.shape[0], proj.bounds[index]
            proj.a[slot, index * proj.rank : index * proj.rank + rank].copy_(a)
            proj.b[slot, lo:hi, :rank].copy_(b)
            targeted.setdefault((layer_index, name), set()).add(index)
        for layer_index, layer in enumerate(self.layers):
            for name, proj in layer.projections().items():
                proj.targets[slot] = frozenset(targeted.get((layer_index, name), ()))
