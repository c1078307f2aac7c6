"""Fused RMSNorm(+residual), RoPE and SiLU-and-mul kernels against their fp32 references.

fp32 inputs must agree to rounding; bf16 to within its precision (the interpreter truncates
when it narrows to bf16, a GPU rounds, so bf16 is compared by tolerance on both).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, PreTrainedConfig, Qwen3Config

from ladle.runtime.kernels import cpu_kernels
from ladle.runtime.kernels.fused import (
    rms_norm,
    rms_norm_ref,
    rotary_embedding,
    rotary_embedding_ref,
    silu_and_mul,
    silu_and_mul_ref,
)
from ladle.runtime.models.config import model_config_from_hf

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any()
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_and_without_residual(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    hidden = 96  # not a power of two: the tail of the block is masked
    # x as a strided view (rows of a wider buffer), as when it comes out of a split.
    wide = torch.randn(5, 2 * hidden, device=DEVICE).to(dtype)
    x = wide[:, :hidden]
    residual = torch.randn(5, hidden, device=DEVICE).to(dtype)
    weight = (torch.rand(hidden, device=DEVICE) + 0.5).to(dtype)

    out, none = rms_norm(x, weight, 1e-6)
    assert none is None
    assert rel_err(out, rms_norm_ref(x, weight, 1e-6)[0]) < TOLERANCE[dtype]

    out, new_residual = rms_norm(x, weight, 1e-6, residual)
    ref, ref_residual = rms_norm_ref(x, weight, 1e-6, residual)
    assert new_residual is not None
    assert ref_residual is not None
    assert rel_err(out, ref) < TOLERANCE[dtype]
    if dtype == torch.float32:
        assert torch.equal(new_residual, ref_residual)
    else:
        torch.testing.assert_close(new_residual, ref_residual, rtol=1e-2, atol=1e-2)
    # Per-head norm (Qwen3's q/k norm): [T, H, D] normalized over D.
    heads = torch.randn(3, 4, 32, device=DEVICE).to(dtype)
    w32 = weight[:32]
    assert (
        rel_err(rms_norm(heads, w32, 1e-6)[0], rms_norm_ref(heads, w32, 1e-6)[0])
        < (TOLERANCE[dtype])
    )


def _rope_tables(config: PreTrainedConfig, positions: torch.Tensor) -> torch.Tensor:
    """Per-token cos/sin rows built as the model builds them, scaling included."""
    cfg = model_config_from_hf(config)
    freqs = positions.float()[:, None] * cfg.inv_freq[None, :]
    return torch.stack((freqs.cos(), freqs.sin())) * cfg.rope_attention_scaling


ROPE_CONFIGS = {
    "llama3-scaled": LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        architectures=["LlamaForCausalLM"],
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "yarn-head128": Qwen3Config(
        hidden_size=256,
        head_dim=128,
        num_attention_heads=3,
        num_key_value_heads=1,
        architectures=["Qwen3ForCausalLM"],
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
}


@pytest.mark.parametrize("name", list(ROPE_CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding_in_place_on_qkv_views(name: str, dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    config = ROPE_CONFIGS[name]
    cfg = model_config_from_hf(config)
    tokens, dim = 5, cfg.head_dim
    q_size, kv_size = cfg.q_size, cfg.kv_size
    positions = torch.tensor([0, 7, 63, 64, 300])
    cos, sin = _rope_tables(config, positions).to(DEVICE, dtype)
    qkv = torch.randn(tokens, q_size + 2 * kv_size, device=DEVICE).to(dtype)
    before = qkv.clone()
    q = qkv[:, :q_size].view(tokens, cfg.num_heads, dim)
    k = qkv[:, q_size : q_size + kv_size].view(tokens, cfg.num_kv_heads, dim)
    ref_q = rotary_embedding_ref(q, cos, sin)
    ref_k = rotary_embedding_ref(k, cos, sin)
    rotary_embedding(q, k, cos[:, None, :], sin[:, None, :])
    assert rel_err(q, ref_q) < TOLERANCE[dtype]
    assert rel_err(k, ref_k) < TOLERANCE[dtype]
    assert torch.equal(qkv[:, q_size + kv_size :], before[:, q_size + kv_size :])  # v intact
    assert not torch.equal(q[1:], before[1:, :q_size].view_as(q[1:]))  # it did rotate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    width = 1100  # two column blocks of 1024, the second one partial
    x = (torch.randn(3, 2 * width, device=DEVICE) * 3).to(dtype)
    out = silu_and_mul(x)
    assert out.shape == (3, width)
    assert out.dtype == dtype
    assert rel_err(out, silu_and_mul_ref(x)) < TOLERANCE[dtype]


def test_cpu_rms_norm_kernel_with_and_without_residual() -> None:
    lib = cpu_kernels.load()
    assert lib is not None, "the C kernels must build on the test machines"
    torch.manual_seed(2)
    hidden = 96
    for rows in (5, 2048):  # below and above the size where it goes multi-threaded
        wide = torch.randn(rows, 2 * hidden)
        x = wide[:, :hidden]  # a strided view, as when it comes out of a split
        residual = torch.randn(rows, hidden)
        weight = torch.rand(hidden) + 0.5
        out = cpu_kernels.rms_norm(lib, x, weight, 1e-6)
        assert rel_err(out, rms_norm_ref(x, weight, 1e-6)[0]) < TOLERANCE[torch.float32]
        ref, ref_residual = rms_norm_ref(x, weight, 1e-6, residual)
        out = cpu_kernels.rms_norm(lib, x, weight, 1e-6, residual)  # residual += x in place
        assert rel_err(out, ref) < TOLERANCE[torch.float32]
        assert ref_residual is not None
        assert torch.equal(residual, ref_residual)
    heads = torch.randn(3, 4, 32)  # Qwen3's per-head q/k norm
    assert (
        rel_err(
            cpu_kernels.rms_norm(lib, heads, weight[:32], 1e-6),
            rms_norm_ref(heads, weight[:32], 1e-6)[0],
        )
        < TOLERANCE[torch.float32]
    )


@pytest.mark.parametrize("name", list(ROPE_CONFIGS))
def test_cpu_rope_kernel_in_place_on_qkv_views(name: str) -> None:
    lib = cpu_kernels.load()
    assert lib is not None
    torch.manual_seed(4)
    config = ROPE_CONFIGS[name]
    cfg = model_config_from_hf(config)
    dim, q_size, kv_size = cfg.head_dim, cfg.q_size, cfg.kv_size
    for tokens in (5, 100):  # below and above the size where it goes multi-threaded
        positions = torch.arange(tokens) * 3
        cos, sin = _rope_tables(config, positions)
        qkv = torch.randn(tokens, q_size + 2 * kv_size)
        before = qkv.clone()
        q = qkv[:, :q_size].view(tokens, cfg.num_heads, dim)
        k = qkv[:, q_size : q_size + kv_size].view(tokens, cfg.num_kv_heads, dim)
        ref_q, ref_k = rotary_embedding_ref(q, cos, sin), rotary_embedding_ref(k, cos, sin)
        cpu_kernels.rope_(lib, q, k, cos[:, None, :], sin[:, None, :])
        assert rel_err(q, ref_q) < TOLERANCE[torch.float32]
        assert rel_err(k, ref_k) < TOLERANCE[torch.float32]
        assert torch.equal(qkv[:, q_size + kv_size :], before[:, q_size + kv_size :])
    # Separate contiguous q and k (after Qwen3's per-head norms): different token strides.
    q, k = torch.randn(tokens, cfg.num_heads, dim), torch.randn(tokens, cfg.num_kv_heads, dim)
    ref_q, ref_k = rotary_embedding_ref(q, cos, sin), rotary_embedding_ref(k, cos, sin)
    cpu_kernels.rope_(lib, q, k, cos, sin)
    assert rel_err(q, ref_q) < TOLERANCE[torch.float32]
    assert rel_err(k, ref_k) < TOLERANCE[torch.float32]


def test_cpu_silu_and_mul_kernel() -> None:
    lib = cpu_kernels.load()
    assert lib is not None
    torch.manual_seed(5)
    for rows, width in ((3, 1100), (200, 1536)):  # a scalar tail; the multi-threaded size
        x = torch.randn(rows, 2 * width) * 3
        x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -30.0])  # both clamps, zero, underflow
        out = cpu_kernels.silu_and_mul(lib, x)
        assert out.shape == (rows, width)
        assert rel_err(out, silu_and_mul_ref(x)) < TOLERANCE[torch.float32]
        torch.testing.assert_close(out, silu_and_mul_ref(x), rtol=1e-6, atol=1e-6)
