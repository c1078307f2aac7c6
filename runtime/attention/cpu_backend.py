"""Attention for CPUs: the torch path, with decodes read straight from the paged cache.

Decode attention on a CPU is bound by memory traffic. The torch path gathers every decoding
sequence's blocks into a workspace and then reads that copy in SDPA, so it moves the context
three times; the C kernel (``kernels/cpu_kernels.c``) reads it once. Prefill chunks run in one
C call for the whole step as well (varlen, straight from the cache), instead of one SDPA call
per sequence.

An fp16 cache (``--kv-cache-dtype float16``, llama.cpp's default cache type) is rounded on store
and widened on read by the same kernels: half fp32's memory and traffic. With an int8 cache
(per-(token, head) scales, the Triton backend's format) the C kernels quantize on store and read
int8 in decode: a quarter of fp32's. Its prefills take the torch path, which dequantizes the
blocks they read (there is no int8 C prefill yet).
"""

from __future__ import annotations

import ctypes

import torch

from ladle.runtime.attention.backend import AttentionMetadata, KVCacheSpec, LayerKVCache
from ladle.runtime.attention.torch_backend import TorchAttentionBackend
from ladle.runtime.config import ConfigError
from ladle.runtime.kernels import cpu_kernels, quant_ops


def cpu_kernel_supports(
    kv_dtype: torch.dtype, device: torch.device, dtype: torch.dtype = torch.float32
) -> bool:
    """The C kernels take fp32 activations and an fp32, fp16 or int8 cache."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and kv_dtype in (*cpu_kernels.KV_DTYPES, torch.int8)
    )


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, spec: KVCacheSpec, device: torch.device) -> None:
        if not cpu_kernel_supports(spec.dtype, device):
            raise ConfigError(
                f"attention backend 'cpu' needs an fp32, fp16 or int8 KV cache on the CPU, not "
                f"{spec.dtype} on {device.type}"
            )
        lib = cpu_kernels.load()
        if lib is None:
            raise ConfigError("attention backend 'cpu' needs a C compiler (see the log)")
        super().__init__(spec, device)
        self._lib: ctypes.CDLL = lib
        self._prefill_starts = torch.zeros(1, dtype=torch.int32)

    def _store(
        self, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata
    ) -> None:
        if cache.key_scale is None or cache.value_scale is None:
            cpu_kernels.store_kv(self._lib, k, v, cache.key, cache.value, meta.slot_mapping)
            return
        quant_ops.store_kv_int8(
            self._lib,
            k,
            v,
            cache.key,
            cache.value,
            cache.key_scale,
            cache.value_scale,
            meta.slot_mapping,
        )

    def begin_step(self, meta: AttentionMetadata) -> None:
        """Nothing to gather or mask: the kernels follow the block tables themselves. The
        prefill chunks' row offsets are taken relative to the first of them, once a step. (An
        int8 cache's prefills take the torch path, with its masks.)"""
        nd = meta.num_decodes
        self._prefill_starts = meta.query_start_loc[nd:] - meta.query_start_loc_cpu[nd]
        if self.spec.dtype == torch.int8:
            self._begin_prefills(meta)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        nd = meta.num_decodes
        if nd == meta.num_seqs:
            return
        if cache.key_scale is not None:
            super()._prefill(q, k, v, cache, meta, scale, out)
            return
        start = meta.query_start_loc_cpu[nd]
        cpu_kernels.paged_prefill_attention(
            self._lib,
            q[start:],
            cache.key,
            cache.value,
            meta.block_tables[nd:],
            meta.seq_lens[nd:],
            self._prefill_starts,
            scale,
            out[start:],
        )

    def _decode(
        self,
        q: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        nd = meta.num_decodes
        if cache.key_scale is not None and cache.value_scale is not None:
            quant_ops.paged_decode_attention_int8(
                self._lib,
                q[:nd],
                cache.key,
                cache.value,
                cache.key_scale,
                cache.value_scale,
                meta.block_tables,
                meta.seq_lens,
                scale,
                out[:nd],
            )
            return
        cpu_kernels.paged_decode_attention(
            self._lib,
            q[:nd],
            cache.key,
            cache.value,
            meta.block_tables,
            meta.seq_lens,
            scale,
            out[:nd],
        )
