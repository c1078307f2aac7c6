"""Batched LoRA: the Triton kernels (interpreted on CPU) and the torch segments against a plain
per-row reference built from the adapters' own matrices, and a whole engine through the Triton
kernels against the torch path, for a batch that mixes adapters and the base model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from lora_adapters import random_adapter as peft_adapter
from transformers import Qwen3Config

from ladle.runtime import LLM, LoRARequest, SamplingParams
from ladle.runtime.kernels.lora import add_lora_segments
from ladle.runtime.kernels.lora_triton import add_lora_rows
from ladle.runtime.lora.adapter import MODULES, LoRAAdapter, module_shapes
from ladle.runtime.lora.batch import LoRABatch
from ladle.runtime.lora.slots import PROJECTIONS, LoRASlots
from ladle.runtime.models.config import model_config_from_hf

from .conftest import DEVICE
from .test_engine import PaddingSpy

# GQA with head_dim 32: q, k and v slices of unequal widths (128, 64, 64).
CONFIG = model_config_from_hf(
    Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        architectures=["Qwen3ForCausalLM"],
    )
)
MAX_RANK = 8


def random_adapter(name: str, rank: int, modules: tuple[str, ...], seed: int) -> LoRAAdapter:
    gen = torch.Generator().manual_seed(seed)
    shapes = module_shapes(CONFIG)
    weights = {
        (layer, m): (
            torch.randn(rank, shapes[m][0], generator=gen),
            torch.randn(shapes[m][1], rank, generator=gen) * 0.1,
        )
        for layer in range(CONFIG.num_layers)
        for m in modules
    }
    return LoRAAdapter(name, Path(name), rank, weights, None)


ADAPTERS = [
    random_adapter("all", 8, tuple(MODULES), seed=1),
    random_adapter("qv", 4, ("q_proj", "v_proj"), seed=2),
    random_adapter("mlp", 5, ("gate_proj", "down_proj"), seed=3),
]


def reference(
    x: torch.Tensor, layer: int, projection: str, row_adapters: list[LoRAAdapter | None]
) -> torch.Tensor:
    """Each row's delta, module by module, from the adapter's own A and B."""
    slices = [m for m, (p, _) in MODULES.items() if p == projection]
    widths = [module_shapes(CONFIG)[m][1] for m in slices]
    rows = []
    for row, adapter in zip(x.double(), row_adapters, strict=True):
        parts = []
        for module, width in zip(slices, widths, strict=True):
            ab = None if adapter is None else adapter.modules.get((layer, module))
            if ab is None:
                parts.append(torch.zeros(width, dtype=torch.float64))
            else:
                a, b = ab
                parts.append(b.double() @ (a.double() @ row))
        rows.append(torch.cat(parts))
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_ways_add_each_rows_adapter(dtype: torch.dtype) -> None:
    slots = LoRASlots(CONFIG, max_loras=3, max_rank=MAX_RANK, dtype=dtype, device=DEVICE)
    # Slot order differs from adapter order: the kernels must follow the slot, not the name.
    placed = {2: ADAPTERS[0], 0: ADAPTERS[1], 1: ADAPTERS[2]}
    # Overwritten below by adapters of lower rank and fewer targets: nothing may linger.
    slots.write(0, ADAPTERS[0])
    slots.write(1, ADAPTERS[0])
    for slot, adapter in placed.items():
        slots.write(slot, adapter)
    # Rows as the model runner orders them: runs of one slot, base rows between.
    row_slot = [-1, 2, 2, 0, -1, 1, 1, 1, 2]
    seq_slots, seq_rows = [-1, 2, 0, -1, 1, 2], [1, 2, 1, 1, 3, 1]
    batch = LoRABatch.build(seq_slots, seq_rows, DEVICE, triton=False)
    assert batch is not None
    assert batch.row_slots.tolist() == row_slot
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.manual_seed(0)
    for layer in range(CONFIG.num_layers):
        for name in PROJECTIONS:
            proj = getattr(slots.layers[layer], name)
            x = torch.randn(len(row_slot), proj.in_features, device=DEVICE).to(dtype)
            y = torch.randn(len(row_slot), proj.b.shape[1], device=DEVICE).to(dtype)
            adapters = [None if s < 0 else placed[s] for s in row_slot]
            expected = y.double().cpu() + reference(x.cpu(), layer, name, adapters)
            scale = float(expected.abs().max())
            for label, add in (
                ("segments", lambda x, y, p: add_lora_segments(x, y, p, batch.segments)),
                ("triton", lambda x, y, p: add_lora_rows(x, y, p, batch.row_slots)),
            ):
                out = y.clone()
                add(x, out, proj)
                err = float((out.double().cpu() - expected).abs().max()) / scale
                assert err < tolerance, f"{label}: layer {layer} {name}: error {err:.1e}"


def test_a_batch_without_adapters_is_none() -> None:
    assert LoRABatch.build([-1, -1], [3, 1], DEVICE, triton=True) is None


@pytest.mark.slow
def test_triton_engine_with_adapters_equals_torch_engine(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """Per op, and through the CUDA-graph runner's padded static inputs (run eagerly here),
    where each row's adapter slot is one more static input."""
    path = tiny_model("llama")
    folders = [peft_adapter(path, tmp_path / f"a{i}", seed=i, rank=4 * (i + 1)) for i in range(2)]
    prompts = [[5, 17, 300, 42, 9], list(range(100, 123)), [7, 8]]
    adapters = [LoRARequest("a0", 1, str(folders[0])), None, LoRARequest("a1", 2, str(folders[1]))]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    spies: list[PaddingSpy] = []

    def generate(backend: str, graphs: bool = False) -> list[list[int]]:
        llm = LLM(
            str(path),
            attention_backend=backend,
            device=DEVICE.type,
            dtype="float32",
            block_size=4,
            max_num_batched_tokens=16,
            kv_cache_memory="1MiB",
            enforce_eager=True,
            enable_lora=True,
            max_loras=2,
        )
        if graphs:
            spies.append(PaddingSpy.install(llm))
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=adapters)
        return [list(o.outputs[0].token_ids) for o in outs]

    expected = generate("torch")
    assert generate("triton") == expected
    assert generate("triton", graphs=True) == expected
    assert (3, 4) in spies[0].padded, "the mixed decode batch never took the graph runner's path"
