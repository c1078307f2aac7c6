"""Paged attention in Triton: split-K decode here and varlen causal prefill in
``attention_prefill``, with what both share (the KV tile loader, the dots' dtype, warps) and
a torch reference.

Both kernels read keys and values through the block table from the cache
``[num_blocks, block_size, Hkv, D]`` (the new tokens were stored first), so prefix-cache hits
and earlier chunks of a chunked prefill need no special case. Both pack the query heads that
share a KV head into the rows of one tile (GQA packing): each key and value is loaded once per
KV head, not once per query head. Any block size works, since every key position looks its
block up in the table.

**Decode** (one query token per sequence) is flash-decoding: the context is cut into
``num_splits`` ranges, each program attends one range for one (sequence, KV head) and writes an
unnormalized partial plus its log-sum-exp, and a second kernel merges the splits. Splitting is
what keeps the GPU busy at small batch and long context; ``num_splits`` depends only on the
batch shape, so a CUDA graph captured once serves every context length.

**Prefill** tiles each sequence's new tokens; a query at absolute position ``p`` sees keys
``0..p``, and a tile stops reading keys after its last query's position.

**int8 KV**: per (token, head) scales (see ``kv_store``). The key scale multiplies a column of
the scores after the dot and the value scale multiplies a column of the probabilities before
it, so the int8 values enter the dots as exact small integers.

Under the Triton interpreter, dots are computed in fp32 (bf16 dots are wrong there); on a GPU
they take the cache's 16-bit dtype with fp32 accumulation, and fp32 inputs use IEEE fp32.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from ladle.runtime.kernels import interpreting

LOG2E = 1.4426950408889634
# Fixed when the kernels are decorated, which is when Triton reads TRITON_INTERPRET.
INTERPRETED = interpreting()


@triton.jit
def load_kv_tile(
    cache_ptr: tl.tensor,
    scale_ptr: tl.tensor,
    rows: tl.tensor,
    cols: tl.tensor,
    nmask: tl.tensor,
    dmask: tl.tensor,
    HEAD_DIM: tl.constexpr,
    DTYPE: tl.constexpr,
    INT8: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor]:
    """Gather [BLOCK_N, BLOCK_D] cache rows (flat ``slot * Hkv + head``) and their scales."""
    x = tl.load(
        cache_ptr + rows[:, None] * HEAD_DIM + cols[None, :],
        mask=nmask[:, None] & dmask[None, :],
        other=0.0,
    )
    if INT8:
        scale = tl.load(scale_ptr + rows, mask=nmask, other=0.0)
    else:
        scale = tl.full(rows.shape, 1.0, tl.float32)
    return x.to(DTYPE), scale


@triton.jit
def _decode_split_kernel(
    q_ptr: tl.tensor,
    key_cache_ptr: tl.tensor,
    value_cache_ptr: tl.tensor,
    key_scale_ptr: tl.tensor,
    value_scale_ptr: tl.tensor,
    block_tables_ptr: tl.tensor,
    seq_lens_ptr: tl.tensor,
    out_ptr: tl.tensor,
    lse_ptr: tl.tensor,
    q_seq_stride: int,
    q_head_stride: int,
    block_table_stride: int,
    out_seq_stride: int,
    out_head_stride: int,
    out_split_stride: int,
    lse_seq_stride: int,
    lse_head_stride: int,
    num_kv_heads: int,
    qk_scale: float,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    INT8: tl.constexpr,
) -> None:
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Each split takes a whole number of BLOCK_N tiles; trailing splits may be empty.
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + rows
    hmask = rows < GROUP
    cols = tl.arange(0, BLOCK_D)
    dmask = cols < HEAD_DIM
    q = tl.load(
        q_ptr + seq * q_seq_stride + heads[:, None] * q_head_stride + cols[None, :],
        mask=hmask[:, None] & dmask[None, :],
        other=0.0,
    ).to(DTYPE)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * block_table_stride
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        nmask = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
        slots = block * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_rows = slots * num_kv_heads + kv_head
        k, k_scale = load_kv_tile(
            key_cache_ptr, key_scale_ptr, kv_rows, cols, nmask, dmask, HEAD_DIM, DTYPE, INT8
        )
        v, v_scale = load_kv_tile(
            value_cache_ptr, value_scale_ptr, kv_rows, cols, nmask, dmask, HEAD_DIM, DTYPE, INT8
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        s = s * (k_scale * qk_scale)[None, :]
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(DTYPE), v, input_precision=PRECISION)
        m_i = m_new

    out_mask = hmask[:, None] & dmask[None, :]
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr
        + seq * out_seq_stride
        + heads[:, None] * out_head_stride
        + split * out_split_stride
        + cols[None, :],
        out,
        mask=out_mask,
    )
    if NUM_SPLITS > 1:
        # log2-domain log-sum-exp of this split's scores; -inf for an empty split.
        lse = tl.where(l_i > 0, m_i + tl.math.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + seq * lse_seq_stride + heads * lse_head_stride + split, lse, mask=hmask)


@triton.jit
def _decode_merge_kernel(
    partial_ptr: tl.tensor,
    lse_ptr: tl.tensor,
    out_ptr: tl.tensor,
    partial_seq_stride: int,
    partial_head_stride: int,
    lse_seq_stride: int,
    lse_head_stride: int,
    out_seq_stride: int,
    out_head_stride: int,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
) -> None:
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    splits = tl.arange(0, BLOCK_S)
    smask = splits < NUM_SPLITS
    cols = tl.arange(0, BLOCK_D)
    dmask = cols < HEAD_DIM
    lse = tl.load(
        lse_ptr + seq * lse_seq_stride + head * lse_head_stride + splits,
        mask=smask,
        other=float("-inf"),
    )
    top = tl.max(lse, axis=0)
    # An empty sequence (a padded CUDA-graph row) has only -inf splits: weights 0, output 0.
    top = tl.where(top > float("-inf"), top, 0.0)
    weights = tl.math.exp2(lse - top)
    total = tl.sum(weights, axis=0)
    partial = tl.load(
        partial_ptr
        + seq * partial_seq_stride
        + head * partial_head_stride
        + splits[:, None] * HEAD_DIM
        + cols[None, :],
        mask=smask[:, None] & dmask[None, :],
        other=0.0,
    )
    out = tl.sum(partial * weights[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * out_seq_stride + head * out_head_stride + cols, out, mask=dmask)


def dot_setup(dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """Dtype that the dots take and their fp32 precision (see the module docstring)."""
    if INTERPRETED or dtype == torch.float32:
        return tl.float32, "ieee"
    # The precision setting only matters for fp32 operands; 16-bit ones go to the MMA units.
    return (tl.bfloat16 if dtype == torch.bfloat16 else tl.float16), "tf32"


def num_warps(head_dim: int, dtype: tl.dtype) -> int:
    # At head dim 128, or with fp32 (FMA) dots, four warps spill a 64-row tile's accumulators
    # (bench/compile_check.py shows it); eight hold them in registers.
    return 8 if head_dim >= 128 or dtype == tl.float32 else 4


def cache_layout(
    q: torch.Tensor,
    out: torch.Tensor,
    key_cache: torch.Tensor,
    key_scale: torch.Tensor | None,
    value_scale: torch.Tensor | None,
) -> tuple[int, int, int, bool]:
    """Block size, KV heads, query heads per KV head, and int8, of a cache both kernels read:
    unit-stride heads, a contiguous cache, and scales exactly when it is int8."""
    _, block_size, num_kv_heads, _ = key_cache.shape
    int8 = key_cache.dtype == torch.int8
    assert q.stride(-1) == 1
    assert out.stride(-1) == 1
    assert key_cache.is_contiguous()
    assert int8 == (key_scale is not None) == (value_scale is not None)
    return block_size, num_kv_heads, q.shape[1] // num_kv_heads, int8


def decode_config(
    q_dtype: torch.dtype,
    head_dim: int,
    group: int,
    block_size: int,
    num_splits: int,
    int8: bool,
    block_n: int,
) -> dict[str, Any]:
    """Compile-time parameters and warps of :func:`paged_decode_attention`'s split kernel."""
    dtype, precision = dot_setup(q_dtype)
    return {
        "GROUP": group,
        "HEAD_DIM": head_dim,
        "BLOCK_SIZE": block_size,
        "NUM_SPLITS": num_splits,
        # tl.dot needs 16 rows on a GPU; padded head rows are masked.
        "BLOCK_H": max(16, triton.next_power_of_2(group)),
        "BLOCK_N": block_n,
        "BLOCK_D": triton.next_power_of_2(head_dim),
        "DTYPE": dtype,
        "PRECISION": precision,
        "INT8": int8,
        "num_warps": num_warps(head_dim, dtype),
    }


