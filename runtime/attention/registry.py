"""Pick the attention implementation for a device."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ladle.runtime.attention.backend import AttentionBackend
from ladle.runtime.attention.torch_backend import TorchAttentionBackend
from ladle.runtime.config import ConfigError
from ladle.runtime.kernels import interpreting, triton_available

BACKENDS: dict[str, type[AttentionBackend]] = {TorchAttentionBackend.name: TorchAttentionBackend}


def _load_triton() -> type[AttentionBackend]:
    from ladle.runtime.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend


# Backends that import optional packages load on first use: importing Triton decorates its
# kernels, which must happen after TRITON_INTERPRET is set when running them on CPU.
LAZY_BACKENDS: dict[str, Callable[[], type[AttentionBackend]]] = {"triton": _load_triton}


def select_backend(name: str, device: torch.device) -> type[AttentionBackend]:
    """``auto`` means the Triton kernels on CUDA when Triton is installed, the torch path
    otherwise. ``triton`` on CPU needs ``TRITON_INTERPRET=1`` (slow; for tests)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_available() else "torch"
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
