"""The whole engine through the Triton kernels (interpreted on CPU) equals the torch path.

Greedy decoding over tiny random models: fp32 on CPU, so any indexing or masking mistake in
any kernel changes tokens. The prompts cover a chunked prefill, a one-token prompt, a prefix
cache hit, and decode batches padded the way CUDA graphs pad them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ladle.runtime import LLM, SamplingParams
from ladle.runtime.attention.backend import AttentionMetadata
from ladle.runtime.cuda_graphs import DecodeGraphRunner, batch_size_ladder
from ladle.runtime.kernels.ops import TritonOps
from ladle.runtime.lora.batch import LoRABatch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PROMPTS: list[list[int]] = [
    [5, 17, 300, 42, 9],
    list(range(100, 123)),  # longer than the token budget: prefilled in chunks
    [7],
]
SHARED = [900 + i for i in range(10)]  # two full blocks of 4, then a divergent tail
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _engine(path: Path, backend: str, **flags: Any) -> LLM:
    return LLM(
        str(path),
        attention_backend=backend,
        **flags,
        device=DEVICE.type,
        dtype="float32",
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=16,
        kv_cache_memory="1MiB",
        enforce_eager=True,
    )


def _generate(llm: LLM) -> list[list[int]]:
    first = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    # Same 10-token prefix as an earlier request: its two full blocks come from the cache.
    llm.generate([[*SHARED, 1]], PARAMS, use_tqdm=False)
    second = llm.generate([[*SHARED, 2, 3]], PARAMS, use_tqdm=False)
    assert second[0].num_cached_tokens == 8
    return [list(o.outputs[0].token_ids) for o in [*first, *second]]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_engine_equals_torch_engine(
    arch: str, tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_model(arch)
    expected = _generate(_engine(path, "torch"))

    llm = _engine(path, "triton")
    assert llm.engine.attention.name == "triton"
    assert isinstance(llm.engine.model.ops, TritonOps)
    assert _generate(llm) == expected

    if arch == "qwen3":
        return  # one architecture suffices for the quantized formats
    # int8 weights and an int8 cache: the Triton kernels against the torch reference of the
    # same formats (which dequantizes in fp32), token for token. (int4 is checked kernel by
    # kernel in test_quant_kernels.py; another interpreted engine run would add minutes.)
    flags = {"quantization": "int8", "quantization_method": "rtn", "kv_cache_dtype": "int8"}
    quantized = _engine(path, "triton", **flags)
    assert quantized.engine.runner.forward.caches[0].key.dtype == torch.int8
    assert _generate(quantized) == _generate(_engine(path, "torch", **flags))

    llm = _engine(path, "triton")
    graphs = PaddingSpy.install(llm)
    assert _generate(llm) == expected
    # Decode steps of 3 sequences ran padded to 4; single ones ran unpadded.
    assert (3, 4) in graphs.padded
    assert (1, 1) in graphs.padded


class PaddingSpy(DecodeGraphRunner):
    """Records (batch, padded size) of every step that took the graph path."""

    @classmethod
    def install(cls, llm: LLM) -> PaddingSpy:
        """The graph runner's padded path, run eagerly, as ``llm``'s decode steps (block size
        4 and batches up to 8, as this folder's engines have)."""
        engine = llm.engine
        spy = cls(
            engine.model,
            engine.runner.forward.caches,
            max_batch=8,
            max_model_len=engine.max_model_len,
            block_size=4,
            device=DEVICE,
            use_graphs=False,
        )
        engine.runner.forward.graphs = spy
        return spy

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.padded: list[tuple[int, int]] = []

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        batch = meta.num_seqs
        self.padded.append((batch, next(s for s in self.sizes if s >= batch)))
        return super().run(input_ids, positions, meta, lora)


def test_batch_size_ladder() -> None:
    assert batch_size_ladder(1) == [1]
    assert batch_size_ladder(8) == [1, 2, 4, 8]
    assert batch_size_ladder(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_size_ladder(256)[-3:] == [224, 240, 256]
