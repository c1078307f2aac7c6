"""Quantized weight formats, with the torch reference that defines their numerics.

Both are dequantized inside the kernels (C on CPUs, Triton on GPUs), never in memory:

* **int8**, per output channel, symmetric: ``w[n, k] = q[n, k] * scale[n]``, q in -127..127,
  one fp32 scale per row (absmax / 127). Rounding error is at most half a step.
* **groups** (int4, or int8 with a group size), ``group_size`` inputs each, asymmetric:
  ``w[n, k] = q[n, k] * scale[n, g] + offset[n, g]`` with ``g = k // group_size`` and q in
  0..15 (4 bits) or 0..255 (8 bits), the step spanning the group's [min, max] (narrowed by an
  optional clip ratio). The offset is a float rather than an integer zero point, so a group's
  minimum is represented exactly; error is at most half a step. A checkpoint that is itself a
  Q4_1 GGUF (such as the default model: blocks of 32 ``q * d + m`` whose codes span 0..15 by
  construction) is represented exactly by 8-bit groups of 32, each of its steps being 17 of
  theirs; per-channel int8 re-rounds every weight.

**Layout.** Output channels are stored in panels of 16, and within a panel input by input:
8-bit codes (both formats) are ``[N / 16, K, 16]``, so the 16 weights one input contributes to
16 outputs are one 16-byte row. A GEMV then reads each panel front to back and needs no
horizontal sums, a GEMM dequantizes a panel into rows its register tiles consume directly, and
a GPU tile of ``BLOCK_K x 16`` outputs is one contiguous run. 4-bit codes pack two
*consecutive inputs* of a channel into a byte, ``[N / 16, ceil(K / 2), 16]``: byte j of row i
holds ``q[16 p + j, 2 i]`` in its low nibble and ``q[16 p + j, 2 i + 1]`` in its high one, so
one 16-byte load gives two input rows of a panel after a mask and a shift. Group scales and
offsets follow the panels, ``[N / 16, G, 16]``. A partial last panel is padded with zero
channels (scale 0), an odd K (4 bits) with a zero input; ``group_size`` is a multiple of 32 and
the last group may be partial.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

PANEL = 16
INT8_MAX = 127
GROUP_MULTIPLE = 32
# Smallest step, so that an all-zero row or a constant group does not divide by zero.
MIN_SCALE = 1e-10
KV_MIN_SCALE = 1e-8


def _panels(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> [ceil(N / 16), 16, ...], zero-padded: rows grouped into panels."""
    n = t.shape[0]
    pad = -n % PANEL
    if pad:
        t = torch.cat((t, t.new_zeros((pad, *t.shape[1:]))))
    return t.view(-1, PANEL, *t.shape[1:])


def _unpanel(t: torch.Tensor, n: int) -> torch.Tensor:
    """[P, X, 16] -> [N, X]: the inverse of panelling a [N, X] tensor then moving its rows
    to the last axis."""
    return t.transpose(1, 2).reshape(-1, t.shape[1])[:n]


