"""Paged attention and KV-store kernels against dense fp64 attention and the torch backend.

Caches are filled through shuffled block tables from dense per-sequence keys and values, and
the reference attends over those dense tensors, so a wrong block lookup cannot cancel out.
Bounds: fp32 inputs 1e-5 relative; bf16/fp16 inputs 1e-2 (probabilities enter the second dot
in 16 bits, outputs are rounded); int8 KV exact against its dequantized values and 2e-2
against the unquantized ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from ladle.runtime.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    KVCacheSpec,
    LayerKVCache,
)
from ladle.runtime.attention.cpu_backend import CpuAttentionBackend
from ladle.runtime.attention.registry import select_backend
from ladle.runtime.attention.torch_backend import TorchAttentionBackend
from ladle.runtime.attention.triton_backend import TritonAttentionBackend
from ladle.runtime.config import ConfigError
from ladle.runtime.kernels import cpu_kernels
from ladle.runtime.kernels.attention import paged_attention_ref, paged_decode_attention
from ladle.runtime.kernels.attention_prefill import paged_prefill_attention
from ladle.runtime.kernels.kv_store import store_kv, store_kv_ref
from ladle.runtime.quantization.formats import quantize_kv_rows

from .conftest import BUILDS, DEVICE

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in output"
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, Hq, D]
    keys: list[torch.Tensor]  # per sequence, dense [ctx, Hkv, D], as the cache holds them
    values: list[torch.Tensor]
    drawn_keys: list[torch.Tensor]  # before int8 quantization or fp16 rounding
    drawn_values: list[torch.Tensor]
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    key_scale: torch.Tensor | None
    value_scale: torch.Tensor | None
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    q_lens: list[int]


def paged_batch(
    seqs: list[tuple[int, int]],
    heads: tuple[int, int],
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    int8: bool = False,
    cache_dtype: torch.dtype | None = None,
) -> PagedBatch:
    """Sequences given as (new query tokens, context including them), blocks shuffled; the
    cache in ``dtype`` unless int8 or another ``cache_dtype`` (fp16 under fp32) is asked for."""
    num_heads, num_kv = heads
    per_seq = [-(-ctx // block_size) for _, ctx in seqs]
    num_blocks = sum(per_seq) + 2  # spare blocks stay garbage: reading one shows
    order = torch.randperm(num_blocks).tolist()
    tables = torch.zeros((len(seqs), max(*per_seq, 1)), dtype=torch.int32)
    cache_dtype = torch.int8 if int8 else cache_dtype or dtype
    shape = (num_blocks, block_size, num_kv, head_dim)
    key_cache = (torch.randn(shape) * 100).to(cache_dtype)
    value_cache = (torch.randn(shape) * 100).to(cache_dtype)
    key_scale = torch.rand(shape[:-1]) * 100 if int8 else None
    value_scale = torch.rand(shape[:-1]) * 100 if int8 else None
    keys, values, drawn_keys, drawn_values = [], [], [], []
    for i, (_, ctx) in enumerate(seqs):
        blocks = [order.pop() for _ in range(per_seq[i])]
        tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots = torch.tensor(
            [blocks[j // block_size] * block_size + j % block_size for j in range(ctx)]
        )
        k = torch.randn(ctx, num_kv, head_dim).to(dtype)
        v = torch.randn(ctx, num_kv, head_dim).to(dtype)
        drawn_keys.append(k)
        drawn_values.append(v)
        if int8:
            assert key_scale is not None
            assert value_scale is not None
            for src, cache, scales in ((k, key_cache, key_scale), (v, value_cache, value_scale)):
                quantized, scale = quantize_kv_rows(src)
                cache.view(-1, num_kv, head_dim)[slots] = quantized
                scales.view(-1, num_kv)[slots] = scale
            k_q, k_s = quantize_kv_rows(k)
            v_q, v_s = quantize_kv_rows(v)
            k, v = k_q.float() * k_s[..., None], v_q.float() * v_s[..., None]
        else:
            key_cache.view(-1, num_kv, head_dim)[slots] = k.to(cache_dtype)
            value_cache.view(-1, num_kv, head_dim)[slots] = v.to(cache_dtype)
            k, v = k.to(cache_dtype).to(dtype), v.to(cache_dtype).to(dtype)
        keys.append(k)
        values.append(v)
    q_lens = [n for n, _ in seqs]
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(starts[-1]), num_heads, head_dim).to(dtype)
    dev = DEVICE

    def on(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(dev)

    return PagedBatch(
        q=q.to(dev),
        keys=keys,
        values=values,
        drawn_keys=drawn_keys,
        drawn_values=drawn_values,
        key_cache=key_cache.to(dev),
        value_cache=value_cache.to(dev),
        key_scale=on(key_scale),
        value_scale=on(value_scale),
        block_tables=tables.to(dev),
        query_start_loc=starts.to(dev),
        seq_lens=torch.tensor([c for _, c in seqs], dtype=torch.int32, device=dev),
        q_lens=q_lens,
    )


def dense_reference(batch: PagedBatch, scale: float, drawn: bool = False) -> torch.Tensor:
    """fp64 causal attention over the dense keys/values (by default those the cache holds);
    queries sit at the end of their context."""
    q = batch.q.double().cpu()
    out = torch.zeros_like(q)
    keys, values = (batch.drawn_keys, batch.drawn_values) if drawn else (batch.keys, batch.values)
    group = q.shape[1] // keys[0].shape[1]
    start = 0
    for n, k, v in zip(batch.q_lens, keys, values, strict=True):
        ctx = k.shape[0]
        kk = k.double().repeat_interleave(group, dim=1)
        vv = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,nhd->htn", q[start : start + n], kk) * scale
        visible = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start : start + n] = torch.einsum("htn,nhd->thd", scores.softmax(-1), vv)
        start += n
    return out


def run_kernels(batch: PagedBatch, scale: float, num_splits: int) -> torch.Tensor:
    """Decodes (the leading one-token sequences) through the decode kernel, the rest through
    one prefill launch, as the backend does."""
    out = torch.full_like(batch.q, float("nan"))
    nd = next((i for i, n in enumerate(batch.q_lens) if n != 1), len(batch.q_lens))
    common: dict[str, Any] = {"key_scale": batch.key_scale, "value_scale": batch.value_scale}
    paged_decode_attention(
        batch.q[:nd],
        batch.key_cache,
        batch.value_cache,
        batch.block_tables[:nd],
        batch.seq_lens[:nd],
        scale,
        out[:nd],
        num_splits=num_splits,
        block_n=16,
        **common,
    )
    paged_prefill_attention(
        batch.q,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.query_start_loc,
        batch.seq_lens,
        scale,
        out,
        first_seq=nd,
        num_seqs=len(batch.q_lens) - nd,
        max_query_len=max(batch.q_lens),
        block_m=16,
        block_n=16,
        **common,
    )
    return out


# (query heads, KV heads), head dim, block size, dtype, [(new tokens, context)], splits.
CASES = [
    # GQA 1: exactly one block, one past a boundary, a single-token context; a short prefill.
    ((2, 2), 64, 16, torch.float32, [(1, 16), (1, 17), (1, 1), (15, 15)], 1),
    # GQA 3 (padded to 4 rows per token): decode ending on a block boundary, split 3 ways;
    # a chunked prefill whose first 16 tokens come from the cache across block boundaries.
    ((6, 2), 64, 8, torch.float32, [(1, 24), (5, 21), (8, 8)], 3),
    # GQA 8, head dim 128, bf16: one decode with trailing empty splits, one exact block.
    ((8, 1), 128, 16, torch.bfloat16, [(1, 33), (16, 16)], 4),
    ((4, 2), 128, 16, torch.float16, [(1, 40), (1, 9), (12, 30)], 2),
]


@pytest.mark.parametrize(("heads", "head_dim", "block_size", "dtype", "seqs", "splits"), CASES)
def test_paged_attention_matches_dense_reference(
    heads: tuple[int, int],
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seqs: list[tuple[int, int]],
    splits: int,
) -> None:
    torch.manual_seed(head_dim * 31 + splits)
    batch = paged_batch(seqs, heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    ref = dense_reference(batch, scale)
    out = run_kernels(batch, scale, splits)
    assert rel_err(out.cpu(), ref) < TOLERANCE[dtype]
    # The torch reference beside the kernels agrees too (bench/gpu_check.py relies on it).
    cached_ref = paged_attention_ref(
        batch.q,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.query_start_loc,
        batch.seq_lens,
        scale,
    )
    assert rel_err(cached_ref.cpu(), ref) < 1e-5


def test_int8_kv_cache() -> None:
    torch.manual_seed(8)
    seqs = [(1, 40), (1, 3), (7, 30)]
    batch = paged_batch(seqs, (4, 2), 64, 16, torch.float32, int8=True)
    scale = 64**-0.5
    out = run_kernels(batch, scale, num_splits=2)
    # Exact against the dequantized cache ...
    assert rel_err(out.cpu(), dense_reference(batch, scale)) < 1e-5
    # ... and within the quantization error of the values drawn before quantizing.
    err = rel_err(out.cpu(), dense_reference(batch, scale, drawn=True))
    assert 1e-4 < err < 2e-2


def test_padded_decode_rows_are_zero_and_finite() -> None:
    """A CUDA-graph batch pads with zero-length rows; with splits their partials are empty."""
    torch.manual_seed(3)
    batch = paged_batch([(1, 20), (1, 20)], (4, 2), 64, 8, torch.float32)
    batch.seq_lens[1] = 0
    out = torch.full_like(batch.q, float("nan"))
    paged_decode_attention(
        batch.q,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.seq_lens,
        0.125,
        out,
        num_splits=3,
        block_n=8,
    )
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    batch.seq_lens[1] = 20
    batch.q_lens, batch.keys, batch.values = [1], batch.keys[:1], batch.values[:1]
    batch.q = batch.q[:1]
    assert rel_err(out[:1].cpu(), dense_reference(batch, 0.125)) < 1e-5


# -- KV store -------------------------------------------------------------------------------


@pytest.mark.parametrize("int8", [False, True])
def test_store_kv_writes_mapped_slots_and_skips_padding(int8: bool) -> None:
    torch.manual_seed(5)
    tokens, num_kv, head_dim = 6, 3, 64
    # k and v as strided views into one fused projection output, like the model passes them.
    qkv = torch.randn(tokens, (4 + 2 * num_kv) * head_dim, device=DEVICE)
    k = qkv[:, 4 * head_dim : (4 + num_kv) * head_dim].view(tokens, num_kv, head_dim)
    v = qkv[:, (4 + num_kv) * head_dim :].view(tokens, num_kv, head_dim)
    k[2] *= 50  # an outlier token must not cost the others their precision
    k[4] = 0  # an all-zero row quantizes to zeros
    slots = torch.tensor([9, -1, 0, 31, 12, 16, -1], device=DEVICE)[:tokens]
    shape = (4, 8, num_kv, head_dim)
    cache_dtype = torch.int8 if int8 else torch.float32
    poison = 77
    caches = [torch.full(shape, poison, dtype=cache_dtype, device=DEVICE) for _ in range(4)]
    scales = [torch.full(shape[:-1], -1.0, device=DEVICE) for _ in range(4)] if int8 else None
    args = (scales[0], scales[1]) if scales else (None, None)
    ref_args = (scales[2], scales[3]) if scales else (None, None)
    store_kv(k, v, caches[0], caches[1], slots, *args)
    store_kv_ref(k, v, caches[2], caches[3], slots, *ref_args)
    assert torch.equal(caches[0], caches[2])
    assert torch.equal(caches[1], caches[3])
    written = caches[0].view(-1, num_kv, head_dim)
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots[slots >= 0].cpu()] = False
    assert (written[untouched.to(DEVICE)] == poison).all()
    if scales:
        assert torch.equal(scales[0], scales[2])
        assert torch.equal(scales[1], scales[3])
        flat_scale = scales[0].view(-1, num_kv)
        rows = slots >= 0
        deq = written[slots[rows]].float() * flat_scale[slots[rows]][..., None]
        # Symmetric rounding: every element within half a step of its original.
        step = flat_scale[slots[rows]][..., None]
        assert ((deq - k[rows]).abs() <= step / 2 + 1e-6).all()
        assert (written[12] == 0).all()


# -- the backend: mixed batches across steps, against the torch backend ---------------------


def step_meta(
    seqs: list[tuple[int, int]], tables: list[list[int]], block_size: int, device: torch.device
) -> tuple[AttentionMetadata, int]:
    """Metadata for sequences given as (already cached tokens, new tokens), decodes first."""
    starts, lens, slots = [0], [], []
    for (cached, new), table in zip(seqs, tables, strict=True):
        starts.append(starts[-1] + new)
        lens.append(cached + new)
        slots += [
            table[p // block_size] * block_size + p % block_size
            for p in range(cached, cached + new)
        ]
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        num_decodes=sum(1 for _, new in seqs if new == 1),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device
        ),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        max_query_len=max(new for _, new in seqs),
        max_seq_len=max(lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=lens,
    )
    return meta, starts[-1]


def run_steps(
    backend: AttentionBackend,
    caches: list[LayerKVCache],
    steps: list[tuple[list[tuple[int, int]], list[list[int]]]],
    heads: tuple[int, int],
    head_dim: int,
) -> list[torch.Tensor]:
    outs = []
    torch.manual_seed(11)
    for seqs, tables in steps:
        meta, n = step_meta(seqs, tables, backend.spec.block_size, backend.device)
        q = torch.randn(n, heads[0], head_dim, device=backend.device)
        kv = torch.randn(n, 2, heads[1], head_dim, device=backend.device)
        backend.begin_step(meta)
        outs.append(backend.forward(q, kv[:, 0], kv[:, 1], caches[0], meta, head_dim**-0.5))
    return outs


# Sequences A, B, C, D. Step 1: C is a one-token prompt (so it runs as a decode), A a fresh
# prefill, B the first chunk of its prompt. Step 2: A and C decode, B continues its chunk
# (earlier tokens from the cache), D starts. Step 3: all decode, B and D into new blocks.
STEPS = [
    ([(0, 1), (0, 9), (0, 6)], [[2], [3, 7, 1], [5, 0]]),
    ([(9, 1), (1, 1), (6, 10), (0, 4)], [[3, 7, 1], [2], [5, 0, 6, 4], [9]]),
    ([(10, 1), (2, 1), (16, 1), (4, 1)], [[3, 7, 1], [2], [5, 0, 6, 4, 8], [9, 10]]),
]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.int8])
def test_triton_backend_matches_torch_backend_over_mixed_steps(cache_dtype: torch.dtype) -> None:
    heads, head_dim, block_size = (6, 2), 64, 4
    spec = KVCacheSpec(1, heads[1], head_dim, block_size, cache_dtype)
    torch_backend = TorchAttentionBackend(spec, DEVICE)
    triton_backend = TritonAttentionBackend(spec, DEVICE)
    # Force the split-K path on CPU too: several programs per sequence, short splits.
    triton_backend.target_programs, triton_backend.min_split_tokens = 64, 4
    assert triton_backend.num_splits(4, 17) == 5
    expected = run_steps(torch_backend, torch_backend.allocate(12), STEPS, heads, head_dim)
    caches = triton_backend.allocate(12)
    assert caches[0].key.dtype == cache_dtype
    got = run_steps(triton_backend, caches, STEPS, heads, head_dim)
    for out, ref in zip(got, expected, strict=True):
        # int8 and fp16 too: both read the same rounded cache, the torch path widened to fp32.
        assert rel_err(out.cpu(), ref.cpu()) < 1e-5


def test_int8_copy_blocks_copies_scales() -> None:
    spec = KVCacheSpec(2, 2, 16, 4, torch.int8)
    backend = TritonAttentionBackend(spec, DEVICE)
    caches = backend.allocate(3)
    assert spec.bytes_per_block == 2 * 2 * 4 * 2 * (16 + 4)
    for layer in caches:
        assert layer.key_scale is not None
        assert layer.value_scale is not None
        layer.key.random_(-127, 127)
        layer.key_scale.uniform_()
        layer.value_scale.uniform_()
    backend.copy_blocks(caches, [(0, 2)])
    for layer in caches:
        assert layer.key_scale is not None
        assert layer.value_scale is not None
        assert torch.equal(layer.key[2], layer.key[0])
        assert torch.equal(layer.key_scale[2], layer.key_scale[0])
        assert torch.equal(layer.value_scale[2], layer.value_scale[0])


def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, fp32 = torch.device("cpu"), torch.float32
    assert select_backend("auto", cpu, fp32) is CpuAttentionBackend
    assert select_backend("auto", cpu, torch.int8, fp32) is CpuAttentionBackend
    assert select_backend("auto", cpu, torch.float16, fp32) is CpuAttentionBackend
    # The C kernels take fp32 activations and fp32, fp16 or int8 caches; the rest keeps torch.
    assert select_backend("auto", cpu, torch.bfloat16) is TorchAttentionBackend
    assert select_backend("auto", cpu, torch.int8, torch.bfloat16) is TorchAttentionBackend
    with pytest.raises(ConfigError, match="runs fp32 models on the CPU"):
        select_backend("cpu", cpu, torch.int8, torch.bfloat16)
    spec = KVCacheSpec(1, 2, 64, 16, torch.bfloat16)
    with pytest.raises(ConfigError, match="fp32, fp16 or int8 KV cache on the CPU"):
        CpuAttentionBackend(spec, cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_backend("triton", cpu, fp32) is TritonAttentionBackend
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET"):
        select_backend("triton", cpu, fp32)
    with pytest.raises(ConfigError, match="unknown"):
        select_backend("flash", cpu, fp32)


def test_without_a_compiler_cpu_falls_back_to_torch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setenv("LADLE_CACHE_DIR", str(tmp_path))
    cpu_kernels.load.cache_clear()
    try:
        assert select_backend("auto", torch.device("cpu"), torch.float32) is TorchAttentionBackend
        assert "could not build the CPU kernels" in caplog.text
        with pytest.raises(ConfigError, match="needs a C compiler"):
            CpuAttentionBackend(KVCacheSpec(1, 2, 64, 16, torch.float32), torch.device("cpu"))
    finally:
        cpu_kernels.load.cache_clear()


# (query heads, KV heads), head dim, block size, contexts: one token, a block boundary, one past
# it, long contexts over shuffled blocks.
CPU_CASES = [
    ((2, 2), 64, 16, [1, 16, 17, 200]),
    ((9, 3), 64, 16, [30, 196, 5]),
    ((8, 1), 128, 8, [33, 8, 1]),
    ((28, 4), 128, 32, [300, 64]),
    # Head dims off the AVX-512 walk's (multiples of 16 up to 128): 96 takes it, 80 does not.
    ((6, 2), 96, 4, [47, 3]),
    ((4, 2), 80, 16, [18, 5]),
]


@pytest.mark.parametrize("build", list(BUILDS))
def test_cpu_fp16_store_rounds_to_nearest_even(build: str) -> None:
    """On every instruction-set path (AVX-512, F16C, _Float16 in C), as torch rounds: ties,
    subnormals, overflow to infinity; rows of 72 floats, off the vector widths."""
    lib = cpu_kernels.load(BUILDS[build])
    assert lib is not None
    torch.manual_seed(3)
    tokens, heads, dim = 5, 2, 36
    qkv = torch.randn(tokens, 4 * heads * dim) * 10
    k = qkv[:, heads * dim : 2 * heads * dim].view(tokens, heads, dim)
    v = qkv[:, 2 * heads * dim : 3 * heads * dim].view(tokens, heads, dim)
    # A tie between two fp16 values (1 + 2^-11), a subnormal, and past fp16's largest.
    k[0, 0, :3] = torch.tensor([1 + 2**-11, 3e-6, 70000.0])
    key, value = (torch.zeros(3, 4, heads, dim, dtype=torch.float16) for _ in range(2))
    slots = torch.tensor([7, 0, 11, 2, 5])
    cpu_kernels.store_kv(lib, k, v, key, value, slots)
    assert torch.equal(key.view(-1, heads, dim)[slots], k.to(torch.float16))
    assert torch.equal(value.view(-1, heads, dim)[slots], v.to(torch.float16))
    assert key.view(-1, heads, dim)[7, 0, 2].isinf()


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("cache_dtype", list(cpu_kernels.KV_DTYPES))
@pytest.mark.parametrize("qkv_rows", [False, True], ids=["q", "q-in-qkv"])
@pytest.mark.parametrize(("heads", "head_dim", "block_size", "contexts"), CPU_CASES)
def test_cpu_decode_kernel_matches_dense_reference(
    heads: tuple[int, int],
    head_dim: int,
    block_size: int,
    contexts: list[int],
    qkv_rows: bool,
    cache_dtype: torch.dtype,
    build: str,
) -> None:
    """fp32 and fp16 caches: exact against the values the cache holds (fp16's widened)."""
    lib = cpu_kernels.load(BUILDS[build])
    assert lib is not None, "the C kernel must build on the test machines"
    torch.manual_seed(sum(contexts))
    batch = paged_batch(
        [(1, c) for c in contexts],
        heads,
        head_dim,
        block_size,
        torch.float32,
        cache_dtype=cache_dtype,
    )
    scale = head_dim**-0.5
    q = batch.q.cpu()
    if qkv_rows:
        # As the backend passes it: q is a view of the fused QKV output, whose rows also hold
        # K and V (garbage here), so consecutive tokens are a whole QKV row apart.
        num_q = heads[0] * head_dim
        qkv = torch.randn(len(contexts), num_q + 2 * heads[1] * head_dim)
        qkv[:, :num_q] = q.reshape(len(contexts), num_q)
        q = qkv[:, :num_q].view_as(q)
        assert not q.is_contiguous()
    out = torch.full_like(batch.q, float("nan"))
    cpu_kernels.paged_decode_attention(
        lib,
        q,
        batch.key_cache.cpu(),
        batch.value_cache.cpu(),
        batch.block_tables.cpu(),
        batch.seq_lens.cpu(),
        scale,
        out,
    )
    assert rel_err(out, dense_reference(batch, scale)) < 1e-5


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("cache_dtype", list(cpu_kernels.KV_DTYPES))
@pytest.mark.parametrize(
    ("heads", "head_dim", "block_size", "seqs"),
    [
        # GQA 3; a whole prompt, a chunk after 16 cached tokens, one token after a long context.
        ((9, 3), 64, 16, [(40, 40), (21, 37), (1, 70), (17, 17)]),
        ((4, 4), 32, 4, [(3, 3), (33, 50)]),
    ],
)
def test_cpu_prefill_kernel_matches_dense_reference(
    heads: tuple[int, int],
    head_dim: int,
    block_size: int,
    seqs: list[tuple[int, int]],
    cache_dtype: torch.dtype,
    build: str,
) -> None:
    """Every prefill chunk of a step in one call, causal over its whole paged context, q as
    rows of a wider QKV output (the ladle_paged_prefill_attention kernels)."""
    lib = cpu_kernels.load(BUILDS[build])
    assert lib is not None
    torch.manual_seed(len(seqs))
    batch = paged_batch(seqs, heads, head_dim, block_size, torch.float32, cache_dtype=cache_dtype)
    scale = head_dim**-0.5
    rows, width = batch.q.shape[0], heads[0] * head_dim
    qkv = torch.randn(rows, width + 2 * heads[1] * head_dim)
    qkv[:, :width] = batch.q.cpu().reshape(rows, width)
    out = torch.full_like(batch.q, float("nan"))
    cpu_kernels.paged_prefill_attention(
        lib,
        qkv[:, :width].view_as(batch.q),
        batch.key_cache.cpu(),
        batch.value_cache.cpu(),
        batch.block_tables.cpu(),
        batch.seq_lens.cpu(),
        batch.query_start_loc.cpu(),
        scale,
        out,
    )
    assert rel_err(out, dense_reference(batch, scale)) < 1e-5


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.int8])
def test_cpu_backend_matches_torch_backend_over_mixed_steps(cache_dtype: torch.dtype) -> None:
    heads, head_dim, block_size = (6, 2), 64, 4
    spec = KVCacheSpec(1, heads[1], head_dim, block_size, cache_dtype)
    cpu = torch.device("cpu")
    torch_backend = TorchAttentionBackend(spec, cpu)
    cpu_backend = CpuAttentionBackend(spec, cpu)
    torch_caches, cpu_caches = torch_backend.allocate(12), cpu_backend.allocate(12)
    expected = run_steps(torch_backend, torch_caches, STEPS, heads, head_dim)
    got = run_steps(cpu_backend, cpu_caches, STEPS, heads, head_dim)
    for out, ref in zip(got, expected, strict=True):
        assert rel_err(out, ref) < 1e-5
    # Both wrote the same cache: bytes (fp16 rounded to nearest even by both) and scales.
    assert cpu_caches[0].key.dtype == cache_dtype
    assert (cpu_caches[0].key_scale is not None) == (cache_dtype == torch.int8)
    for ours, theirs in zip(cpu_caches[0], torch_caches[0], strict=True):
        assert (ours is None and theirs is None) or torch.equal(ours, theirs)
    if cache_dtype != torch.float32:
        # And the smaller cache costs little against an fp32 one (fp16 about 30 times less
        # than int8).
        fp32 = TorchAttentionBackend(
            KVCacheSpec(1, heads[1], head_dim, block_size, torch.float32), cpu
        )
        exact = run_steps(fp32, fp32.allocate(12), STEPS, heads, head_dim)
        high = 2e-2 if cache_dtype == torch.int8 else 1e-3
        for out, ref in zip(got, exact, strict=True):
            assert high / 1000 < rel_err(out, ref) < high
