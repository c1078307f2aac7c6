"""The model's linear layers and embeddings, full precision or quantized, behind one call.

The forward pass calls ``layer.qkv(x)``; what runs depends on how the weight is stored and on
the kernels the attention backend brings (``kernels`` below, as for the small ops):

* ``cpu``: our C kernels (``kernels/quant_kernels.c``), fp32 activations;
* ``triton``: the W8A16 / W4A16 Triton GEMMs (CUDA, or the CPU interpreter in tests);
* ``torch``: the reference, which dequantizes the weight for each call (slow; for checking).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F

from ladle.runtime.kernels import cpu_kernels, quant_ops
from ladle.runtime.quantization.formats import Int8Weight, QuantizedWeight

Kernels = Literal["cpu", "triton", "torch"]


class Linear(Protocol):
    def tensors(self) -> list[torch.Tensor]:
        """What it holds in memory (shared tensors appear in each holder)."""
        ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass
class DenseLinear:
    weight: torch.Tensor  # [N, K]
    bias: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight] + ([] if self.bias is None else [self.bias])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@dataclass
class QuantizedLinear:
    weight: QuantizedWeight
    bias: torch.Tensor | None
    kernels: Kernels

    def tensors(self) -> list[torch.Tensor]:
        return self.weight.tensors() + ([] if self.bias is None else [self.bias])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels == "cpu":
            lib = cpu_kernels.load()
            assert lib is not None, "the cpu kernels exist once the cpu backend was chosen"
            return quant_ops.linear(lib, x, self.weight, self.bias)
        if self.kernels == "triton":
            from ladle.runtime.kernels import quant_gemm

            return quant_gemm.quantized_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight.dequantize(x.dtype), self.bias)


@dataclass
class DenseEmbedding:
    weight: torch.Tensor  # [vocab, hidden]

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight]

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


@dataclass
class Int8Embedding:
    """Rows of an int8 table with per-row scales: the same tensor as a tied LM head quantized
    per output channel, so one int8 copy serves both."""

    weight: Int8Weight
    dtype: torch.dtype

    def tensors(self) -> list[torch.Tensor]:
        return self.weight.tensors()

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.rows(ids).to(self.dtype)


Embedding = DenseEmbedding | Int8Embedding
