"""The forward pass's small ops: plain torch, our C kernels for CPUs, or fused Triton kernels.

The model calls these through one object, chosen with its attention backend: the Triton
backend brings the fused kernels (on CUDA, or on CPU under the interpreter), the CPU backend its C
kernels, the torch backend keeps plain torch. ``add_rms_norm`` adds a sublayer's output into
the residual stream and normalizes the sum; ``rope`` takes each token's cos/sin rows, gathered
once per step.
"""

from __future__ import annotations

import ctypes
from typing import Protocol

import torch
import torch.nn.functional as F

from ladle.runtime.kernels import cpu_kernels


class ModelOps(Protocol):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...


class TorchOps:
    """Plain torch; the numerics the model always had (transformers-style rotate-half RoPE)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class TritonOps:
    """Fused Triton kernels; RoPE rotates Q and K in place inside the QKV output."""

    def __init__(self) -> None:
        from ladle.runtime.kernels import fused

        self._fused = fused

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._fused.rms_norm(x, weight, eps)[0]

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, new_residual = self._fused.rms_norm(x, weight, eps, residual)
        assert new_residual is not None
        return out, new_residual

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._fused.rotary_embedding(q, k, cos, sin)
        return q, k

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._fused.silu_and_mul(x)


class CpuOps:
    """Our C kernels: on a CPU, torch spends more on dispatching the many small ops of a norm,
    a rotation or an activation than on their arithmetic, and makes a pass over memory for
    each. RoPE rotates Q and K in place inside the QKV output, as the Triton kernel does."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return cpu_kernels.rms_norm(self._lib, x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return cpu_kernels.rms_norm(self._lib, x, weight, eps, residual), residual

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cpu_kernels.rope_(self._lib, q, k, cos, sin)
        return q, k

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.silu_and_mul(self._lib, x)


def ops_for_backend(attention_backend: str) -> ModelOps:
    """Each attention backend brings its own small ops: Triton's fused kernels, the CPU
    backend's C kernels; the torch backend keeps torch."""
    if attention_backend == "triton":
        return TritonOps()
    if attention_backend == "cpu":
        lib = cpu_kernels.load()
        assert lib is not None, "the cpu backend exists only once its kernels are built"
        return CpuOps(lib)
    return TorchOps()
