"""PEFT LoRA adapters made for tests: random ones, and one trained for a few steps so that its
output visibly differs from the base model's (test tooling; no hub is reachable).

PEFT and transformers' models are imported inside each function: they import Triton's kernels,
and a process that does so before the kernel tests set ``TRITON_INTERPRET`` cannot run those
(tests/kernels/conftest.py). The end-to-end package, collected before the kernels, imports this
module.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_adapter(
    base: Path,
    folder: Path,
    seed: int,
    rank: int = 8,
    alpha: float = 16,
    targets: tuple[str, ...] = ALL_MODULES,
    **extra: object,
) -> Path:
    """An adapter whose A and B are both random (PEFT's ``init_lora_weights=False``), so every
    targeted module changes the output."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        init_lora_weights=False,
        **extra,  # type: ignore[arg-type]
    )
    get_peft_model(model, config).save_pretrained(folder)
    return folder


def trained_adapter(base: Path, folder: Path, prompt: list[int], target: list[int]) -> Path:
    """An adapter trained (PEFT's usual zero-initialized B) until the model answers ``prompt``
    with ``target``: a toy task whose greedy answer the base model does not give."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(0)
    peft = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    )
    ids = torch.tensor([prompt + target])
    labels = ids.clone()
    labels[0, : len(prompt)] = -100
    optimizer = torch.optim.Adam([p for p in peft.parameters() if p.requires_grad], lr=3e-2)
    peft.train()
    for _ in range(60):
        loss = peft(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    peft.save_pretrained(folder)
    return folder


def peft_model(base: Path, adapter: Path) -> PreTrainedModel:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged: PreTrainedModel = PeftModel.from_pretrained(model, adapter)
    merged.eval()
    return merged
