"""Attention backends: the torch path for CPU, Triton kernels for CUDA."""

from ladle.runtime.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    KVCacheSpec,
    LayerKVCache,
)

__all__ = ["AttentionBackend", "AttentionMetadata", "KVCacheSpec", "LayerKVCache"]
