"""The quantized kernels' Python side (``quant_kernels.c``, ``a8_kernels.c``): int8 and int4
weight products, and the int8 KV cache's store and decode attention. The library comes from
:func:`ladle.runtime.kernels.cpu_kernels.load`."""

from __future__ import annotations

import ctypes

import torch

from ladle.runtime.quantization.formats import PANEL, GroupWeight, Int8Weight, check_group_size

# What ``ladle_quant_isa`` reports about the build.
ISA_NAMES = {2: "avx512", 1: "avx2", 0: "portable"}


def isa(lib: ctypes.CDLL) -> str:
    """The instruction set the quantized kernels were built for: avx512, avx2 or portable."""
    return ISA_NAMES[int(lib.ladle_quant_isa())]


def a8_supported(lib: ctypes.CDLL) -> bool:
    """Whether this CPU runs products of int4 weights with int8 activations (VNNI), which a
    draft model's weights may then carry (``formats.pack_a8``)."""
    return bool(lib.ladle_a8_supported())


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as [M, K] rows with unit column stride (a view when it already is one)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


# Rows from which a product dequantizes the whole weight to fp32 and multiplies with torch's
# GEMM (prefill, and the evaluation's scoring requests); below, our tiles and GEMVs, which read
# the weight's codes once. On the default model's shapes (``bench/quant_gemm.py``, AVX-512, two
# threads) the two tie at 128 rows and the GEMM is 1.15-1.3x faster at 256, 1.4-1.5x at 512.
DEQUANTIZE_ROWS = 192


def linear(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    weight: Int8Weight | GroupWeight,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``x @ W.T + bias`` for x fp32 [..., K] and a weight in the formats of
    ``ladle.runtime.quantization.formats``."""
    rows = _rows(x)
    n, k = weight.shape
    assert x.dtype == torch.float32
    assert rows.shape[1] == k
    for t in weight.tensors():
        assert t.is_contiguous()
    if bias is not None:
        assert bias.dtype == torch.float32
    if rows.shape[0] >= DEQUANTIZE_ROWS:
        dense = dequantize(lib, weight)[:, :n]
        out = rows @ dense if bias is None else torch.addmm(bias, rows, dense)
        return out.reshape(*x.shape[:-1], n)
    panels = weight.qweight.shape[0]
    if bias is not None:
        # The kernels write whole panels; a partial last one needs a padded bias.
        bias = torch.nn.functional.pad(bias, (0, panels * PANEL - n)).contiguous()
    out = x.new_empty((rows.shape[0], panels * PANEL))
    common = (rows.data_ptr(), rows.stride(0))
    tail = (out.data_ptr(), out.stride(0), rows.shape[0], panels, k)
    bias_ptr = None if bias is None else bias.data_ptr()
    if isinstance(weight, Int8Weight):
        failed = lib.ladle_linear_i8(
            *common,
            weight.qweight.data_ptr(),
            weight.scale.data_ptr(),
            bias_ptr,
            *tail,
            torch.get_num_threads(),
        )
    else:
        check_group_size(weight.group_size)
        failed = lib.ladle_linear_groups(
            *common,
            weight.qweight.data_ptr(),
            weight.scale.data_ptr(),
            weight.offset.data_ptr(),
            bias_ptr,
            *tail,
            weight.group_size,
            weight.bits,
            None if weight.a8 is None else weight.a8.data_ptr(),
            torch.get_num_threads(),
        )
    if failed:
        raise MemoryError("the quantized GEMM could not allocate its buffers")
    return out[:, :n].reshape(*x.shape[:-1], n)


def dequantize(lib: ctypes.CDLL, weight: Int8Weight | GroupWeight) -> torch.Tensor:
    """The weight in fp32 as [K, 16 P] (transposed, padded channels zero), for one product:
    a transient copy, so the model's resident weights stay quantized."""
    panels = weight.qweight.shape[0]
    k = weight.shape[1]
    out = torch.empty((k, panels * PANEL), dtype=torch.float32)
    threads = torch.get_num_threads()
    if isinstance(weight, Int8Weight):
        lib.ladle_dequantize_i8(
            weight.qweight.data_ptr(), weight.scale.data_ptr(), out.data_ptr(), panels, k, threads
        )
    else:
        check_group_size(weight.group_size)
        lib.ladle_dequantize_groups(
            weight.qweight.data_ptr(),
            weight.scale.data_ptr(),
            weight.offset.data_ptr(),
            out.data_ptr(),
            panels,
            k,
            weight.group_size,
            weight.bits,
            threads,
        )
    return out


def store_kv_int8(
    lib: ctypes.CDLL,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_scale: torch.Tensor,
    value_scale: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Quantize each (token, KV head) row of k and v ([T, Hkv, D] fp32, possibly QKV row
    views) into its slot of the int8 caches, with its scale; slot -1 is skipped."""
    tokens, num_kv_heads, head_dim = k.shape
    assert k.dtype == v.dtype == key_scale.dtype == torch.float32
    assert key_cache.dtype == value_cache.dtype == torch.int8
    assert k.stride()[1:] == v.stride()[1:] == (head_dim, 1)
    for t in (key_cache, value_cache, key_scale, value_scale, slots):
        assert t.is_contiguous()
    assert slots.dtype == torch.int64
    lib.ladle_store_kv_i8(
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        key_scale.data_ptr(),
        value_scale.data_ptr(),
        slots.data_ptr(),
        tokens,
        num_kv_heads,
        head_dim,
    )


def paged_decode_attention_int8(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_scale: torch.Tensor,
    value_scale: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """:func:`paged_decode_attention` over an int8 cache with per-(slot, KV head) scales
    ``[num_blocks, block_size, num_kv_heads]``."""
    for t in (key_cache, value_cache, key_scale, value_scale, out, seq_lens):
        assert t.is_contiguous()
    assert key_cache.dtype == value_cache.dtype == torch.int8
    assert q.dtype == out.dtype == key_scale.dtype == value_scale.dtype == torch.float32
    assert q.stride()[1:] == (q.shape[2], 1)
    assert block_tables.stride(1) == 1
    assert block_tables.dtype == seq_lens.dtype == torch.int32
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    failed = lib.ladle_paged_decode_attention_i8(
        q.data_ptr(),
        q.stride(0),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        key_scale.data_ptr(),
        value_scale.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        out.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError("CPU decode attention could not allocate its score buffer")
