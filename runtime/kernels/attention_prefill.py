"""Varlen causal prefill over the paged cache, in Triton (``attention`` explains the layout,
GQA packing, int8 KV and the interpreter's fp32 dots, which both kernels share): each program
tiles one sequence's new tokens; a query at absolute position ``p`` sees keys ``0..p``, and a
tile stops reading keys after its last query's position."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ladle.runtime.kernels.attention import (
    LOG2E,
    cache_layout,
    dot_setup,
    load_kv_tile,
    num_warps,
)


def prefill_config(
    q_dtype: torch.dtype,
    head_dim: int,
    group: int,
    block_size: int,
    int8: bool,
    block_m: int,
    block_n: int,
) -> dict[str, Any]:
    """Compile-time parameters and warps of :func:`paged_prefill_attention`'s kernel."""
    dtype, precision = dot_setup(q_dtype)
    group_pad = triton.next_power_of_2(group)
    return {
        "GROUP": group,
        "GROUP_PAD": group_pad,
        "HEAD_DIM": head_dim,
        "BLOCK_SIZE": block_size,
        "BLOCK_Q": max(1, block_m // group_pad),
        "BLOCK_N": block_n,
        "BLOCK_D": triton.next_power_of_2(head_dim),
        "DTYPE": dtype,
        "PRECISION": precision,
        "INT8": int8,
        "num_warps": num_warps(head_dim, dtype),
    }


@triton.jit
def _prefill_kernel(
    q_ptr: tl.tensor,
    key_cache_ptr: tl.tensor,
    value_cache_ptr: tl.tensor,
    key_scale_ptr: tl.tensor,
    value_scale_ptr: tl.tensor,
    block_tables_ptr: tl.tensor,
    query_start_ptr: tl.tensor,
    seq_lens_ptr: tl.tensor,
    out_ptr: tl.tensor,
    first_seq: int,
    q_token_stride: int,
    q_head_stride: int,
    out_token_stride: int,
    out_head_stride: int,
    block_table_stride: int,
    num_kv_heads: int,
    qk_scale: float,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    INT8: tl.constexpr,
) -> None:
    seq = first_seq + tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq).to(tl.int64)
    q_len = tl.load(query_start_ptr + seq + 1).to(tl.int64) - q_start
    if tile * BLOCK_Q < q_len:
        ctx = tl.load(seq_lens_ptr + seq).to(tl.int64)
        # Row r of the tile is query token r // GROUP_PAD of the tile, head r % GROUP_PAD.
        rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
        token = tile * BLOCK_Q + rows // GROUP_PAD
        head = kv_head * GROUP + rows % GROUP_PAD
        rmask = (token < q_len) & (rows % GROUP_PAD < GROUP)
        q_pos = ctx - q_len + token
        cols = tl.arange(0, BLOCK_D)
        dmask = cols < HEAD_DIM
        q = tl.load(
            q_ptr
            + (q_start + token)[:, None] * q_token_stride
            + head[:, None] * q_head_stride
            + cols[None, :],
            mask=rmask[:, None] & dmask[None, :],
            other=0.0,
        ).to(DTYPE)

        m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, BLOCK_D], tl.float32)
        table = block_tables_ptr + seq * block_table_stride
        # Keys past the tile's last query position are masked for every row: stop there.
        kv_end = tl.minimum(ctx, ctx - q_len + (tile + 1) * BLOCK_Q)
        for n0 in range(0, kv_end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            nmask = pos < kv_end
            block = tl.load(table + pos // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
            slots = block * BLOCK_SIZE + pos % BLOCK_SIZE
            kv_rows = slots * num_kv_heads + kv_head
            k, k_scale = load_kv_tile(
                key_cache_ptr, key_scale_ptr, kv_rows, cols, nmask, dmask, HEAD_DIM, DTYPE, INT8
            )
            v, v_scale = load_kv_tile(
                value_cache_ptr,
                value_scale_ptr,
                kv_rows,
                cols,
                nmask,
                dmask,
                HEAD_DIM,
                DTYPE,
                INT8,
            )
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            s = s * (k_scale * qk_scale)[None, :]
            # Key 0 is visible to every row, so each row's running max is finite after tile 0.
            visible = nmask[None, :] & (pos[None, :] <= q_pos[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            p = p * v_scale[None, :]
            acc = acc * alpha[:, None] + tl.dot(p.to(DTYPE), v, input_precision=PRECISION)
            m_i = m_new

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr
            + (q_start + token)[:, None] * out_token_stride
            + head[:, None] * out_head_stride
            + cols[None, :],
            out,
            mask=rmask[:, None] & dmask[None, :],
        )


def paged_prefill_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    first_seq: int,
    num_seqs: int,
    max_query_len: int,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int = 32,
) -> torch.Tensor:
    """Causal attention for sequences ``first_seq .. first_seq + num_seqs`` of a flat batch.

    ``q``/``out`` are [T, Hq, D] over the whole batch; ``query_start_loc`` [B + 1] and
    ``seq_lens`` [B] (context including the new tokens) locate each sequence's queries, whose
    keys and values must already be in the cache. ``block_m`` rows per tile are shared between
    query tokens and the query heads of one KV head.
    """
    head_dim = q.shape[2]
    block_size, num_kv_heads, group, int8 = cache_layout(q, out, key_cache, key_scale, value_scale)
    if num_seqs == 0:
        return out
    config = prefill_config(q.dtype, head_dim, group, block_size, int8, block_m, block_n)
    tiles = triton.cdiv(max_query_len, config["BLOCK_Q"])
    _prefill_kernel[(num_seqs, tiles, num_kv_heads)](
        q,
        key_cache,
        value_cache,
        key_scale if key_scale is not None else key_cache,
        value_scale if value_scale is not None else value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        first_seq,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        num_kv_heads,
        scale * LOG2E,
        **config,
    )
    return out
