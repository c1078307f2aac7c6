"""GPTQ (Frantar et al., 2022): rounding that compensates each weight's error in the others.

Round to nearest treats every weight alone. GPTQ quantizes a linear's input columns one by one
and spreads each column's rounding error over the columns not yet quantized, weighted by how
the layer's inputs correlate, so that the *output* error ``||X W^T - X Q^T||`` stays small
rather than each weight's. With ``H = 2 X^T X`` over calibration inputs (dampened by a tenth of its
mean diagonal) and ``U`` the upper Cholesky factor of ``H^-1``, column i's error
``(w_i - q_i) / U[i, i]`` is subtracted from the later columns times ``U[i, i+1:]``. Columns
are processed in blocks of 128, the updates to later blocks batched into one product.

The result is ordinary codes and scales: int8 per output channel (the step fixed up front,
``absmax / 127`` of the row), int4 and grouped int8 per group (each group's range taken when
GPTQ reaches it, from the weights as earlier errors have moved them). The kernels are unchanged.

**Sequential.** One forward pass runs over all calibration tokens with every linear replaced
by a stand-in that, on its one call, quantizes its weight on the inputs it receives and returns
the quantized layer's output. Each layer is therefore calibrated on what the quantized layers
before it produce, as in GPTQ's sequential mode, at the cost of a single forward. The LM head
stays int8 round to nearest (see ``apply``): GPTQ on it lowered KLD but not top-1 agreement,
and its rows are the tied embedding's too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from ladle.runtime.attention.backend import KVCacheSpec
from ladle.runtime.attention.torch_backend import TorchAttentionBackend
from ladle.runtime.config import QuantizationConfig
from ladle.runtime.models.llama import LlamaModel
from ladle.runtime.models.scoring import hidden_states
from ladle.runtime.quantization import awq
from ladle.runtime.quantization.formats import (
    INT8_MAX,
    MIN_SCALE,
    QuantizedWeight,
    group_range,
    int8_scale,
    levels,
    pack_groups,
    pack_int8,
)
from ladle.runtime.quantization.linear import DenseLinear

log = logging.getLogger(__name__)

BLOCK = 128
# A tenth of the mean diagonal rather than GPTQ's 1%: the calibration text is narrow (English
# and Python) and a weaker prior on its correlations generalizes better to other text.
DAMP = 0.1
CALIBRATION_SEQUENCES = 32
CALIBRATION_LENGTH = 256
LINEARS = ("qkv", "o_proj", "gate_up", "down")

Key = tuple[int, str]


def inverse_hessian_factor(hessian: torch.Tensor) -> torch.Tensor:
    """The upper Cholesky factor of the dampened ``H^-1`` (float64 for the solve). Inputs that
    were always zero get a unit diagonal: their columns round alone and move nothing else."""
    h = hessian.to(torch.float64).clone()
    diag = h.diagonal()
    diag[diag == 0] = 1.0
    diag += DAMP * diag.mean()
    # H^-1 = L^-T L^-1 (torch.cholesky_inverse is several times slower on CPUs).
    lower_inv = torch.linalg.solve_triangular(
        torch.linalg.cholesky(h), torch.eye(h.shape[0], dtype=h.dtype, device=h.device), upper=False
    )
    inverse = lower_inv.T @ lower_inv
    factor: torch.Tensor = torch.linalg.cholesky(inverse, upper=True)
    return factor.to(torch.float32)


def gptq(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    config: QuantizationConfig,
    clip: torch.Tensor | None = None,
) -> QuantizedWeight:
    """Quantize ``weight`` [N, K] to ``config``'s format, minimizing the output error on inputs
    whose ``2 X^T X`` is ``hessian`` [K, K]. ``clip`` ([N, G], int4) narrows each group's range
    as in :func:`formats.group_range`."""
    # Input-major: column i of the weight is the contiguous row i, so the updates stream.
    w = weight.detach().to(torch.float32).T.contiguous()
    k, n = w.shape
    u = inverse_hessian_factor(hessian.to(w.device))
    codes = torch.empty_like(w)
    int8 = config.group_size is None  # per output channel, symmetric
    group = k if config.group_size is None else config.group_size
    top = levels(config.bits)
    block = BLOCK if int8 else group * max(1, BLOCK // group)
    scale = int8_scale(weight)[None, :] if int8 else w.new_empty(-(-k // group), n)
    offset = w.new_zeros(scale.shape)
    for start in range(0, k, block):
        end = min(start + block, k)
        w1, u1 = w[start:end].clone(), u[start:end, start:end]
        errors = torch.empty_like(w1)
        for i in range(end - start):
            g, first = divmod(start + i, group)
            if first == 0 and not int8:
                cols = w1[i : i + group].T.contiguous()
                low, high = group_range(cols, group, None if clip is None else clip[:, g : g + 1])
                scale[g] = ((high - low)[:, 0] / top).clamp_min(MIN_SCALE)
                offset[g] = low[:, 0]
            x, s, o = w1[i], scale[g], offset[g]
            if int8:
                q = torch.round(x / s).clamp_(-INT8_MAX, INT8_MAX)
            else:
                q = torch.round((x - o) / s).clamp_(0, top)
            codes[start + i] = q
            err = (x - (q * s + o)) / u1[i, i]
            w1[i + 1 :] -= u1[i, i + 1 :, None] * err[None, :]
            errors[i] = err
        w[end:] -= u[start:end, end:].T @ errors
    if int8:
        return pack_int8(codes.T, scale[0])
    return pack_groups(codes.T, scale.T, offset.T, group, bits=config.bits)


Quantize = Callable[[Key, torch.Tensor, torch.Tensor], QuantizedWeight]


class _Standin:
    """A linear during the calibration pass: on its one call, GPTQ on the inputs it is given,
    then the quantized layer's output."""

    def __init__(self, key: Key, inner: DenseLinear, quantize: Quantize) -> None:
        self.key = key
        self.inner = inner
        self.quantize = quantize
        self.result: QuantizedWeight | None = None

    def tensors(self) -> list[torch.Tensor]:
        return self.inner.tensors()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        assert self.result is None, "GPTQ calibrates in one forward over every token"
        self.result = self.quantize(self.key, self.inner.weight, hessian(x))
        return F.linear(x, self.result.dequantize(x.dtype), self.inner.bias)


