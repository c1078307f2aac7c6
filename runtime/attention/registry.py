"""Pick the attention implementation for a device."""

from __future__ import annotations

import torch

from ladle.runtime.attention.backend import AttentionBackend
from ladle.runtime.attention.torch_backend import TorchAttentionBackend
from ladle.runtime.config import ConfigError

BACKENDS: dict[str, type[AttentionBackend]] = {TorchAttentionBackend.name: TorchAttentionBackend}


def select_backend(name: str, device: torch.device) -> type[AttentionBackend]:
    """``auto`` means the Triton kernels on CUDA when available, the torch path otherwise."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and "triton" in BACKENDS else "torch"
    if name not in BACKENDS:
        raise ConfigError(f"attention backend {name!r} is unknown; known: {', '.join(BACKENDS)}")
    return BACKENDS[name]
