"""Turn a loaded full-precision model into a quantized one, in place.

The projections of every layer take the configured format. The LM head is int8 per output
channel whatever the projections use: in a small model it is the largest matrix (28% of
SmolLM2-135M's weights) and at batch 1 it is read once per step like the rest, while its
errors land on the logits directly, so 4 bits would cost the most quality where it is most
visible (llama.cpp's 4-bit types keep it at 6 bits or more for the same reason). Embeddings
are int8 per row; a tied LM head and its embedding share one int8 table.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ladle.runtime.config import QuantizationConfig
from ladle.runtime.kernels import cpu_kernels, quant_ops
from ladle.runtime.models.llama import LlamaModel
from ladle.runtime.quantization import awq, gptq
from ladle.runtime.quantization.formats import (
    GroupWeight,
    QuantizedWeight,
    a8_packable,
    pack_a8,
    quantize_groups,
    quantize_int8,
)
from ladle.runtime.quantization.linear import (
    DenseEmbedding,
    DenseLinear,
    Int8Embedding,
    Kernels,
    Linear,
    QuantizedLinear,
)


def kernels_for_backend(attention_backend: str) -> Kernels:
    """Quantized products run where the backend's other kernels do: C on CPUs, Triton on
    GPUs, the torch reference with the torch backend."""
    if attention_backend in ("cpu", "triton"):
        return attention_backend  # type: ignore[return-value]
    return "torch"


def quantize_model(
    model: LlamaModel,
    config: QuantizationConfig,
    calibration: awq.Calibration | None = None,
    sequences: list[list[int]] | None = None,
) -> None:
    """Quantize ``model``'s weights as ``config`` says. AWQ needs ``calibration`` (the scales
    and clip ratios :func:`awq.calibrate` found for this model), and folds its scales into
    the weights first; GPTQ needs calibration ``sequences`` (token ids) to round on."""
    if not config.enabled:
        return
    kernels = kernels_for_backend(model.attention.name)
    clips: dict[tuple[int, str], torch.Tensor] = {}
    if config.uses_awq:
        if calibration is None:
            raise ValueError("AWQ quantization needs a calibration")
        awq.apply_scales(model, calibration)
        clips = dict(calibration.clips)
    rounded: dict[tuple[int, str], QuantizedWeight] | None = None
    if config.uses_gptq:
        if sequences is None:
            raise ValueError("GPTQ quantization needs calibration sequences")
        rounded = gptq.quantize_sequential(model, config, sequences, clips)

    def quantize(linear: Linear, key: tuple[int, str]) -> Linear:
        assert isinstance(linear, DenseLinear), "weights are quantized once, at load"
        weight: QuantizedWeight
        if rounded is not None:
            weight = rounded[key]
        elif config.group_size is None:
            weight = quantize_int8(linear.weight)
        else:
            weight = quantize_groups(
                linear.weight, config.group_size, clips.get(key), bits=config.bits
            )
        return QuantizedLinear(weight, linear.bias, kernels)

    for i, layer in enumerate(model.layers):
        layer.qkv = quantize(layer.qkv, (i, "qkv"))
        layer.o_proj = quantize(layer.o_proj, (i, "o_proj"))
        layer.gate_up = quantize(layer.gate_up, (i, "gate_up"))
        layer.down = quantize(layer.down, (i, "down"))
    head, embed = model.lm_head, model.embed
    assert isinstance(head, DenseLinear)
    assert isinstance(embed, DenseEmbedding)
    head_q = quantize_int8(head.weight)
    tied = head.weight.data_ptr() == embed.weight.data_ptr()
    model.lm_head = QuantizedLinear(head_q, head.bias, kernels)
    model.embed = Int8Embedding(head_q if tied else quantize_int8(embed.weight), model.dtype)


def quantize_at_load(
    model: LlamaModel,
    config: QuantizationConfig,
    model_path: Path,
    calibration: awq.Calibration | None = None,
) -> None:
    """The engine's entry point: calibrate if the method needs it and no ``calibration`` is
    given (AWQ's result is cached per model and settings; GPTQ runs at every load), then
    quantize."""
    if not config.enabled:
        return
    if config.uses_awq and calibration is None:
        calibration = awq.calibration_for(model, config, model_path)
    sequences = gptq.calibration_sequences(model_path) if config.uses_gptq else None
    quantize_model(model, config, calibration, sequences)


def int8_activations(model: LlamaModel) -> int:
    """Give the model's 4-bit CPU projections codes for int8 activations (``formats.pack_a8``)
    where this CPU multiplies int8 natively (AVX-512 VNNI), so that its decode GEMVs round
    their activations as llama.cpp's do; returns how many it gave them to.

    Not for a served model: its numerics would no longer be those the quality table measures.
    Larger products (prefill) keep the weight-only kernels, so each weight holds its codes
    twice (half a byte a weight more)."""
    packable = [
        linear
        for layer in model.layers
        for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
        if isinstance(linear, QuantizedLinear)
        and linear.kernels == "cpu"
        and isinstance(linear.weight, GroupWeight)
        and a8_packable(linear.weight)
    ]
    lib = cpu_kernels.load() if packable else None
    if lib is None or not quant_ops.a8_supported(lib):
        return 0
    for linear in packable:
        assert isinstance(linear.weight, GroupWeight)
        linear.weight = dataclasses.replace(linear.weight, a8=pack_a8(linear.weight))
    return len(packable)