def decode_workspace(
    num_seqs: int, num_heads: int, head_dim: int, num_splits: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 partial outputs and log-sum-exps for :func:`paged_decode_attention`."""
    return (
        torch.empty((num_seqs, num_heads, num_splits, head_dim), device=device),
        torch.empty((num_seqs, num_heads, num_splits), device=device),
    )


def paged_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    num_splits: int = 1,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    block_n: int = 32,
) -> torch.Tensor:
    """One query token per sequence: ``q`` [B, Hq, D] -> ``out`` [B, Hq, D].

    ``seq_lens`` [B] counts each context including the query token (0 = padded row, output 0).
    With ``num_splits > 1`` the ``workspace`` (see :func:`decode_workspace`, at least B rows)
    holds the per-split partials.
    """
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads, group, int8 = cache_layout(q, out, key_cache, key_scale, value_scale)
    if batch == 0:
        return out
    if num_splits > 1:
        if workspace is None:
            workspace = decode_workspace(batch, num_heads, head_dim, num_splits, q.device)
        partial, lse = workspace
        assert partial.shape[0] >= batch
        assert partial.shape[1] == num_heads
        assert partial.shape[2] >= num_splits
        assert partial.shape[3] == head_dim
        assert partial.stride(2) == head_dim
        assert partial.stride(3) == 1
        assert lse.stride(2) == 1
        target_strides = (partial.stride(0), partial.stride(1), partial.stride(2))
        lse_strides = (lse.stride(0), lse.stride(1))
    else:
        partial, lse = out, out
        target_strides = (out.stride(0), out.stride(1), 0)
        lse_strides = (0, 0)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q,
        key_cache,
        value_cache,
        key_scale if key_scale is not None else key_cache,
        value_scale if value_scale is not None else value_cache,
        block_tables,
        seq_lens,
        partial,
        lse,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        *target_strides,
        *lse_strides,
        num_kv_heads,
        scale * LOG2E,
        **decode_config(q.dtype, head_dim, group, block_size, num_splits, int8, block_n),
    )
    if num_splits > 1:
        _decode_merge_kernel[(batch, num_heads)](
            partial,
            lse,
            out,
            partial.stride(0),
            partial.stride(1),
            lse.stride(0),
            lse.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=triton.next_power_of_2(head_dim),
        )
    return out


def paged_attention_ref(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 causal attention of every sequence's queries over its cached context, one
    sequence at a time (decodes are the one-query case); int8 caches are dequantized."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    group = q.shape[1] // num_kv_heads
    starts = query_start_loc.tolist()
    for i, ctx in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        if ctx == 0 or end == start:
            continue
        blocks = block_tables[i, : math.ceil(ctx / block_size)].long()
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx].float()
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx].float()
        if key_scale is not None and value_scale is not None:
            k = k * key_scale[blocks].reshape(-1, num_kv_heads)[:ctx, :, None]
            v = v * value_scale[blocks].reshape(-1, num_kv_heads)[:ctx, :, None]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        qs = q[start:end].float()
        scores = torch.einsum("thd,nhd->htn", qs, k) * scale
        q_pos = torch.arange(ctx - (end - start), ctx, device=q.device)
        visible = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out[start:end] = torch.einsum("htn,nhd->thd", scores.softmax(-1), v)
    return out
