"""Batched LoRA in Triton: one shrink and one expand launch for a whole batch, each row
gathering its own adapter's slot (punica's BGMV), so that rows of different adapters and of
the base model (slot -1, left as they are) share the launches. Arithmetic is fp32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ladle.runtime.lora.slots import ProjectionLoRA


@triton.jit
def _shrink_kernel(
    x_ptr: tl.tensor,
    a_ptr: tl.tensor,
    s_ptr: tl.tensor,
    slots_ptr: tl.tensor,
    K: int,
    W: int,
    stride_x: int,
    stride_a_slot: int,
    stride_a_row: int,
    stride_s: int,
    BLOCK_W: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row)
    # A base-model row (slot -1) reads nothing: its masks are empty.
    width = W * (slot >= 0).to(tl.int32)
    slot = tl.maximum(slot, 0).to(tl.int64)
    offs_w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    acc = tl.zeros([BLOCK_W], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_ptr + row * stride_x + offs_k, mask=offs_k < K, other=0.0)
        a = tl.load(
            a_ptr + slot * stride_a_slot + offs_w[:, None] * stride_a_row + offs_k[None, :],
            mask=(offs_w[:, None] < width) & (offs_k[None, :] < K),
            other=0.0,
        )
        acc += tl.sum(a.to(tl.float32) * xv.to(tl.float32)[None, :], axis=1)
    tl.store(s_ptr + row * stride_s + offs_w, acc, mask=offs_w < W)


@triton.jit
def _expand_kernel(
    s_ptr: tl.tensor,
    b_ptr: tl.tensor,
    y_ptr: tl.tensor,
    slots_ptr: tl.tensor,
    N: int,
    R: int,
    end0: int,
    end1: int,
    stride_s: int,
    stride_b_slot: int,
    stride_b_row: int,
    stride_y: int,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row)
    # A base-model row (slot -1) is left as it is: its masks are empty.
    outputs = N * (slot >= 0).to(tl.int32)
    slot = tl.maximum(slot, 0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    # Which slice (q, k or v of a fused qkv) each output belongs to: its rank columns.
    index = (offs_n >= end0).to(tl.int32) + (offs_n >= end1).to(tl.int32)
    mask = (offs_n[:, None] < outputs) & (offs_r[None, :] < R)
    s = tl.load(s_ptr + row * stride_s + index[:, None] * R + offs_r[None, :], mask=mask, other=0.0)
    b = tl.load(
        b_ptr + slot * stride_b_slot + offs_n[:, None] * stride_b_row + offs_r[None, :],
        mask=mask,
        other=0.0,
    )
    delta = tl.sum(s * b.to(tl.float32), axis=1)
    out = offs_n < outputs
    y = tl.load(y_ptr + row * stride_y + offs_n, mask=out, other=0.0)
    tl.store(y_ptr + row * stride_y + offs_n, (y.to(tl.float32) + delta).to(y.dtype), mask=out)


def add_lora_rows(
    x: torch.Tensor, y: torch.Tensor, proj: ProjectionLoRA, row_slots: torch.Tensor
) -> None:
    """``row_slots`` [rows] int32 on x's device: each row's slot, -1 for the base model."""
    rows, k = x.shape
    width = proj.a.shape[1]
    shrunk = torch.empty(rows, width, dtype=torch.float32, device=x.device)
    block_w = min(64, triton.next_power_of_2(width))
    _shrink_kernel[(rows, triton.cdiv(width, block_w))](
        x, proj.a, shrunk, row_slots, k, width,
        x.stride(0), proj.a.stride(0), proj.a.stride(1), shrunk.stride(0),
        BLOCK_W=block_w, BLOCK_K=min(128, triton.next_power_of_2(k)),
    )  # fmt: skip
    n = y.shape[1]
    ends = (*proj.slice_ends, n, n)
    block_n = min(64, triton.next_power_of_2(n))
    _expand_kernel[(rows, triton.cdiv(n, block_n))](
        shrunk, proj.b, y, row_slots, n, proj.rank, ends[0], ends[1],
        shrunk.stride(0), proj.b.stride(0), proj.b.stride(1), y.stride(0),
        BLOCK_N=block_n, BLOCK_R=triton.next_power_of_2(proj.rank),
    )  # fmt: skip
