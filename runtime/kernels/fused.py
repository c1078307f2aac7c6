"""Fused elementwise kernels of the Llama-family forward pass, with torch references.

Each one replaces several torch launches (and their round trips through memory) with one:
RMSNorm with the residual add, rotary embedding of Q and K in place, and SiLU-and-mul. All
arithmetic is fp32 inside the kernel; inputs and outputs keep the model's dtype. The residual
sum is rounded to the model dtype *before* it is normalized, exactly as the torch path does, so
both paths carry the same residual stream.

RoPE variants (default, linear, llama3, yarn) differ only in their frequencies and attention
scaling, which the model folds into its precomputed cos/sin tables; the kernel reads those.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# -- RMSNorm (+ residual) ------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    x_ptr: tl.tensor,
    res_ptr: tl.tensor,
    w_ptr: tl.tensor,
    out_ptr: tl.tensor,
    res_out_ptr: tl.tensor,
    n_cols: int,
    x_stride: int,
    res_stride: int,
    out_stride: int,
    res_out_stride: int,
    eps: float,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        # Round the sum to the stream's dtype first: the torch path adds in that dtype.
        x = (x.to(tl.float32) + res.to(tl.float32)).to(res.dtype)
        tl.store(res_out_ptr + row * res_out_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, xf * rstd * w, mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm over the last dim; with ``residual``, normalize ``x + residual`` and return the
    sum as the new residual. Rows may be strided; the last dim must be contiguous."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    rows = x2.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    res2 = residual.reshape(-1, n) if residual is not None else x2
    res_out = torch.empty_like(out) if residual is not None else out
    assert x2.stride(-1) == 1
    assert res2.stride(-1) == 1
    block = triton.next_power_of_2(n)
    if rows:
        _rms_norm_kernel[(rows,)](
            x2,
            res2,
            weight,
            out,
            res_out,
            n,
            x2.stride(0),
            res2.stride(0),
            out.stride(0),
            res_out.stride(0),
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(16, max(4, block // 1024)),
        )
    new_residual = res_out.view(x.shape) if residual is not None else None
    return out.view(x.shape), new_residual


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 reference for :func:`rms_norm` (the residual sum rounded like the kernel's)."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y, (x if residual is not None else None)


# -- rotary embedding -------------------------------------------------------------------------


@triton.jit
def _rope_rows(
    ptr: tl.tensor,
    head_stride: int,
    n_heads: int,
    cos: tl.tensor,
    sin: tl.tensor,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
) -> None:
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < n_heads) & (cols[None, :] < HALF)
    first = ptr + heads[:, None] * head_stride + cols[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    tl.store(first, a * cos - b * sin, mask=mask)
    tl.store(first + HALF, b * cos + a * sin, mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr: tl.tensor,
    k_ptr: tl.tensor,
    cos_ptr: tl.tensor,
    sin_ptr: tl.tensor,
    q_row_stride: int,
    q_head_stride: int,
    k_row_stride: int,
    k_head_stride: int,
    cos_stride: int,
    n_q_heads: int,
    n_k_heads: int,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
) -> None:
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    cmask = cols < HALF
    cos = tl.load(cos_ptr + t * cos_stride + cols, mask=cmask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * cos_stride + cols, mask=cmask, other=0.0).to(tl.float32)
    _rope_rows(
        q_ptr + t * q_row_stride,
        q_head_stride,
        n_q_heads,
        cos[None, :],
        sin[None, :],
        HALF,
        BLOCK_HQ,
        BLOCK_HALF,
    )
    _rope_rows(
        k_ptr + t * k_row_stride,
        k_head_stride,
        n_k_heads,
        cos[None, :],
        sin[None, :],
        HALF,
        BLOCK_HK,
        BLOCK_HALF,
    )


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Rotate ``q`` [T, Hq, D] and ``k`` [T, Hk, D] in place (rotate-half form).

    ``cos``/``sin`` hold each token's row, ``[T, D // 2]`` (or ``[T, 1, D // 2]``): the model
    gathers them by position once per step for all layers. ``q`` and ``k`` may be strided
    views into the fused QKV output; only their last dim must be contiguous.
    """
    tokens, n_q, dim = q.shape
    n_k = k.shape[1]
    half = dim // 2
    cos2, sin2 = cos.reshape(tokens, half), sin.reshape(tokens, half)
    assert q.stride(-1) == 1
    assert k.stride(-1) == 1
    assert cos2.stride(-1) == 1
    assert cos2.stride() == sin2.stride()
    if tokens == 0:
        return
    _rope_kernel[(tokens,)](
        q,
        k,
        cos2,
        sin2,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos2.stride(0),
        n_q,
        n_k,
        HALF=half,
        BLOCK_HQ=triton.next_power_of_2(n_q),
        BLOCK_HK=triton.next_power_of_2(n_k),
        BLOCK_HALF=triton.next_power_of_2(half),
    )


def rotary_embedding_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """fp32 rotate-half RoPE of ``x`` [T, H, D] with per-token ``cos``/``sin`` [T, D // 2]."""
    c = cos.reshape(x.shape[0], 1, -1).float()
    s = sin.reshape(x.shape[0], 1, -1).float()
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


# -- SiLU and mul -------------------------------------------------------------------------------


@triton.jit
def _silu_and_mul_kernel(
    x_ptr: tl.tensor,
    out_ptr: tl.tensor,
    n_cols: int,
    x_stride: int,
    out_stride: int,
    BLOCK: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, gate * tl.sigmoid(gate) * up, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` along the last dim."""
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    assert x2.stride(-1) == 1
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(n), 1024)
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](
            x2, out, n, x2.stride(0), out.stride(0), BLOCK=block
        )
    return out.view(*x.shape[:-1], n)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
