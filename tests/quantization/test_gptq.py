"""GPTQ: lower output error than round to nearest on correlated inputs, in the very formats the
kernels read, deterministically; and the sequential pass through a whole model at load."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ladle.runtime import LLM
from ladle.runtime.config import QuantizationConfig
from ladle.runtime.models.scoring import hidden_states
from ladle.runtime.quantization import gptq
from ladle.runtime.quantization.formats import (
    GroupWeight,
    Int8Weight,
    QuantizedWeight,
    quantize_groups,
    quantize_int8,
)
from ladle.runtime.quantization.linear import QuantizedLinear

CONFIGS = [
    QuantizationConfig("int8", "gptq"),
    QuantizationConfig("int8", "gptq", 32),
    QuantizationConfig("int4", "gptq", 32),
    QuantizationConfig("int4", "gptq", 64),
]


def correlated_inputs(rows: int, k: int, seed: int) -> torch.Tensor:
    """Rows from one distribution (fixed per K) whose channels are strongly correlated and of
    unequal size, as a layer's inputs are; ``seed`` draws the rows."""
    fixed = torch.Generator().manual_seed(k)
    basis = torch.randn(k // 4, k, generator=fixed)
    sizes = torch.logspace(-0.5, 0.5, k)[torch.randperm(k, generator=fixed)]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k // 4, generator=gen) @ basis + 0.3 * torch.randn(rows, k, generator=gen)
    return x * sizes


def rtn(weight: torch.Tensor, config: QuantizationConfig) -> QuantizedWeight:
    if config.group_size is None:
        return quantize_int8(weight)
    return quantize_groups(weight, config.group_size, bits=config.bits)


def output_error(x: torch.Tensor, w: torch.Tensor, q: QuantizedWeight) -> float:
    return float((x @ (q.dequantize() - w).T).pow(2).mean())


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.describe())
def test_gptq_lowers_output_error_against_rtn_on_correlated_inputs(
    config: QuantizationConfig,
) -> None:
    n, k = 48, 256
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    calib, held_out = correlated_inputs(4096, k, seed=2), correlated_inputs(2048, k, seed=3)
    q = gptq.gptq(w, gptq.hessian(calib), config)
    base = rtn(w, config)
    for x in (calib, held_out):  # and on fresh inputs from the same distribution
        assert output_error(x, w, q) < 0.8 * output_error(x, w, base)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.describe())
@pytest.mark.parametrize(("n", "k"), [(20, 96), (7, 101)])
def test_gptq_writes_the_formats_the_kernels_read(
    config: QuantizationConfig, n: int, k: int
) -> None:
    """Same classes, shapes, dtypes and code ranges as round to nearest (odd K, a partial
    panel and a partial last group included); int8 keeps each row's absmax / 127 step."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
    q = gptq.gptq(w, gptq.hessian(correlated_inputs(512, k, seed=k)), config)
    base = rtn(w, config)
    assert type(q) is type(base)
    assert q.shape == base.shape == (n, k)
    for ours, theirs in zip(q.tensors(), base.tensors(), strict=True):
        assert (ours.shape, ours.dtype) == (theirs.shape, theirs.dtype)
    if isinstance(q, Int8Weight):
        assert torch.equal(q.scale, base.scale)
        assert q.codes().abs().max() <= 127
    else:
        assert isinstance(q, GroupWeight)
        assert isinstance(base, GroupWeight)
        assert q.codes().max() <= (1 << config.bits) - 1
        assert (q.group_size, q.bits) == (base.group_size, base.bits)
    # Dequantized, each weight is still within reach of where it was: GPTQ moves weights by
    # the errors it compensates, not arbitrarily.
    assert float((q.dequantize() - w).abs().max()) < float(w.abs().max())


def test_gptq_is_deterministic() -> None:
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(5))
    h = gptq.hessian(correlated_inputs(1024, 128, seed=6))
    for config in CONFIGS:
        a, b = gptq.gptq(w, h, config), gptq.gptq(w, h, config)
        assert all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors(), strict=True))


def test_an_input_never_seen_in_calibration_still_rounds() -> None:
    """A zero column of H (an input that was always zero) must not break the solve."""
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(7))
    x = correlated_inputs(512, 64, seed=8)
    x[:, 10] = 0.0
    q = gptq.gptq(w, gptq.hessian(x), QuantizationConfig("int8", "gptq"))
    assert torch.isfinite(q.dequantize()).all()
    assert float((q.dequantize()[:, 10] - w[:, 10]).abs().max()) <= float(q.scale.max()) / 2


@pytest.mark.parametrize("method", ["gptq", "awq-gptq"])
def test_gptq_quantizes_a_model_at_load_sequentially(
    tiny_model: Callable[[str], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    method: str,
) -> None:
    """Through ``LLM(...)``: every projection is quantized, and the model's outputs stay close
    to full precision's, closer than round to nearest's on the calibration text."""
    monkeypatch.setenv("LADLE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gptq, "CALIBRATION_SEQUENCES", 4)
    monkeypatch.setattr(gptq, "CALIBRATION_LENGTH", 64)
    path = tiny_model("llama")
    engine = {"num_gpu_blocks_override": 128, "block_size": 4}
    fp32 = LLM(str(path), **engine)
    probe = gptq.calibration_sequences(path)
    reference = torch.cat(hidden_states_of(fp32, probe))
    errors = {}
    for m in ("rtn", method):
        llm = LLM(str(path), **engine, quantization="int4", quantization_method=m)
        layer = llm.engine.model.layers[0]
        assert all(isinstance(getattr(layer, n), QuantizedLinear) for n in gptq.LINEARS)
        errors[m] = float((torch.cat(hidden_states_of(llm, probe)) - reference).pow(2).mean())
    assert errors[method] < errors["rtn"]


def hidden_states_of(llm: LLM, sequences: list[list[int]]) -> list[torch.Tensor]:
    return hidden_states(llm.engine.model, sequences)
