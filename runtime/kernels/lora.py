"""Batched LoRA: add each row's adapter, ``y += (x @ A[slot].T) @ B[slot].T``, to a fused
projection's output, for a batch that mixes adapters and the base model.

Two ways, as in punica and S-LoRA: :func:`add_lora_segments` runs a shrink and an expand per
run of rows that share an adapter (torch's GEMMs, for the CPU's per-op path, where prefill
chunks make long runs), and :func:`add_lora_rows` is one Triton shrink and one Triton expand
over the whole batch, each row gathering its own slot (``lora_triton.py``: the GPU's path,
and the CPU's under the Triton interpreter in tests). Small CPU decode batches apply LoRA
inside the fused decode step (``decode_step.c``). Slices of a fused projection (q, k and v
of ``qkv``) each read their own ``rank`` columns of the shrunk activations.
"""

from __future__ import annotations

import torch

from ladle.runtime.lora.slots import ProjectionLoRA

Segment = tuple[int, int, int]  # rows [start, end) use slot


def add_lora_segments(
    x: torch.Tensor, y: torch.Tensor, proj: ProjectionLoRA, segments: list[Segment]
) -> None:
    r = proj.rank
    for start, end, slot in segments:
        targets = proj.targets[slot]
        if not targets:
            continue
        shrunk = x[start:end] @ proj.a[slot].T
        for index in targets:
            lo, hi = proj.bounds[index]
            part = shrunk[:, index * r : (index + 1) * r]
            y[start:end, lo:hi].addmm_(part, proj.b[slot, lo:hi].T)
