"""Quantized GEMV/GEMM (C and Triton) and the CPU int8 KV cache against float64 references.

The C kernels are built once per instruction-set path this CPU can run: the native build
(AVX-512 here when the CPU has it), ``-mno-avx512f`` (the AVX2 path) and without AVX2 (the
portable C), so every path is checked on one machine.
"""

from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch

from ladle.runtime.kernels import cpu_kernels, quant_ops
from ladle.runtime.kernels.quant_gemm import quantized_linear
from ladle.runtime.quantization.formats import (
    GroupWeight,
    Int8Weight,
    pack_a8,
    quantize_groups,
    quantize_int8,
    quantize_kv_rows,
)

from .conftest import BUILDS, DEVICE

# (rows of x, N, K, group size): GEMV (up to 4 rows), GEMM (more) and the dequantized weight
# through torch's GEMM (from DEQUANTIZE_ROWS), K off every vector width and past one
# dequantized chunk, partial last groups, N off the panel and register tiles.
SHAPES = [
    (1, 7, 100, 64),
    (3, 33, 576, 64),
    (4, 19, 1000, 128),
    (5, 17, 31, 32),
    (37, 70, 2050, 96),
    (8, 960, 576, 64),
    (quant_ops.DEQUANTIZE_ROWS - 1, 40, 96, 32),
    (quant_ops.DEQUANTIZE_ROWS, 33, 2050, 96),
    (300, 17, 31, 32),
]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.isfinite().all()
    return float((out.double() - ref).norm() / ref.norm())