def calibration_sequences(model_path: Path) -> list[list[int]]:
    """The token windows GPTQ rounds on: AWQ's calibration text, more of it (a Hessian over K
    inputs needs many more than K tokens to be estimated)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return awq.calibration_sequences(tokenizer, CALIBRATION_SEQUENCES, CALIBRATION_LENGTH)


def hessian(x: torch.Tensor) -> torch.Tensor:
    """``2 X^T X / n`` over the rows of ``x`` (the scale is irrelevant to GPTQ)."""
    xf = x.reshape(-1, x.shape[-1]).to(torch.float32)
    return 2.0 * (xf.T @ xf) / xf.shape[0]


def quantize_sequential(
    model: LlamaModel,
    config: QuantizationConfig,
    sequences: list[list[int]],
    clips: dict[Key, torch.Tensor] | None = None,
) -> dict[Key, QuantizedWeight]:
    """GPTQ for every projection of ``model``, each on the inputs the already quantized layers
    before it produce for ``sequences`` (all in one forward). ``model`` is not changed."""
    cfg = model.config
    spec = KVCacheSpec(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.attention.spec.block_size, model.dtype
    )
    view = model.with_attention(TorchAttentionBackend(spec, model.device))
    started = time.monotonic()
    done = 0

    def quantize(key: Key, weight: torch.Tensor, h: torch.Tensor) -> QuantizedWeight:
        nonlocal done
        result = gptq(weight, h, config, None if clips is None else clips.get(key))
        done += 1
        if done % len(LINEARS) == 0:  # a layer done: progress, as GPTQ takes a while
            log.info(
                "GPTQ",
                extra={
                    "layers": f"{done // len(LINEARS)}/{len(view.layers)}",
                    "seconds": round(time.monotonic() - started, 1),
                },
            )
        return result

    standins: list[_Standin] = []
    for i, layer in enumerate(view.layers):
        for name in LINEARS:
            inner = getattr(layer, name)
            assert isinstance(inner, DenseLinear), "weights are quantized once, at load"
            standin = _Standin((i, name), inner, quantize)
            standins.append(standin)
            setattr(layer, name, standin)
    hidden_states(view, sequences)
    log.info(
        "quantized with GPTQ",
        extra={
            "quantization": config.describe(),
            "tokens": sum(map(len, sequences)),
            "seconds": round(time.monotonic() - started, 1),
        },
    )
    return {s.key: s.result for s in standins if s.result is not None}
