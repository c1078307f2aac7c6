"""Quantized weight formats, with the torch reference that defines their numerics.

Both keep the linear layer's ``[out_features, in_features]`` orientation and are dequantized to
fp32 (or the activations' dtype) inside the kernels, never in memory:

* **int8**, per output channel, symmetric: ``w = q * scale[n]``, q in -127..127, one fp32
  scale per row (absmax / 127). Rounding error is at most half a step, ``scale[n] / 2``.
* **int4**, in groups of ``group_size`` along the input, asymmetric: ``w = q * scale[n, g] +
  offset[n, g]``, q in 0..15, the step spanning the group's [min, max] range (narrowed by an
  optional clip ratio). The offset is a float, not an integer zero point, so a group's minimum
  is represented exactly and its error is at most half a step. Values are packed two to a byte
  in blocks of 32 along the input: byte j of a block holds weight j in its low nibble and
  weight j + 16 in its high nibble, so one 16-byte load unpacks into two runs of 16
  consecutive weights. Rows are padded to whole blocks; ``group_size`` is a multiple of 32 so
  that a block never straddles groups, and the last group may be partial.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

INT4_BLOCK = 32
INT4_MAX = 15
INT8_MAX = 127
# Smallest step, so that an all-zero row or a constant group does not divide by zero.
MIN_SCALE = 1e-10
KV_MIN_SCALE = 1e-8


@dataclass(frozen=True)
class Int8Weight:
    qweight: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # fp32 [N]

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.qweight.shape
        return n, k

    def tensors(self) -> list[torch.Tensor]:
        return [self.qweight, self.scale]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.qweight.to(torch.float32) * self.scale[:, None]).to(dtype)


@dataclass(frozen=True)
class Int4Weight:
    qweight: torch.Tensor  # uint8 [N, ceil(K / 32) * 16], see the module docstring
    scale: torch.Tensor  # fp32 [N, ceil(K / group_size)]
    offset: torch.Tensor  # fp32 [N, ceil(K / group_size)]
    in_features: int
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.in_features

    def tensors(self) -> list[torch.Tensor]:
        return [self.qweight, self.scale, self.offset]

    def unpack(self) -> torch.Tensor:
        """The 4-bit values, uint8 [N, K]."""
        n = self.qweight.shape[0]
        blocks = self.qweight.view(n, -1, INT4_BLOCK // 2)
        q = torch.stack((blocks & 0xF, blocks >> 4), dim=2).view(n, -1)
        return q[:, : self.in_features]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        g = self.group_size
        scale = self.scale.repeat_interleave(g, dim=1)[:, : self.in_features]
        offset = self.offset.repeat_interleave(g, dim=1)[:, : self.in_features]
        return (self.unpack().to(torch.float32) * scale + offset).to(dtype)


QuantizedWeight = Int8Weight | Int4Weight


def quantize_kv_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 KV cache's format: each row (last dim, one token's head) symmetric with its own
    fp32 scale absmax / 127, rounded half up as the kernels do. Returns (int8 rows, scales)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / INT8_MAX).clamp_min(KV_MIN_SCALE)
    q = torch.floor(xf / scale[..., None] + 0.5).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def check_group_size(group_size: int) -> None:
    if group_size < INT4_BLOCK or group_size % INT4_BLOCK:
        raise ValueError(f"int4 group size must be a positive multiple of 32, got {group_size}")


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Round to nearest, per output channel."""
    w = weight.detach().to(torch.float32)
    scale = (w.abs().amax(dim=1) / INT8_MAX).clamp_min(MIN_SCALE)
    q = torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weight(q.contiguous(), scale.contiguous())


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, K] -> [N, G, group_size]; a partial last group is padded with its own last value,
    which changes neither its minimum nor its maximum."""
    n, k = w.shape
    pad = -k % group_size
    if pad:
        w = torch.cat((w, w[:, -1:].expand(n, pad)), dim=1)
    return w.view(n, -1, group_size)


def int4_range(
    weight: torch.Tensor, group_size: int, clip: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's (low, high) quantization range, [N, G] each. ``clip`` ([N, G] in (0, 1])
    narrows the range to within ``clip * absmax`` of zero (AWQ's weight clipping)."""
    groups = _groups(weight.detach().to(torch.float32), group_size)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    if clip is not None:
        bound = groups.abs().amax(dim=2) * clip
        low, high = torch.maximum(low, -bound), torch.minimum(high, bound)
    return low, high


def _int4_codes(
    weight: torch.Tensor, group_size: int, clip: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [N, G, group_size] as floats, scale [N, G], offset [N, G])."""
    check_group_size(group_size)
    low, high = int4_range(weight, group_size, clip)
    scale = ((high - low) / INT4_MAX).clamp_min(MIN_SCALE)
    groups = _groups(weight.detach().to(torch.float32), group_size)
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, INT4_MAX)
    return q, scale, low


def quantize_int4(
    weight: torch.Tensor, group_size: int, clip: torch.Tensor | None = None
) -> Int4Weight:
    """Round to nearest, asymmetric, per group (optionally within clipped ranges)."""
    n, k = weight.shape
    q, scale, offset = _int4_codes(weight, group_size, clip)
    codes = F.pad(q.view(n, -1)[:, :k].to(torch.uint8), (0, -k % INT4_BLOCK))
    blocks = codes.view(n, -1, 2, INT4_BLOCK // 2)
    packed = blocks[:, :, 0] | (blocks[:, :, 1] << 4)
    return Int4Weight(
        packed.reshape(n, -1).contiguous(), scale.contiguous(), offset.contiguous(), k, group_size
    )


def fake_quantize_int4(
    weight: torch.Tensor, group_size: int, clip: torch.Tensor | None = None
) -> torch.Tensor:
    """``quantize_int4(...).dequantize()`` without the packing: calibration's inner loop."""
    n, k = weight.shape
    q, scale, offset = _int4_codes(weight, group_size, clip)
    return (q * scale[..., None] + offset[..., None]).view(n, -1)[:, :k]
