"""Slot-mapped writes of new keys and values into the paged KV cache, with a torch reference.

Token ``t`` goes to flat slot ``slot_mapping[t]`` of ``[num_blocks * block_size, Hkv, D]``;
slot -1 marks a padded token (a CUDA-graph batch filled up to its captured size) and is skipped.

With an int8 cache every (token, head) row is quantized symmetrically with its own fp32 scale
``absmax / 127``, kept in ``[num_blocks, block_size, Hkv]`` beside the cache: per-row scales
keep one outlier token from costing every other token its precision.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ladle.runtime.quantization.formats import quantize_kv_rows


@triton.jit
def _store_rows(
    src_ptr: tl.tensor,
    head_stride: int,
    cache_ptr: tl.tensor,
    scale_ptr: tl.tensor,
    slot: tl.tensor,
    num_heads: int,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANTIZE: tl.constexpr,
) -> None:
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    hmask = heads < num_heads
    mask = hmask[:, None] & (cols[None, :] < HEAD_DIM)
    x = tl.load(src_ptr + heads[:, None] * head_stride + cols[None, :], mask=mask, other=0.0)
    dst = cache_ptr + (slot * num_heads + heads[:, None]) * HEAD_DIM + cols[None, :]
    if QUANTIZE:
        xf = x.to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(xf), axis=1) / 127.0, 1e-8)
        q = tl.floor(xf / scale[:, None] + 0.5)
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(dst, q.to(tl.int8), mask=mask)
        tl.store(scale_ptr + slot * num_heads + heads, scale, mask=hmask)
    else:
        tl.store(dst, x, mask=mask)


@triton.jit
def _store_kv_kernel(
    k_ptr: tl.tensor,
    v_ptr: tl.tensor,
    key_cache_ptr: tl.tensor,
    value_cache_ptr: tl.tensor,
    key_scale_ptr: tl.tensor,
    value_scale_ptr: tl.tensor,
    slot_ptr: tl.tensor,
    k_token_stride: int,
    k_head_stride: int,
    v_token_stride: int,
    v_head_stride: int,
    num_kv_heads: int,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANTIZE: tl.constexpr,
) -> None:
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        _store_rows(
            k_ptr + t * k_token_stride,
            k_head_stride,
            key_cache_ptr,
            key_scale_ptr,
            slot,
            num_kv_heads,
            HEAD_DIM,
            BLOCK_H,
            BLOCK_D,
            QUANTIZE,
        )
        _store_rows(
            v_ptr + t * v_token_stride,
            v_head_stride,
            value_cache_ptr,
            value_scale_ptr,
            slot,
            num_kv_heads,
            HEAD_DIM,
            BLOCK_H,
            BLOCK_D,
            QUANTIZE,
        )


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> None:
    """Write ``k``/``v`` [T, Hkv, D] (strided rows allowed) into the caches; int8 caches need
    their scale tensors and get quantized rows."""
    tokens, num_heads, head_dim = k.shape
    quantize = key_cache.dtype == torch.int8
    assert quantize == (key_scale is not None) == (value_scale is not None)
    assert key_cache.is_contiguous()
    assert value_cache.is_contiguous()
    assert k.stride(-1) == 1
    assert v.stride(-1) == 1
    if tokens == 0:
        return
    _store_kv_kernel[(tokens,)](
        k,
        v,
        key_cache,
        value_cache,
        key_scale if key_scale is not None else key_cache,
        value_scale if value_scale is not None else value_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        QUANTIZE=quantize,
    )


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    num_heads, head_dim = k.shape[1:]
    for src, cache, scales in ((k, key_cache, key_scale), (v, value_cache, value_scale)):
        rows = src[keep]
        flat = cache.view(-1, num_heads, head_dim)
        if scales is None:
            flat[slots] = rows.to(cache.dtype)
        else:
            q, s = quantize_kv_rows(rows)
            flat[slots] = q
            scales.view(-1, num_heads)[slots] = s
