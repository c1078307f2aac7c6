"""W8A16 and W4A16 GEMMs in Triton: ``y = x W^T (+ bias)`` with int8 or int4 weights.

The weight formats are ``ladle.runtime.quantization.formats``': int8 per output channel, and
groups (4- or 8-bit codes with a scale and offset per group of ``group_size`` inputs); all
store output channels in panels of 16, input by input (4 bits: two consecutive inputs per
byte, the even one in the low nibble), so the ``BLOCK_K x 16`` weights of a tile's panel are
one contiguous run.

The integer codes enter ``tl.dot`` *as integers* in the activations' dtype (exact: bf16 and
fp16 hold every integer up to 256), and scales are applied to the fp32 products: after the
K loop for int8 per channel, per K tile for groups, where a tile lies within one group and
``sum_k x_k (q_k s + o) = s * (x . q) + o * sum_k x_k``. So no dequantized weight is rounded to
16 bits, and the inner loop is a plain MMA over unpacked codes.

The group kernel loads x's even and odd columns and runs two dots of ``BLOCK_K / 2``: a 4-bit
K tile of ``BLOCK_K`` inputs is ``BLOCK_K / 2`` byte rows whose low nibbles are the even
inputs and high nibbles the odd ones; 8-bit codes are read as the even and odd rows.

Under the Triton interpreter (CPU tests) dots run in fp32 (its bf16 dot is wrong, triton
#11584); fp32 activations use IEEE fp32 dots everywhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ladle.runtime.kernels import interpreting
from ladle.runtime.quantization.formats import GroupWeight, Int8Weight, QuantizedWeight

INTERPRETED = interpreting()


@triton.jit
def _w8a16_kernel(
    x_ptr: tl.tensor,
    w_ptr: tl.tensor,
    scale_ptr: tl.tensor,
    bias_ptr: tl.tensor,
    y_ptr: tl.tensor,
    M: int,
    N: int,
    K: int,
    stride_xm: int,
    HAS_BIAS: tl.constexpr,
    DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mmask, nmask = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = k0 + rk < K
        x = tl.load(
            x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k0 + rk)[None, :],
            mask=mmask[:, None] & kmask[None, :],
            other=0.0,
        )
        q = tl.load(
            w_ptr
            + (rn // 16)[None, :].to(tl.int64) * K * 16
            + (k0 + rk)[:, None] * 16
            + rn[None, :] % 16,
            mask=kmask[:, None] & nmask[None, :],
            other=0,
        )
        acc += tl.dot(x.to(DTYPE), q.to(DTYPE), input_precision=PRECISION)
    acc = acc * tl.load(scale_ptr + rn, mask=nmask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=mmask[:, None] & nmask[None, :],
    )


@triton.jit
def _groups_kernel(
    x_ptr: tl.tensor,
    w_ptr: tl.tensor,
    scale_ptr: tl.tensor,
    offset_ptr: tl.tensor,
    bias_ptr: tl.tensor,
    y_ptr: tl.tensor,
    M: int,
    N: int,
    K: int,
    stride_xm: int,
    panel_rows: int,
    num_groups: int,
    GROUP_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    HALF: tl.constexpr = BLOCK_K // 2
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ri = tl.arange(0, HALF)
    mmask, nmask = rm < M, rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    # Panel p of channel n starts at p * panel_rows * 16; its byte row i holds input i (8 bits)
    # or inputs 2i and 2i + 1 (4 bits).
    w_cols = w_ptr + (rn // 16)[None, :].to(tl.int64) * panel_rows * 16 + rn[None, :] % 16
    g_cols = (rn // 16).to(tl.int64) * num_groups * 16 + rn % 16
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_even = k0 + 2 * ri
        even_mask = k_even < K
        odd_mask = k_even + 1 < K
        x_even = tl.load(
            x_rows + k_even[None, :], mask=mmask[:, None] & even_mask[None, :], other=0.0
        )
        x_odd = tl.load(
            x_rows + (k_even + 1)[None, :], mask=mmask[:, None] & odd_mask[None, :], other=0.0
        )
        if BITS == 4:
            packed = tl.load(
                w_cols + (k0 // 2 + ri)[:, None] * 16,
                mask=even_mask[:, None] & nmask[None, :],
                other=0,
            ).to(tl.int32)
            q_even = (packed & 0xF).to(DTYPE)
            q_odd = (packed >> 4).to(DTYPE)
        else:
            q_even = tl.load(
                w_cols + k_even[:, None] * 16, mask=even_mask[:, None] & nmask[None, :], other=0
            ).to(DTYPE)
            q_odd = tl.load(
                w_cols + (k_even + 1)[:, None] * 16,
                mask=odd_mask[:, None] & nmask[None, :],
                other=0,
            ).to(DTYPE)
        dots = tl.dot(x_even.to(DTYPE), q_even, input_precision=PRECISION)
        dots = tl.dot(x_odd.to(DTYPE), q_odd, dots, input_precision=PRECISION)
        x_sum = tl.sum(x_even.to(tl.float32), axis=1) + tl.sum(x_odd.to(tl.float32), axis=1)
        group = g_cols + (k0 // GROUP_SIZE) * 16
        s = tl.load(scale_ptr + group, mask=nmask, other=0.0)
        o = tl.load(offset_ptr + group, mask=nmask, other=0.0)
        acc += dots * s[None, :] + x_sum[:, None] * o[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=mmask[:, None] & nmask[None, :],
    )


def _dot_setup(dtype: torch.dtype) -> tuple[tl.dtype, str]:
    if INTERPRETED or dtype == torch.float32:
        return tl.float32, "ieee"
    return (tl.bfloat16 if dtype == torch.bfloat16 else tl.float16), "tf32"


def gemm_config(m: int, group_size: int | None) -> dict[str, int]:
    """Tile sizes: 16 rows (tl.dot's minimum) for decode-sized batches, 64 beyond; a group
    format's K tiles stay within one group."""
    block_m = 16 if m <= 16 else 64
    block_k = 64 if group_size is None or group_size % 64 == 0 else 32
    return {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": block_k, "num_warps": 4}


def quantized_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [..., K] @ W^T + bias`` in x's dtype (fp32 accumulation)."""
    n, k = weight.shape
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    dtype, precision = _dot_setup(x.dtype)
    common = {"HAS_BIAS": bias is not None, "DTYPE": dtype, "PRECISION": precision}
    if isinstance(weight, Int8Weight):
        config = gemm_config(m, None)
        grid = (triton.cdiv(m, config["BLOCK_M"]), triton.cdiv(n, config["BLOCK_N"]))
        _w8a16_kernel[grid](
            rows,
            weight.qweight,
            weight.scale,
            bias if bias is not None else weight.scale,
            out,
            m,
            n,
            k,
            rows.stride(0),
            **common,
            **config,
        )
    else:
        assert isinstance(weight, GroupWeight)
        config = gemm_config(m, weight.group_size)
        grid = (triton.cdiv(m, config["BLOCK_M"]), triton.cdiv(n, config["BLOCK_N"]))
        _groups_kernel[grid](
            rows,
            weight.qweight,
            weight.scale,
            weight.offset,
            bias if bias is not None else weight.scale,
            out,
            m,
            n,
            k,
            rows.stride(0),
            weight.qweight.shape[1],
            weight.scale.shape[1],
            GROUP_SIZE=weight.group_size,
            BITS=weight.bits,
            **common,
            **config,
        )
    return out.view(*x.shape[:-1], n)


def quantized_linear_ref(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The reference: dequantize in fp32, multiply in fp32."""
    y = x.float() @ weight.dequantize().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
