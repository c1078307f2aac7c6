"""Quantize/dequantize round trips stay within the bound each format implies."""

from __future__ import annotations

import pytest
import torch

from ladle.runtime.quantization.formats import (
    PANEL,
    a8_packable,
    fake_quantize_groups,
    pack_a8,
    quantize_groups,
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
    panels = -(-n // PANEL)
    assert q.qweight.shape == (panels, k, PANEL)
    assert q.qweight.dtype == torch.int8
    assert q.shape == (n, k)
    codes = q.codes()
    assert codes.abs().max() <= 127
    err = (q.dequantize() - w).abs()
    step = q.scale[:n, None]
    assert (err <= step * (0.5 + SLACK)).all()
    # The row's largest magnitude is on the grid's end: nothing is clipped.
    assert torch.equal(codes.abs().amax(dim=1), torch.full((n,), 127, dtype=torch.int8))
    # Padded channels are zero, and a row lookup (the embedding) reads the same values.
    assert (q.scale[n:] == 0).all()
    ids = torch.tensor([n - 1, 0, n // 2])
    assert torch.equal(q.rows(ids), q.dequantize()[ids])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    ("n", "k", "group"),
    [(3, 31, 32), (4, 32, 32), (5, 100, 64), (6, 576, 64), (7, 576, 128), (2, 1530, 96)],
)
def test_group_round_trip_is_within_half_a_step_per_group(
    n: int, k: int, group: int, bits: int
) -> None:
    torch.manual_seed(k + group)
    w = torch.randn(n, k) + torch.randn(n, 1) * 3  # offsets away from zero: asymmetric ranges
    q = quantize_groups(w, group, bits=bits)
    top = (1 << bits) - 1
    groups, panels = -(-k // group), -(-n // PANEL)
    assert q.qweight.shape == (panels, -(-k // 2) if bits == 4 else k, PANEL)
    assert q.scale.shape == q.offset.shape == (panels, groups, PANEL)
    codes = q.codes()
    assert codes.shape == (n, k)
    assert codes.max() <= top
    step = q.scale.transpose(1, 2).reshape(-1, groups)[:n].repeat_interleave(group, dim=1)[:, :k]
    err = (q.dequantize() - w).abs()
    assert (err <= step * (0.5 + SLACK)).all()
    # Each group's minimum is represented exactly (the float offset) and its maximum within
    # rounding, so both ends of every group's range are codes 0 and the top code.
    padded = torch.nn.functional.pad(codes.float(), (0, groups * group - k), value=float("nan"))
    per_group = padded.view(n, groups, group)
    assert (per_group.nan_to_num(999).amin(dim=2) == 0).all()
    assert (per_group.nan_to_num(-1).amax(dim=2) == top).all()
    assert torch.equal(fake_quantize_groups(w, group, bits=bits), q.dequantize())


def test_8_bit_groups_hold_a_4_bit_group_grid_exactly() -> None:
    """A Q4_1-style checkpoint (each block of 32 weights ``q * d + m``, q in 0..15), such as
    the default model, survives 8-bit groups of the same size unchanged: 255 steps hold its 15
    steps 17 times. Per-channel int8 re-rounds it."""
    gen = torch.Generator().manual_seed(3)
    n, k = 24, 256
    d = torch.rand(n, k // 32, 1, generator=gen) * 0.1 + 0.01
    m = -torch.rand(n, k // 32, 1, generator=gen)
    q4 = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
    q4[..., 0], q4[..., 1] = 0, 15  # every block spans its whole grid
    w = (q4 * d + m).view(n, k)
    exact = quantize_groups(w, 32, bits=8).dequantize()
    assert float((exact - w).abs().max()) < 1e-5 * float(w.abs().max())
    assert float((quantize_int8(w).dequantize() - w).abs().max()) > 1e-3


def test_layouts_are_panels_of_16_channels_input_by_input() -> None:
    """What the kernels read: int8 [P, K, 16]; int4 byte (p, i, j) = channel 16 p + j's inputs
    2i (low nibble) and 2i + 1 (high)."""
    n, k = 20, 6
    # Channel c's input i holds code (c + i) % 16, on a 0..15 grid (scale 1, offset 0).
    grid = (torch.arange(n)[:, None] + torch.arange(k)[None, :]).remainder(16).float()
    grid[:, 0] = torch.where(torch.arange(n) % 2 == 0, 0.0, 15.0)  # every group spans 0..15
    grid[:, 1] = torch.where(torch.arange(n) % 2 == 0, 15.0, 0.0)
    q4 = quantize_groups(grid, 32)
    assert torch.equal(q4.codes(), grid.to(torch.uint8))
    byte = q4.qweight[1, 2, 3]  # panel 1, inputs 4 and 5, channel 19
    assert int(byte) & 0xF == int(grid[19, 4])
    assert int(byte) >> 4 == int(grid[19, 5])
    q8 = quantize_int8(grid - 7.5)
    assert torch.equal(q8.qweight[1, 4, :4], q8.codes()[16:20, 4])  # input 4, channels 16-19
    assert (q8.qweight[1, :, 4:] == 0).all()  # the padded channels of the last panel


def test_int8_activation_codes_are_four_inputs_per_channel_lane() -> None:
    """What VNNI reads (kernels/a8_kernels.c): per panel, rows of 64 bytes for 8 inputs; the
    32-bit lane j holds channel 16 p + j's inputs 8 r .. 8 r + 3 in its low nibbles and
    8 r + 4 .. 8 r + 7 in its high ones."""
    n, k = 20, 40
    codes = (torch.arange(n)[:, None] * 3 + torch.arange(k)[None, :]).remainder(16).float()
    for first in (0, 32):  # every group spans 0..15: scale 1, offset 0
        codes[:, first], codes[:, first + 1] = 0.0, 15.0
    q4 = quantize_groups(codes, 32)
    assert torch.equal(q4.codes(), codes.to(torch.uint8))
    packed = pack_a8(q4)
    assert packed.shape == (2, k // 8, 64)
    assert packed.dtype == torch.uint8
    lane = packed[1, 2, 4 * 3 : 4 * 3 + 4]  # panel 1, inputs 16..23, channel 19
    assert [int(b) & 0xF for b in lane] == [int(c) for c in codes[19, 16:20]]
    assert [int(b) >> 4 for b in lane] == [int(c) for c in codes[19, 20:24]]
    assert (packed[1, :, 16:] == 0).all()  # the padded channels of the last panel
    assert not a8_packable(quantize_groups(codes[:, :36], 32))  # K off a multiple of 8
    assert not a8_packable(quantize_groups(codes, 32, bits=8))


def test_int4_constant_groups_and_clipping() -> None:
    w = torch.zeros(2, 64)
    w[1, 32:] = 5.0
    q = quantize_groups(w, 32)
    assert torch.equal(q.dequantize(), w)  # constant groups are exact
    outlier = torch.randn(4, 128)
    outlier[:, 0] = 40.0
    clip = torch.full((4, 4), 0.5)
    clipped = quantize_groups(outlier, 32, clip).dequantize()
    assert clipped[:, 0].max() <= 20.0 + 1e-4  # the clipped range ends at half the absmax
    # Clipping narrows the step of the outlier's group: the other values get finer.
    narrowed = quantize_groups(outlier, 32, clip).scale[0, 0, :4]  # panel 0, group 0
    assert (narrowed < quantize_groups(outlier, 32).scale[0, 0, :4]).all()


def test_group_size_must_be_a_multiple_of_the_block() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_groups(torch.randn(2, 64), 48)


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