@dataclass(frozen=True)
class Int8Weight:
    qweight: torch.Tensor  # int8 [P, K, 16]
    scale: torch.Tensor  # fp32 [P * 16], zero for padded channels
    out_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.qweight.shape[1]

    def tensors(self) -> list[torch.Tensor]:
        return [self.qweight, self.scale]

    def codes(self) -> torch.Tensor:
        """q as [N, K]."""
        return _unpanel(self.qweight, self.out_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        scale = self.scale[: self.out_features, None]
        return (self.codes().to(torch.float32) * scale).to(dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows ``w[ids]`` in fp32 (an embedding lookup), without the rest."""
        q = self.qweight[ids // PANEL, :, ids % PANEL]
        return q.to(torch.float32) * self.scale[ids, None]


@dataclass(frozen=True)
class GroupWeight:
    qweight: torch.Tensor  # uint8: 8 bits [P, K, 16], 4 bits [P, ceil(K / 2), 16]
    scale: torch.Tensor  # fp32 [P, G, 16]
    offset: torch.Tensor  # fp32 [P, G, 16]
    out_features: int
    in_features: int
    group_size: int
    bits: int  # 4 or 8
    # 4 bits only: the codes again for int8 activations (``pack_a8``), or None.
    a8: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def tensors(self) -> list[torch.Tensor]:
        codes = [self.qweight] if self.a8 is None else [self.qweight, self.a8]
        return [*codes, self.scale, self.offset]

    def codes(self) -> torch.Tensor:
        """q as uint8 [N, K]."""
        q = self.qweight
        if self.bits == 4:
            pairs = torch.stack((q & 0xF, q >> 4), dim=2)  # [P, K/2, 2, 16]
            q = pairs.flatten(1, 2)[:, : self.in_features]
        return _unpanel(q, self.out_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k, g = self.out_features, self.in_features, self.group_size
        scale = _unpanel(self.scale, n).repeat_interleave(g, dim=1)[:, :k]
        offset = _unpanel(self.offset, n).repeat_interleave(g, dim=1)[:, :k]
        return (self.codes().to(torch.float32) * scale + offset).to(dtype)


QuantizedWeight = Int8Weight | GroupWeight


def a8_packable(weight: GroupWeight) -> bool:
    return weight.bits == 4 and weight.in_features % 8 == 0


def pack_a8(weight: GroupWeight) -> torch.Tensor:
    """4-bit codes laid out for products with int8 activations (``kernels/a8_kernels.c``):
    uint8 ``[P, K / 8, 64]``, byte ``4 j + t`` of row r holding ``q[16 p + j, 8 r + t]`` in
    its low nibble and ``q[16 p + j, 8 r + 4 + t]`` in its high one, so that each 32-bit lane
    of a 64-byte row is one channel's 4 consecutive inputs, as VNNI's dot products take them."""
    assert a8_packable(weight)
    q = _panels(weight.codes())  # [P, 16, K]
    p, k = q.shape[0], weight.in_features
    halves = q.view(p, PANEL, k // 8, 2, 4)  # input 8 r + 4 h + t
    packed = halves[:, :, :, 0] | (halves[:, :, :, 1] << 4)  # [P, 16, K / 8, 4]
    return packed.permute(0, 2, 1, 3).reshape(p, k // 8, 4 * PANEL).contiguous()


def check_group_size(group_size: int) -> None:
    if group_size < GROUP_MULTIPLE or group_size % GROUP_MULTIPLE:
        raise ValueError(f"group size must be a positive multiple of 32, got {group_size}")


def levels(bits: int) -> int:
    """The largest code of a group format: 15 for 4 bits, 255 for 8."""
    if bits not in (4, 8):
        raise ValueError(f"group formats have 4 or 8 bits, got {bits}")
    return (1 << bits) - 1


def int8_scale(weight: torch.Tensor) -> torch.Tensor:
    """Each output channel's step, absmax / 127 (fp32 [N])."""
    return (weight.detach().to(torch.float32).abs().amax(dim=1) / INT8_MAX).clamp_min(MIN_SCALE)


def pack_int8(codes: torch.Tensor, scale: torch.Tensor) -> Int8Weight:
    """The int8 format from codes [N, K] (integers in -127..127) and steps [N]."""
    q = codes.to(torch.int8)
    packed = _panels(q).transpose(1, 2).contiguous()
    return Int8Weight(packed, _panels(scale.float()).flatten().contiguous(), q.shape[0])


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Round to nearest, per output channel."""
    scale = int8_scale(weight)
    w = weight.detach().to(torch.float32)
    return pack_int8(torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX), scale)


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, K] -> [N, G, group_size]; a partial last group is padded with its own last value,
    which changes neither its minimum nor its maximum."""
    n, k = w.shape
    pad = -k % group_size
    if pad:
        w = torch.cat((w, w[:, -1:].expand(n, pad)), dim=1)
    return w.view(n, -1, group_size)


def group_range(
    weight: torch.Tensor, group_size: int, clip: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's (low, high) quantization range, [N, G] each. ``clip`` ([N, G] in (0, 1])
    narrows the range to within ``clip * absmax`` of zero (AWQ's weight clipping)."""
    groups = _groups(weight.detach().to(torch.float32), group_size)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    if clip is not None:
        bound = groups.abs().amax(dim=2) * clip.to(groups.device)
        low, high = torch.maximum(low, -bound), torch.minimum(high, bound)
    return low, high


def _group_codes(
    weight: torch.Tensor, group_size: int, clip: torch.Tensor | None, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [N, K] as floats, scale [N, G], offset [N, G])."""
    check_group_size(group_size)
    top = levels(bits)
    k = weight.shape[1]
    low, high = group_range(weight, group_size, clip)
    scale = ((high - low) / top).clamp_min(MIN_SCALE)
    groups = _groups(weight.detach().to(torch.float32), group_size)
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, top)
    return q.flatten(1)[:, :k], scale, low


def quantize_groups(
    weight: torch.Tensor, group_size: int, clip: torch.Tensor | None = None, *, bits: int = 4
) -> GroupWeight:
    """Round to nearest, asymmetric, per group (optionally within clipped ranges)."""
    q, scale, offset = _group_codes(weight, group_size, clip, bits)
    return pack_groups(q, scale, offset, group_size, bits=bits)


def pack_groups(
    codes: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    group_size: int,
    *,
    bits: int = 4,
) -> GroupWeight:
    """The group format from codes [N, K] (integers in 0..levels(bits)) and each group's step
    and offset [N, G]."""
    check_group_size(group_size)
    levels(bits)
    n, k = codes.shape
    packed = codes.to(torch.uint8)
    if bits == 4:
        pairs = F.pad(packed, (0, k % 2)).view(n, -1, 2)  # [N, K/2, 2]
        packed = pairs[..., 0] | (pairs[..., 1] << 4)

    def by_panel(t: torch.Tensor) -> torch.Tensor:
        return _panels(t).transpose(1, 2).contiguous()

    return GroupWeight(by_panel(packed), by_panel(scale), by_panel(offset), n, k, group_size, bits)


def fake_quantize_groups(
    weight: torch.Tensor, group_size: int, clip: torch.Tensor | None = None, *, bits: int = 4
) -> torch.Tensor:
    """``quantize_groups(...).dequantize()`` without the packing: calibration's inner loop."""
    q, scale, offset = _group_codes(weight, group_size, clip, bits)
    g = group_size
    k = weight.shape[1]
    return q * scale.repeat_interleave(g, dim=1)[:, :k] + offset.repeat_interleave(g, dim=1)[:, :k]


def quantize_kv_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 KV cache's format: each row (last dim, one token's head) symmetric with its own
    fp32 scale absmax / 127, rounded half up as the kernels do. Returns (int8 rows, scales)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / INT8_MAX).clamp_min(KV_MIN_SCALE)
    q = torch.floor(xf / scale[..., None] + 0.5).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale
