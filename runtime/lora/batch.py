"""Which adapter slot each row of one step uses, and the call that applies them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ladle.runtime.kernels.lora import Segment, add_lora_segments
from ladle.runtime.lora.slots import ProjectionLoRA


@dataclass
class LoRABatch:
    # Runs of rows that share an adapter (the base model's rows are in none).
    segments: list[Segment]
    # [rows] int32 on the model's device, -1 for the base model: the Triton kernels' input.
    row_slots: torch.Tensor
    triton: bool

    @classmethod
    def build(
        cls, seq_slots: list[int], seq_rows: list[int], device: torch.device, triton: bool
    ) -> LoRABatch | None:
        """From each sequence's slot (-1: none) and row count, in batch order; None when no
        sequence uses an adapter, so that the step runs as the base model's."""
        if all(slot < 0 for slot in seq_slots):
            return None
        segments: list[Segment] = []
        row = 0
        for slot, rows in zip(seq_slots, seq_rows, strict=True):
            if slot >= 0 and segments and segments[-1][2] == slot and segments[-1][1] == row:
                segments[-1] = (segments[-1][0], row + rows, slot)
            elif slot >= 0:
                segments.append((row, row + rows, slot))
            row += rows
        per_row = [s for s, rows in zip(seq_slots, seq_rows, strict=True) for _ in range(rows)]
        row_slots = torch.tensor(per_row, dtype=torch.int32, device=device)
        return cls(segments, row_slots, triton)

    def add(self, proj: ProjectionLoRA, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y += x @ (each row's adapter)``, in place."""
        if self.triton:
            from ladle.runtime.kernels.lora_triton import add_lora_rows

            add_lora_rows(x, y, proj, self.row_slots)
        else:
            add_lora_segments(x, y, proj, self.segments)
