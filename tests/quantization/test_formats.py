"""Quantize/dequantize round trips stay within the bound each format implies."""

from __future__ import annotations

import pytest
import torch

from ladle.runtime.quantization.formats import (
    INT4_BLOCK,
    fake_quantize_int4,
    quantize_int4,
    quantize_int8,
    quantize_kv_rows,
)

# Float rounding in scale * q (+ offset), relative to the step.
SLACK = 1e-5


@pytest.mark.parametrize(("n", "k"), [(1, 1), (7, 33), (64, 576), (5, 1000)])
def test_int8_round_trip_is_within_half_a_step_per_channel(n: int, k: int) -> None:
    torch.manual_seed(n * k)
    w = torch.randn(n, k) * torch.logspace(-3, 1, n)[:, None]  # rows of very different ranges
    q = quantize_int8(w)
    assert q.qweight.dtype == torch.int8
    assert q.qweight.abs().max() <= 127
    err = (q.dequantize() - w).abs()
    step = q.scale[:, None]
    assert (err <= step * (0.5 + SLACK)).all()
    # The row's largest magnitude is on the grid's end: nothing is clipped.
    assert torch.equal(q.qweight.abs().amax(dim=1), torch.full((n,), 127, dtype=torch.int8))


@pytest.mark.parametrize(
    ("n", "k", "group"),
    [(3, 31, 32), (4, 32, 32), (5, 100, 64), (6, 576, 64), (7, 576, 128), (2, 1530, 96)],
)
def test_int4_round_trip_is_within_half_a_step_per_group(n: int, k: int, group: int) -> None:
    torch.manual_seed(k + group)
    w = torch.randn(n, k) + torch.randn(n, 1) * 3  # offsets away from zero: asymmetric ranges
    q = quantize_int4(w, group)
    groups = -(-k // group)
    assert q.qweight.shape == (n, -(-k // INT4_BLOCK) * INT4_BLOCK // 2)
    assert q.scale.shape == q.offset.shape == (n, groups)
    codes = q.unpack()
    assert codes.shape == (n, k)
    assert codes.max() <= 15
    step = q.scale.repeat_interleave(group, dim=1)[:, :k]
    err = (q.dequantize() - w).abs()
    assert (err <= step * (0.5 + SLACK)).all()
    # Each group's minimum is represented exactly (the float offset) and its maximum within
    # rounding, so both ends of every group's range are codes 0 and 15.
    padded = torch.nn.functional.pad(codes.float(), (0, groups * group - k), value=float("nan"))
    per_group = padded.view(n, groups, group)
    assert (per_group.nan_to_num(99).amin(dim=2) == 0).all()
    assert (per_group.nan_to_num(-1).amax(dim=2) == 15).all()
    assert torch.equal(fake_quantize_int4(w, group), q.dequantize())


def test_int4_nibble_layout_is_llama_cpp_block_order() -> None:
    """Byte j of a block: weight j low, weight j + 16 high (what the kernels unpack)."""
    w = torch.arange(64, dtype=torch.float32).remainder(16)[None, :].repeat(2, 1)
    q = quantize_int4(w, 64)
    first_block = q.qweight[0, :16]
    assert torch.equal(first_block & 0xF, torch.arange(16, dtype=torch.uint8))
    assert torch.equal(first_block >> 4, torch.arange(16, dtype=torch.uint8))


def test_int4_constant_groups_and_clipping() -> None:
    w = torch.zeros(2, 64)
    w[1, 32:] = 5.0
    q = quantize_int4(w, 32)
    assert torch.equal(q.dequantize(), w)  # constant groups are exact
    outlier = torch.randn(4, 128)
    outlier[:, 0] = 40.0
    clip = torch.full((4, 4), 0.5)
    clipped = quantize_int4(outlier, 32, clip).dequantize()
    assert clipped[:, 0].max() <= 20.0 + 1e-4  # the clipped range ends at half the absmax
    # Clipping narrows the step of the outlier's group: the other values get finer.
    assert (
        quantize_int4(outlier, 32, clip).scale[:, 0] < quantize_int4(outlier, 32).scale[:, 0]
    ).all()


def test_group_size_must_be_a_multiple_of_the_block() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int4(torch.randn(2, 64), 48)


def test_kv_rows_round_trip_per_token_and_head() -> None:
    torch.manual_seed(0)
    x = torch.randn(9, 3, 64)
    x[4, 1] *= 1000  # one outlier row does not cost the others their precision
    q, scale = quantize_kv_rows(x)
    assert q.dtype == torch.int8
    assert scale.shape == (9, 3)
    err = (q.float() * scale[..., None] - x).abs()
    assert (err <= scale[..., None] * (0.5 + SLACK)).all()
    assert scale[4, 1] > 100 * scale[4, 0]