def reference(
    x: torch.Tensor, w: Int8Weight | GroupWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    y = x.double() @ w.dequantize().double().T
    return y if bias is None else y + bias.double()


@pytest.fixture(scope="module", params=list(BUILDS))
def lib(request: pytest.FixtureRequest) -> ctypes.CDLL:
    if cpu_kernels.compiler() is None:
        pytest.skip("no C compiler (cc or gcc) on PATH")
    built = cpu_kernels.load(BUILDS[request.param])
    # With a compiler, None is a failed build or load (its error is logged): a defect.
    assert built is not None, f"the {request.param} build of the CPU kernels failed"
    expected = {"avx2": "avx2", "portable": "portable"}.get(request.param)
    if expected is not None:
        assert quant_ops.isa(built) == expected
    return built


@pytest.mark.parametrize(("m", "n", "k", "group"), SHAPES)
def test_cpu_linear_matches_float64(lib: ctypes.CDLL, m: int, n: int, k: int, group: int) -> None:
    torch.manual_seed(m * n + k)
    # x as every other row of a wider buffer: the kernels take a row stride.
    x = torch.randn(2 * m, k + 3)[::2, :k]
    w = torch.randn(n, k)
    bias = torch.randn(n) if m % 2 else None
    for q in (quantize_int8(w), quantize_groups(w, group), quantize_groups(w, group, bits=8)):
        y = quant_ops.linear(lib, x, q, bias)
        assert y.shape == (m, n)
        assert rel_err(y, reference(x, q, bias)) < 1e-5


def rounded_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """x with each group of each row rounded to int8 codes times absmax / 127 (to nearest
    even), in float64."""
    xg = x.double().unflatten(1, (-1, group))  # K a multiple of the group here
    step = xg.abs().amax(dim=2, keepdim=True) / 127
    codes = torch.where(step > 0, torch.round(xg / step.clamp_min(1e-300)), 0.0)
    return (codes * step).flatten(1)


@pytest.mark.parametrize(
    ("m", "n", "k", "group"), [(1, 7, 96, 32), (3, 33, 576, 64), (4, 40, 960, 96), (8, 17, 64, 32)]
)
def test_cpu_int8_activation_gemv_matches_its_reference(
    lib: ctypes.CDLL, m: int, n: int, k: int, group: int
) -> None:
    """A draft model's int4 GEMV with int8 activations (VNNI), on every build: it is chosen
    at run time, whatever instruction set the rest was built for."""
    if not quant_ops.a8_supported(lib):
        pytest.skip("this CPU has no AVX-512 VNNI")
    torch.manual_seed(m + n + k)
    x = torch.randn(2 * m, k + 3)[::2, :k]
    x[0, :group] = 0.0  # an all-zero group: step 0, codes 0
    w = quantize_groups(torch.randn(n, k), group)
    bias = torch.randn(n)
    a8 = dataclasses.replace(w, a8=pack_a8(w))
    y = quant_ops.linear(lib, x, a8, bias)
    # The dequantized weights times the rounded activations, to fp32 rounding.
    assert rel_err(y, reference(rounded_activations(x, group), w, bias)) < 1e-6
    # Not the weight-only product: rounding the activations moves it, a little.
    assert 1e-4 < rel_err(y, reference(x, w, bias)) < 1e-2


def test_cpu_linear_keeps_leading_dimensions_and_rejects_bad_groups() -> None:
    lib = cpu_kernels.load()
    assert lib is not None
    x = torch.randn(2, 3, 64)
    q = quantize_groups(torch.randn(5, 64), 32)
    y = quant_ops.linear(lib, x, q, None)
    assert y.shape == (2, 3, 5)
    assert rel_err(y, reference(x, q, None)) < 1e-5
    bad = dataclasses.replace(q, group_size=48)
    with pytest.raises(ValueError, match="multiple of 32"):
        quant_ops.linear(lib, x, bad, None)


@pytest.mark.parametrize(
    ("m", "n", "k", "group"), [(1, 7, 100, 64), (5, 70, 200, 96), (17, 33, 64, 32)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_w8a16_w4a16_match_float64(
    m: int, n: int, k: int, group: int, dtype: torch.dtype
) -> None:
    torch.manual_seed(m + n + k)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    w = torch.randn(n, k, device=DEVICE)
    bias = torch.randn(n, device=DEVICE)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    for q in (quantize_int8(w), quantize_groups(w, group), quantize_groups(w, group, bits=8)):
        y = quantized_linear(x, q, bias)
        assert y.dtype == dtype
        assert y.shape == (m, n)
        assert rel_err(y.cpu(), reference(x.float(), q, bias).cpu()) < tolerance


def test_cpu_int8_kv_store_writes_the_reference_bytes(lib: ctypes.CDLL) -> None:
    torch.manual_seed(2)
    tokens, heads, dim, blocks, bs = 7, 3, 64, 4, 4
    qkv = torch.randn(tokens, (2 + 2 * heads) * dim)  # K and V as row views of a QKV output
    k = qkv[:, 2 * dim : (2 + heads) * dim].view(tokens, heads, dim)
    v = qkv[:, (2 + heads) * dim :].view(tokens, heads, dim)
    slots = torch.tensor([5, 0, -1, 15, 6, 9, 2])  # -1: a padded token, skipped
    caches = [torch.full((blocks, bs, heads, dim), 7, dtype=torch.int8) for _ in range(2)]
    scales = [torch.full((blocks, bs, heads), -1.0) for _ in range(2)]
    quant_ops.store_kv_int8(lib, k, v, *caches, *scales, slots)
    keep = slots >= 0
    for src, cache, scale in ((k, caches[0], scales[0]), (v, caches[1], scales[1])):
        q, s = quantize_kv_rows(src[keep])
        assert torch.equal(cache.view(-1, heads, dim)[slots[keep]], q)
        assert torch.equal(scale.view(-1, heads)[slots[keep]], s)
        untouched = torch.ones(blocks * bs, dtype=torch.bool)
        untouched[slots[keep]] = False
        assert (cache.view(-1, heads, dim)[untouched] == 7).all()


@pytest.mark.parametrize(("heads", "head_dim"), [((6, 2), 64), ((4, 4), 32), ((9, 3), 64)])
def test_cpu_int8_decode_attention_matches_float64(
    lib: ctypes.CDLL, heads: tuple[int, int], head_dim: int
) -> None:
    torch.manual_seed(heads[0])
    hq, hkv = heads
    bs, num_blocks = 4, 12
    lens = [1, 4, 5, 13]  # one token, one block, past a boundary, several blocks
    key = torch.randint(-127, 128, (num_blocks, bs, hkv, head_dim), dtype=torch.int8)
    value = torch.randint(-127, 128, (num_blocks, bs, hkv, head_dim), dtype=torch.int8)
    key_scale = torch.rand(num_blocks, bs, hkv) * 0.02
    value_scale = torch.rand(num_blocks, bs, hkv) * 0.02
    perm = torch.randperm(num_blocks).tolist()  # shuffled block tables
    tables = torch.zeros(len(lens), 4, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        for j in range(-(-n // bs)):
            tables[i, j] = perm[used]
            used += 1
    q = torch.randn(len(lens), hq, head_dim)
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    quant_ops.paged_decode_attention_int8(
        lib,
        q,
        key,
        value,
        key_scale,
        value_scale,
        tables,
        torch.tensor(lens, dtype=torch.int32),
        scale,
        out,
    )
    keys = (key.double() * key_scale.double()[..., None]).view(-1, hkv, head_dim)
    values = (value.double() * value_scale.double()[..., None]).view(-1, hkv, head_dim)
    for i, n in enumerate(lens):
        slots = torch.tensor([int(tables[i, t // bs]) * bs + t % bs for t in range(n)])
        kk = keys[slots].repeat_interleave(hq // hkv, dim=1)  # [n, hq, d]
        vv = values[slots].repeat_interleave(hq // hkv, dim=1)
        probs = torch.softmax(torch.einsum("hd,thd->ht", q[i].double(), kk) * scale, dim=-1)
        expected = torch.einsum("ht,thd->hd", probs, vv)
        assert rel_err(out[i], expected) < 1e-5
