"""Pick the attention implementation for a device."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ladle.runtime.attention.backend import AttentionBackend
from ladle.runtime.attention.cpu_backend import CpuAttentionBackend, cpu_kernel_supports
from ladle.runtime.attention.torch_backend import TorchAttentionBackend
from ladle.runtime.config import ConfigError
from ladle.runtime.kernels import cpu_kernels, interpreting, triton_available

BACKENDS: dict[str, type[AttentionBackend]] = {
    TorchAttentionBackend.name: TorchAttentionBackend,
    CpuAttentionBackend.name: CpuAttentionBackend,
}


def _load_triton() -> type[AttentionBackend]:
    from ladle.runtime.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend


# Backends that import optional packages load on first use: importing Triton decorates its
# kernels, which must happen after TRITON_INTERPRET is set when running them on CPU.
LAZY_BACKENDS: dict[str, Callable[[], type[AttentionBackend]]] = {"triton": _load_triton}


def _auto(device: torch.device, kv_dtype: torch.dtype, dtype: torch.dtype) -> str:
    if device.type == "cuda":
        return "triton" if triton_available() else "torch"
    if cpu_kernel_supports(kv_dtype, device, dtype) and cpu_kernels.load() is not None:
        return "cpu"
    return "torch"


def select_backend(
    name: str, device: torch.device, kv_dtype: torch.dtype, dtype: torch.dtype = torch.float32
) -> type[AttentionBackend]:
    """``auto`` means the Triton kernels on CUDA when Triton is installed, the C kernels on CPU
    when they build (fp32 activations, fp32, fp16 or int8 caches), the torch path otherwise.
    ``triton`` on CPU needs ``TRITON_INTERPRET=1`` (slow; for tests)."""
    if name == "auto":
        name = _auto(device, kv_dtype, dtype)
    if name == CpuAttentionBackend.name and not cpu_kernel_supports(kv_dtype, device, dtype):
        raise ConfigError(
            f"attention backend 'cpu' runs fp32 models on the CPU (with an fp32, fp16 or int8 KV "
            f"cache), not {str(dtype).removeprefix('torch.')} on {device.type}"
        )
    if name in BACKENDS:
        return BACKENDS[name]
    known = ", ".join([*BACKENDS, *LAZY_BACKENDS])
    if name not in LAZY_BACKENDS:
        raise ConfigError(f"attention backend {name!r} is unknown; known: {known}")
    if name == "triton":
        if not triton_available():
            raise ConfigError("attention backend 'triton' needs the triton package")
        if device.type != "cuda" and not interpreting():
            raise ConfigError(
                "attention backend 'triton' runs on CUDA, or on CPU only with TRITON_INTERPRET=1"
            )
    return LAZY_BACKENDS[name]()
