#!/usr/bin/env python3
"""One run on a lent GPU: kernel correctness, kernel timings, engine throughput.

On the GPU machine, from the repository root (its own torch, triton and transformers)::

    PYTHONPATH=src python3 bench/gpu_check.py --out "$OUT"

Here, without a GPU, a tiny version under the Triton interpreter proves the script runs::

    .venv/bin/python bench/gpu_check.py --smoke --out /tmp/gpu_check

Sections, in order of value, each skipped once the time budget is spent:

1. ceilings: device-to-device copy bandwidth and bf16 matmul rate, measured, not quoted;
2. correctness: every kernel against its torch reference on fresh random inputs, outputs
   poisoned with NaN first, at serving shapes (GQA 1/4/7, head dims 64/128, int8 KV, a mixed
   prefill+decode batch through the backend);
3. kernel timings (median of ``triton.testing.do_bench``): paged decode at batch 64 and 4k
   context against the measured copy bandwidth, the torch backend, dense SDPA and the naive
   reference; prefill against SDPA; the fused ops against torch;
3b. quantized GEMMs: W8A16 and W4A16 against their reference at serving shapes (rows 1, 16,
   256; Llama-8B's 4096 -> 14336 projection, groups of 128), then timed against bf16 cuBLAS at
   1 and 64 rows, as weight bytes read per second;
3c. batched LoRA: the Triton shrink/expand against the torch segments on Llama-8B's fused qkv
   (GQA slices) with four rank-16 adapters and base rows mixed, then its time beside the
   projection's own bf16 GEMM at 1, 64 and 512 rows;
4. engine: host syncs per decode step at batch 1 vs 64 (per-request syncs would grow),
   CUDA-graph vs eager greedy parity and single-stream decode latency;
5. offline throughput, each run in its own process: nano-vllm's benchmark workload (256
   requests, input and output lengths uniform in 100-1024) on a Qwen3-0.6B-shaped model with
   random weights (graphs, eager, torch attention) and on the default model's shape, in bf16
   and with int8 / int4 weights and an int8 KV cache; and a fixed-output-length workload
   against transformers' continuous batching;
6. tensor parallelism 2, 4 and 8 against 1, as far as the machine's GPUs go (the smoke run: 2
   CPU processes): greedy outputs the same, and throughput on a fixed batch.

Results go to ``results.json`` and ``table.txt`` under ``--out``; the table is printed last,
and the exit status is 1 if any check failed.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

# -- model shapes (random weights: the GPU machine has no hub access) -------------------------

SMOLLM2_135M: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
QWEN3_06B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
TINY_LLAMA: dict[str, Any] = {
    **SMOLLM2_135M,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 512,
}

# Published offline numbers for the same workload (nano-vllm README: RTX 4070 Laptop, 8 GB,
# Qwen3-0.6B, 256 requests, input/output 100-1024). Another GPU: context, not a target.
PUBLIC = "nano-vllm README, Qwen3-0.6B on an RTX 4070 Laptop: vLLM 1362 tok/s, nano-vllm 1434"


@dataclass
class Row:
    section: str
    name: str
    value: float | None
    unit: str
    ok: bool | None = None
    note: str = ""


@dataclass
class Report:
    out: Path
    budget_s: float
    started: float = field(default_factory=time.monotonic)
    rows: list[Row] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def add(self, row: Row) -> None:
        self.rows.append(row)
        flag = "" if row.ok is None else (" ok" if row.ok else " FAIL")
        value = "-" if row.value is None else f"{row.value:.4g}"
        elapsed = time.monotonic() - self.started
        print(f"{elapsed:6.1f}s [{row.section}] {row.name}: {value} {row.unit}{flag} {row.note}")
        sys.stdout.flush()
        self.save()

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        data = {"meta": self.meta, "rows": [asdict(r) for r in self.rows]}
        (self.out / "results.json").write_text(json.dumps(data, indent=1))

    def table(self) -> str:
        lines = [f"{'section':<11} {'check':<46} {'value':>10} {'unit':<8} status"]
        for r in self.rows:
            value = "-" if r.value is None else f"{r.value:.4g}"
            status = "" if r.ok is None else ("ok" if r.ok else "FAIL")
            lines.append(f"{r.section:<11} {r.name[:46]:<46} {value:>10} {r.unit:<8} {status}")
        failed = sum(1 for r in self.rows if r.ok is False)
        lines.append(f"{len(self.rows)} rows, {failed} failed, {self.meta.get('device', '')}")
        return "\n".join(lines)


def section(report: Report, name: str, need_s: float, fn: Callable[[], None]) -> None:
    """Run one section unless the budget is spent; a crash is a failed row, not the end."""
    if report.left() < need_s:
        report.add(Row(name, "skipped: time budget", None, "", None))
        return
    try:
        fn()
    except Exception as exc:
        traceback.print_exc()
        report.add(Row(name, f"crashed: {type(exc).__name__}", None, "", False, str(exc)[:200]))
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def bench_ms(fn: Callable[[], object], quick: bool = False) -> float:
    """Median milliseconds: device events via do_bench on CUDA, the host clock on CPU."""
    if torch.cuda.is_available():
        import triton.testing

        warmup, rep = (5, 20) if quick else (25, 100)
        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    start = time.perf_counter()  # the CPU interpreter: one run proves the code path
    fn()
    return (time.perf_counter() - start) * 1e3


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.isnan().any():
        return float("nan")
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


# -- 1. ceilings ------------------------------------------------------------------------------


def ceilings(report: Report, dev: torch.device, smoke: bool) -> None:
    n = (1 << 20) if smoke else (1 << 30)  # 2 GiB of bf16 on the GPU
    src = torch.randn(n, device=dev).to(torch.bfloat16)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    bw = 2 * src.numel() * 2 / (ms * 1e-3) / 1e9
    report.meta["copy_gbps"] = bw
    report.add(Row("ceiling", "device copy bandwidth (read+write)", bw, "GB/s"))
    size = 256 if smoke else 8192
    a = torch.randn(size, size, device=dev).to(torch.bfloat16)
    b = torch.randn(size, size, device=dev).to(torch.bfloat16)
    ms = bench_ms(lambda: a @ b)
    report.add(Row("ceiling", f"bf16 matmul {size}^3", 2 * size**3 / (ms * 1e-3) / 1e12, "TFLOP/s"))


# -- paged inputs -----------------------------------------------------------------------------


@dataclass
class Paged:
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    key_scale: torch.Tensor | None
    value_scale: torch.Tensor | None
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


def paged(
    ctxs: list[int],
    num_kv: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    int8: bool,
    dev: torch.device,
) -> Paged:
    """Random cache contents and shuffled block tables (the kernels and references read the
    same cache, so any contents are a valid test)."""
    per_seq = [-(-c // block_size) for c in ctxs]
    num_blocks = sum(per_seq) + 1
    order = torch.randperm(num_blocks, device=dev).to(torch.int32)
    tables = torch.zeros((len(ctxs), max(per_seq)), dtype=torch.int32, device=dev)
    used = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = order[used : used + n]
        used += n
    shape = (num_blocks, block_size, num_kv, head_dim)
    ks: torch.Tensor | None = None
    vs: torch.Tensor | None = None
    if int8:
        kc = torch.randint(-127, 128, shape, dtype=torch.int8, device=dev)
        vc = torch.randint(-127, 128, shape, dtype=torch.int8, device=dev)
        ks = torch.rand(shape[:-1], device=dev) / 127
        vs = torch.rand(shape[:-1], device=dev) / 127
    else:
        kc = torch.randn(shape, device=dev).to(dtype)
        vc = torch.randn(shape, device=dev).to(dtype)
    lens = torch.tensor(ctxs, dtype=torch.int32, device=dev)
    return Paged(kc, vc, ks, vs, tables, lens)


def tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


# -- 2. correctness ---------------------------------------------------------------------------


def correctness(report: Report, dev: torch.device, smoke: bool) -> None:
    from ladle.runtime.kernels import attention, attention_prefill, fused, kv_store

    bf16 = torch.bfloat16
    scale_of = {64: 64**-0.5, 128: 128**-0.5}
    # (name, ctxs, (Hq, Hkv), D, block size, dtype, int8, splits)
    decode_cases: list[tuple[str, list[int], tuple[int, int], int, int, torch.dtype, bool, int]]
    prefill_cases: list[tuple[str, list[int], list[int], tuple[int, int], int, torch.dtype, bool]]
    if smoke:
        decode_cases = [("decode gqa4 d64 bf16", [1, 17, 40], (8, 2), 64, 16, bf16, False, 2)]
        prefill_cases = [("prefill gqa4 d64 prefix", [5, 16], [21, 16], (8, 2), 64, bf16, False)]
    else:
        decode_cases = [
            ("decode b64 4k gqa4 d128 bf16", [4096] * 64, (32, 8), 128, 16, bf16, False, 1),
            (
                "decode mixed len gqa7 d128 split8",
                [1, 16, 17, 4097],
                (28, 4),
                128,
                16,
                bf16,
                False,
                8,
            ),
            (
                "decode gqa1 d64 fp16 bs32",
                [300, 33, 1000],
                (16, 16),
                64,
                32,
                torch.float16,
                False,
                4,
            ),
            ("decode gqa4 d128 int8 split4", [4096, 5, 1500], (32, 8), 128, 16, bf16, True, 4),
        ]
        prefill_cases = [
            (
                "prefill varlen+prefix gqa4 d128",
                [1024, 300, 17, 512],
                [1024, 812, 17, 2048],
                (32, 8),
                128,
                bf16,
                False,
            ),
            ("prefill gqa7 d128 chunk", [2048, 7], [3000, 4000], (28, 4), 128, bf16, False),
            ("prefill gqa4 d128 int8", [512, 100], [900, 100], (32, 8), 128, bf16, True),
        ]
    for name, ctxs, (hq, hkv), d, bs, dtype, int8, splits in decode_cases:
        torch.manual_seed(len(report.rows))
        p = paged(ctxs, hkv, d, bs, dtype, int8, dev)
        q = torch.randn(len(ctxs), hq, d, device=dev).to(dtype)
        out = torch.full_like(q, float("nan"))
        attention.paged_decode_attention(
            q,
            p.key_cache,
            p.value_cache,
            p.block_tables,
            p.seq_lens,
            scale_of[d],
            out,
            num_splits=splits,
            key_scale=p.key_scale,
            value_scale=p.value_scale,
        )
        starts = torch.arange(len(ctxs) + 1, dtype=torch.int32, device=dev)
        ref = attention.paged_attention_ref(
            q,
            p.key_cache,
            p.value_cache,
            p.block_tables,
            starts,
            p.seq_lens,
            scale_of[d],
            p.key_scale,
            p.value_scale,
        )
        err = rel_err(out, ref)
        report.add(Row("correct", name, err, "rel err", err < tolerance(dtype)))
    for name, q_lens, ctxs, (hq, hkv), d, dtype, int8 in prefill_cases:
        torch.manual_seed(len(report.rows))
        p = paged(ctxs, hkv, d, 16, dtype, int8, dev)
        starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        starts = starts.to(dev)
        q = torch.randn(sum(q_lens), hq, d, device=dev).to(dtype)
        out = torch.full_like(q, float("nan"))
        attention_prefill.paged_prefill_attention(
            q,
            p.key_cache,
            p.value_cache,
            p.block_tables,
            starts,
            p.seq_lens,
            scale_of[d],
            out,
            first_seq=0,
            num_seqs=len(q_lens),
            max_query_len=max(q_lens),
            key_scale=p.key_scale,
            value_scale=p.value_scale,
        )
        ref = attention.paged_attention_ref(
            q,
            p.key_cache,
            p.value_cache,
            p.block_tables,
            starts,
            p.seq_lens,
            scale_of[d],
            p.key_scale,
            p.value_scale,
        )
        err = rel_err(out, ref)
        report.add(Row("correct", name, err, "rel err", err < tolerance(dtype)))

    # Mixed prefill + decode through the backend (store, decode and prefill launches).
    mixed_backend(report, dev, smoke)

    # KV store, bf16 and int8, with padded (-1) slots.
    tokens = 64 if smoke else 4096
    for int8 in (False, True):
        torch.manual_seed(len(report.rows))
        hkv, d = (2, 64) if smoke else (8, 128)
        k = torch.randn(tokens, hkv, d, device=dev).to(bf16)
        v = torch.randn(tokens, hkv, d, device=dev).to(bf16)
        slots = torch.randperm(2 * tokens, device=dev)[:tokens]
        slots[::7] = -1
        shape = (2 * tokens // 16, 16, hkv, d)
        cache_dtype = torch.int8 if int8 else bf16
        caches = [torch.full(shape, 3, dtype=cache_dtype, device=dev) for _ in range(4)]
        scales = [torch.zeros(shape[:-1], device=dev) for _ in range(4)] if int8 else None
        kv_store.store_kv(k, v, caches[0], caches[1], slots, *(scales[:2] if scales else ()))
        kv_store.store_kv_ref(k, v, caches[2], caches[3], slots, *(scales[2:] if scales else ()))
        mismatch = float(
            ((caches[0] != caches[2]).float().mean() + (caches[1] != caches[3]).float().mean()) / 2
        )
        # int8: the GPU's fp32 division may round a value sitting on .5 the other way.
        close = int8 and bool(((caches[0].int() - caches[2].int()).abs() <= 1).all())
        ok = mismatch == 0 or (close and mismatch < 1e-3)
        name = f"kv store {'int8' if int8 else 'bf16'} with -1 slots"
        report.add(Row("correct", name, mismatch, "frac diff", ok))

    # Fused ops.
    rows, hidden = (8, 96) if smoke else (4096, 4096)
    x = torch.randn(rows, hidden, device=dev).to(bf16)
    res = torch.randn(rows, hidden, device=dev).to(bf16)
    w = (torch.rand(hidden, device=dev) + 0.5).to(bf16)
    out, new_res = fused.rms_norm(x, w, 1e-6, res)
    ref, ref_res = fused.rms_norm_ref(x, w, 1e-6, res)
    assert new_res is not None
    assert ref_res is not None
    err = max(rel_err(out, ref), rel_err(new_res, ref_res))
    report.add(Row("correct", "rms_norm + residual bf16", err, "rel err", err < 1e-2))
    hq, hkv, d = (4, 2, 64) if smoke else (32, 8, 128)
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, device=dev).to(bf16)
    q = qkv[:, : hq * d].view(rows, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(rows, hkv, d)
    angles = torch.rand(rows, d // 2, device=dev) * 100
    cos, sin = angles.cos().to(bf16), angles.sin().to(bf16)
    ref_q, ref_k = fused.rotary_embedding_ref(q, cos, sin), fused.rotary_embedding_ref(k, cos, sin)
    fused.rotary_embedding(q, k, cos, sin)
    err = max(rel_err(q, ref_q), rel_err(k, ref_k))
    report.add(Row("correct", "rotary in place on qkv bf16", err, "rel err", err < 1e-2))
    inter = 40 if smoke else 14336
    gu = torch.randn(rows, 2 * inter, device=dev).to(bf16)
    err = rel_err(fused.silu_and_mul(gu), fused.silu_and_mul_ref(gu))
    report.add(Row("correct", "silu_and_mul bf16", err, "rel err", err < 1e-2))


def mixed_backend(report: Report, dev: torch.device, smoke: bool) -> None:
    from ladle.runtime.attention.backend import AttentionMetadata, KVCacheSpec
    from ladle.runtime.attention.triton_backend import TritonAttentionBackend
    from ladle.runtime.kernels.attention import paged_attention_ref
    from ladle.runtime.kernels.kv_store import store_kv

    hq, hkv, d, bs = (8, 2, 64, 16) if smoke else (32, 8, 128, 16)
    # (cached tokens, new tokens): 3 decodes, then a prefix-hit chunk and a fresh prefill.
    seqs = (
        [(40, 1), (15, 1), (0, 1), (32, 9), (0, 20)]
        if smoke
        else [
            (4000, 1),
            (15, 1),
            (0, 1),
            (1024, 700),
            (0, 1500),
        ]
    )
    for int8 in (False, True):
        torch.manual_seed(11)
        spec = KVCacheSpec(1, hkv, d, bs, torch.int8 if int8 else torch.bfloat16)
        backend = TritonAttentionBackend(spec, dev)
        lens = [c + n for c, n in seqs]
        tables_n = [-(-length // bs) for length in lens]
        num_blocks = sum(tables_n) + 1
        cache = backend.allocate(num_blocks)[0]
        order = torch.randperm(num_blocks).tolist()
        tables = [[order.pop() for _ in range(n)] for n in tables_n]
        width = max(tables_n)
        starts, slots = [0], []
        for (c, n), table in zip(seqs, tables, strict=True):
            starts.append(starts[-1] + n)
            slots += [table[j // bs] * bs + j % bs for j in range(c, c + n)]
        # Earlier context: whatever the cache holds (random), quantized like the store would.
        filler = torch.randn(num_blocks * bs, hkv, d, device=dev).to(torch.bfloat16)
        everything = torch.arange(num_blocks * bs, device=dev)
        store_kv(
            filler, filler, cache.key, cache.value, everything, cache.key_scale, cache.value_scale
        )
        meta = AttentionMetadata(
            num_decodes=3,
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(
                [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev
            ),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            max_query_len=max(n for _, n in seqs),
            max_seq_len=max(lens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=lens,
        )
        t = starts[-1]
        q = torch.randn(t, hq, d, device=dev).to(torch.bfloat16)
        k = torch.randn(t, hkv, d, device=dev).to(torch.bfloat16)
        v = torch.randn(t, hkv, d, device=dev).to(torch.bfloat16)
        backend.begin_step(meta)
        out = backend.forward(q, k, v, cache, meta, d**-0.5)
        ref = paged_attention_ref(
            q,
            cache.key,
            cache.value,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            d**-0.5,
            cache.key_scale,
            cache.value_scale,
        )
        err = rel_err(out, ref)
        name = f"backend mixed prefill+decode {'int8' if int8 else 'bf16'}"
        report.add(Row("correct", name, err, "rel err", err < 1e-2))


# -- 3. kernel timings ------------------------------------------------------------------------


def timings(report: Report, dev: torch.device, smoke: bool) -> None:
    shapes = [(4, 64, False)] if smoke else [(64, 4096, False), (64, 4096, True), (8, 4096, False)]
    for batch, ctx, int8 in shapes:
        time_decode(report, dev, smoke, batch, ctx, int8)
    time_prefill(report, dev, smoke)
    time_fused(report, dev, smoke)


def time_decode(
    report: Report, dev: torch.device, smoke: bool, batch: int, ctx: int, int8: bool
) -> None:
    """Decode kernel variants as KV bandwidth, against the copy ceiling and the baselines."""
    import torch.nn.functional as F

    from ladle.runtime.attention.backend import AttentionMetadata, KVCacheSpec
    from ladle.runtime.attention.torch_backend import TorchAttentionBackend
    from ladle.runtime.attention.triton_backend import TritonAttentionBackend
    from ladle.runtime.kernels import attention

    bf16 = torch.bfloat16
    copy_bw = report.meta.get("copy_gbps")
    hq, hkv, d, bs = (8, 2, 64, 16) if smoke else (32, 8, 128, 16)
    torch.manual_seed(0)
    p = paged([ctx] * batch, hkv, d, bs, bf16, int8, dev)
    q = torch.randn(batch, hq, d, device=dev).to(bf16)
    out = torch.empty_like(q)
    spec = KVCacheSpec(1, hkv, d, bs, torch.int8 if int8 else bf16)
    auto = TritonAttentionBackend(spec, dev).num_splits(batch, ctx)
    kv_bytes = 2 * batch * ctx * hkv * (d + 4 if int8 else 2 * d)
    tag = f"decode b{batch} ctx{ctx} {'int8' if int8 else 'bf16'}"

    def run(splits: int, block_n: int) -> None:
        ws = attention.decode_workspace(batch, hq, d, splits, dev) if splits > 1 else None
        attention.paged_decode_attention(
            q, p.key_cache, p.value_cache, p.block_tables, p.seq_lens, d**-0.5, out,
            num_splits=splits, workspace=ws, key_scale=p.key_scale, value_scale=p.value_scale,
            block_n=block_n,
        )  # fmt: skip

    best = 0.0
    variants = {(auto, 32)} if smoke else {(auto, 32), (1, 32), (auto, 64), (2 * auto, 32)}
    for splits, block_n in sorted(variants):
        ms = bench_ms(lambda s=splits, n=block_n: run(s, n))
        gbps = kv_bytes / (ms * 1e-3) / 1e9
        note = f"{ms * 1e3:.1f} us"
        if copy_bw:
            note += f", {100 * gbps / copy_bw:.0f}% of copy BW"
        mark = " (default)" if (splits, block_n) == (auto, 32) else ""
        name = f"{tag} splits={splits} block_n={block_n}{mark}"
        report.add(Row("decode", name, gbps, "GB/s", None, note))
        best = max(best, gbps)
    if copy_bw and not int8 and batch == 64:
        frac = best / copy_bw
        name = f"{tag} best / copy bandwidth (target 0.7)"
        report.add(Row("decode", name, frac, "x", None if smoke else frac >= 0.7))
    if int8:
        return
    # Baselines: the torch backend's decode (gather + SDPA), dense SDPA, the naive loop.
    starts = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    meta = AttentionMetadata(
        num_decodes=batch,
        query_start_loc=starts,
        seq_lens=p.seq_lens,
        block_tables=p.block_tables,
        slot_mapping=torch.full((batch,), -1, dtype=torch.long, device=dev),
        max_query_len=1,
        max_seq_len=ctx,
        query_start_loc_cpu=starts.tolist(),
        seq_lens_cpu=[ctx] * batch,
    )
    torch_backend = TorchAttentionBackend(spec, dev)
    dense = torch.randn(2, batch, hkv, ctx, d, device=dev).to(bf16)
    qd = q[:, :, None, :]
    baselines: list[tuple[str, Callable[[], object], bool]] = [
        (
            "torch backend (gather + SDPA)",
            lambda: torch_backend_decode(torch_backend, q, p, meta, d),
            False,
        ),
        (
            "dense SDPA, no paging",
            lambda: F.scaled_dot_product_attention(qd, dense[0], dense[1], enable_gqa=True),
            False,
        ),
        (
            "naive reference loop",
            lambda: attention.paged_attention_ref(
                q, p.key_cache, p.value_cache, p.block_tables, starts, p.seq_lens, d**-0.5
            ),
            True,
        ),
    ]
    for name, fn, quick in baselines:
        ms = bench_ms(fn, quick=quick)
        gbps = kv_bytes / (ms * 1e-3) / 1e9
        report.add(Row("decode", f"{tag} {name}", gbps, "GB/s", None, f"{ms * 1e3:.1f} us"))


def time_prefill(report: Report, dev: torch.device, smoke: bool) -> None:
    """Fresh causal prefill through the paged kernel (tile variants) against dense SDPA."""
    import torch.nn.functional as F

    from ladle.runtime.kernels import attention_prefill

    bf16 = torch.bfloat16
    batch, length = (2, 32) if smoke else (8, 1024)
    hq, hkv, d, bs = (8, 2, 64, 16) if smoke else (32, 8, 128, 16)
    p = paged([length] * batch, hkv, d, bs, bf16, False, dev)
    q = torch.randn(batch * length, hq, d, device=dev).to(bf16)
    out = torch.empty_like(q)
    starts = torch.arange(0, batch * length + 1, length, dtype=torch.int32, device=dev)
    flops = 2 * batch * hq * length * length * d  # two matmuls over the causal half

    def run(block_m: int, block_n: int) -> None:
        attention_prefill.paged_prefill_attention(
            q, p.key_cache, p.value_cache, p.block_tables, starts, p.seq_lens, d**-0.5, out,
            first_seq=0, num_seqs=batch, max_query_len=length, block_m=block_m, block_n=block_n,
        )  # fmt: skip

    for block_m, block_n in [(64, 32)] if smoke else [(64, 32), (64, 64), (128, 64)]:
        ms = bench_ms(lambda m=block_m, n=block_n: run(m, n))
        name = f"paged b{batch}x{length} tile {block_m}x{block_n}"
        report.add(
            Row("prefill", name, flops / (ms * 1e-3) / 1e12, "TFLOP/s", None, f"{ms:.3f} ms")
        )
    qs = torch.randn(batch, hq, length, d, device=dev).to(bf16)
    ks = torch.randn(batch, hkv, length, d, device=dev).to(bf16)
    ms = bench_ms(
        lambda: F.scaled_dot_product_attention(qs, ks, ks, is_causal=True, enable_gqa=True)
    )
    name = f"dense SDPA causal b{batch}x{length}"
    report.add(Row("prefill", name, flops / (ms * 1e-3) / 1e12, "TFLOP/s", None, f"{ms:.3f} ms"))


def time_fused(report: Report, dev: torch.device, smoke: bool) -> None:
    """KV store and the fused elementwise ops as bytes moved per second, against torch."""
    import torch.nn.functional as F

    from ladle.runtime.kernels import fused, kv_store
    from ladle.runtime.kernels.ops import TorchOps

    bf16 = torch.bfloat16
    rows, hidden, inter = (64, 96, 40) if smoke else (8192, 4096, 14336)
    hq, hkv, d = (8, 2, 64) if smoke else (32, 8, 128)
    k = torch.randn(rows, hkv, d, device=dev).to(bf16)
    cache = torch.zeros(rows // 16 + 1, 16, hkv, d, dtype=bf16, device=dev)
    slots = torch.randperm(rows, device=dev)
    ms = bench_ms(lambda: kv_store.store_kv(k, k, cache, cache, slots))
    report.add(Row("fused", "kv store bf16", 4 * k.numel() * 2 / (ms * 1e-3) / 1e9, "GB/s"))
    x = torch.randn(rows, hidden, device=dev).to(bf16)
    res = torch.randn(rows, hidden, device=dev).to(bf16)
    w = torch.rand(hidden, device=dev).to(bf16)
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, device=dev).to(bf16)
    qv = qkv[:, : hq * d].view(rows, hq, d)
    kv = qkv[:, hq * d : (hq + hkv) * d].view(rows, hkv, d)
    cos = torch.rand(rows, 1, d // 2, device=dev).to(bf16)
    gu = torch.randn(rows, 2 * inter, device=dev).to(bf16)
    ops = TorchOps()
    pairs: list[tuple[str, Callable[[], object], Callable[[], object], int]] = [
        (
            "add + rms_norm",
            lambda: fused.rms_norm(x, w, 1e-6, res),
            lambda: ops.add_rms_norm(x, res, w, 1e-6),
            4 * x.numel() * 2,
        ),
        (
            "rope q+k",
            lambda: fused.rotary_embedding(qv, kv, cos, cos),
            lambda: ops.rope(qv, kv, cos, cos),
            2 * (hq + hkv) * d * rows * 2,
        ),
        (
            "silu_and_mul",
            lambda: fused.silu_and_mul(gu),
            lambda: F.silu(gu[:, :inter]) * gu[:, inter:],
            3 * rows * inter * 2,
        ),
    ]
    for name, triton_fn, torch_fn, nbytes in pairs:
        t_ms, r_ms = bench_ms(triton_fn), bench_ms(torch_fn)
        gbps = nbytes / (t_ms * 1e-3) / 1e9
        report.add(
            Row("fused", f"{name} triton", gbps, "GB/s", None, f"torch takes {r_ms / t_ms:.2f}x")
        )


# -- 3c. batched LoRA -------------------------------------------------------------------------


def lora_kernels(report: Report, dev: torch.device, smoke: bool) -> None:
    """Every row its own adapter slot (or none): the BGMV kernels against the segments."""
    import torch.nn.functional as F

    from ladle.runtime.kernels.lora import add_lora_segments
    from ladle.runtime.kernels.lora_triton import add_lora_rows
    from ladle.runtime.lora.batch import LoRABatch
    from ladle.runtime.lora.slots import ProjectionLoRA

    bf16, slots, rank = torch.bfloat16, 4, 16
    k, sizes = (64, (64, 16, 16)) if smoke else (4096, (4096, 1024, 1024))
    ends = [sum(sizes[: i + 1]) for i in range(3)]
    n = ends[-1]
    proj = ProjectionLoRA(
        a=(torch.randn(slots, 3 * rank, k, device=dev) * 0.02).to(bf16),
        b=(torch.randn(slots, n, rank, device=dev) * 0.02).to(bf16),
        bounds=tuple((e - size, e) for size, e in zip(sizes, ends, strict=True)),
        rank=rank,
        targets=[frozenset({0, 1, 2})] * slots,
    )
    weight = (torch.randn(n, k, device=dev) * 0.02).to(bf16)
    for rows in (1, 7) if smoke else (1, 64, 512):
        per_seq = [(i % (slots + 1)) - 1 for i in range(1, rows + 1)]  # -1: a base-model row
        batch = LoRABatch.build(per_seq, [1] * rows, dev, triton=True)
        assert batch is not None
        x = torch.randn(rows, k, device=dev).to(bf16)
        # Zero outputs, so that the adapters' deltas are compared, not bf16's rounding of a sum.
        out = torch.zeros(rows, n, device=dev, dtype=bf16)
        ref = torch.zeros_like(out)
        add_lora_rows(x, out, proj, batch.row_slots)
        add_lora_segments(x, ref, proj, batch.segments)
        err = rel_err(out, ref)
        report.add(Row("lora", f"BGMV vs segments {rows}x{k}->{n}", err, "rel err", err < 2e-2))
        base_ms = bench_ms(lambda x=x: F.linear(x, weight), quick=True)
        ms = bench_ms(lambda x=x, o=out, b=batch: add_lora_rows(x, o, proj, b.row_slots), True)
        note = f"{ms:.3f} ms beside the GEMM's {base_ms:.3f} ms"
        report.add(Row("lora", f"LoRA share of qkv at {rows} rows", ms / base_ms, "x", None, note))


# -- 3b. quantized GEMMs -----------------------------------------------------------------------


def quantized_gemms(report: Report, dev: torch.device, smoke: bool) -> None:
    """W8A16 / W4A16 correctness at serving shapes, then their speed against bf16 cuBLAS."""
    import torch.nn.functional as F

    from ladle.runtime.kernels.quant_gemm import quantized_linear, quantized_linear_ref
    from ladle.runtime.quantization.formats import quantize_groups, quantize_int8

    bf16 = torch.bfloat16
    n, k, group = (70, 200, 32) if smoke else (14336, 4096, 128)
    w = torch.randn(n, k, device=dev) * 0.02
    bias = torch.randn(n, device=dev).to(bf16)
    weights = {
        "int8": quantize_int8(w),
        f"int8 g{group}": quantize_groups(w, group, bits=8),
        f"int4 g{group}": quantize_groups(w, group),
    }
    for rows in (1, 17) if smoke else (1, 16, 256):
        x = torch.randn(rows, k, device=dev).to(bf16)
        for name, q in weights.items():
            out = torch.full((rows, n), float("nan"), device=dev, dtype=bf16)
            out.copy_(quantized_linear(x, q, bias))
            err = rel_err(out, quantized_linear_ref(x, q, bias))
            report.add(Row("quant", f"{name} x bf16 {rows}x{k}x{n}", err, "rel err", err < 1e-2))
    dense = w.to(bf16)
    for rows in (1, 64):
        x = torch.randn(rows, k, device=dev).to(bf16)
        base_ms = bench_ms(lambda x=x: F.linear(x, dense))
        gbps = dense.nbytes / (base_ms * 1e-3) / 1e9
        note = f"{base_ms:.3f} ms"
        report.add(Row("quant", f"bf16 cuBLAS {rows}x{k}x{n}", gbps, "GB/s", None, note))
        for name, q in weights.items():
            ms = bench_ms(lambda x=x, q=q: quantized_linear(x, q))
            gbps = sum(t.nbytes for t in q.tensors()) / (ms * 1e-3) / 1e9
            note = f"{ms:.3f} ms, {base_ms / ms:.2f}x bf16"
            report.add(Row("quant", f"{name} {rows}x{k}x{n}", gbps, "GB/s", None, note))


def torch_backend_decode(backend: Any, q: torch.Tensor, p: Paged, meta: Any, d: int) -> None:
    """The torch backend's decode without its KV store (slots are all padding)."""
    from ladle.runtime.attention.backend import LayerKVCache

    backend.begin_step(meta)
    cache = LayerKVCache(p.key_cache, p.value_cache, p.key_scale, p.value_scale)
    backend._decode(q, cache, meta, d**-0.5, torch.empty_like(q))


# -- models and workers -----------------------------------------------------------------------


def build_model(config: dict[str, Any], folder: Path, dev: torch.device) -> Path:
    """Random-weight checkpoint plus a synthetic word-level tokenizer over the whole vocab."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    if (folder / "config.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    cfg = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    cfg.architectures = config["architectures"]
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2").save_pretrained(
        folder
    )
    del model
    return folder


def default_model(report: Report, models_dir: Path, dev: torch.device, smoke: bool) -> Path:
    """The real default model when this machine has it, else its shape with random weights."""
    if not smoke:
        try:
            from ladle.runtime.models.loader import resolve_model

            path = resolve_model(None)
            report.meta["default_model"] = f"real weights: {path}"
            return path
        except Exception as exc:
            report.meta["default_model"] = f"random weights (no real model: {exc})"[:200]
    return build_model(
        TINY_LLAMA if smoke else SMOLLM2_135M, models_dir / "smollm2-135m-shape", dev
    )


def workload(
    num: int, vocab: int, seed: int, fixed_out: int | None, smoke: bool
) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py: lengths uniform in 100-1024 (tiny in smoke mode)."""
    rng = random.Random(seed)
    lo, hi = (3, 12) if smoke else (100, 1024)
    prompts = [
        [rng.randint(0, min(vocab, 10000) - 1) for _ in range(rng.randint(lo, hi))]
        for _ in range(num)
    ]
    outs = [fixed_out or rng.randint(lo, hi) for _ in range(num)]
    return prompts, outs


def run_worker(report: Report, spec: dict[str, Any], timeout: float) -> dict[str, Any] | None:
    """One engine per process: each takes most of the GPU's memory, and a hang cannot stall
    the rest of the check."""
    timeout = min(timeout, report.left() - 10)
    if timeout < 20:
        report.add(Row(spec["section"], f"{spec['label']}: skipped, time budget", None, ""))
        return None
    cmd = [sys.executable, __file__, "--worker", json.dumps(spec)]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=os.environ.copy(), check=False
        )
    except subprocess.TimeoutExpired:
        report.add(
            Row(
                spec["section"], f"{spec['label']}: timed out", None, "", False, f">{timeout:.0f} s"
            )
        )
        return None
    log = report.out / "workers.log"
    with log.open("a") as f:
        f.write(f"==== {spec['label']} rc={proc.returncode}\n")
        f.write(f"{proc.stdout[-12000:]}\n{proc.stderr[-8000:]}\n")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        report.add(Row(spec["section"], f"{spec['label']}: failed", None, "", False, tail[0][:200]))
        return None
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return result


def worker(spec: dict[str, Any]) -> None:
    if spec.get("interpret"):
        os.environ["TRITON_INTERPRET"] = "1"
    kind = spec["kind"]
    result = {
        "ladle": ladle_throughput,
        "transformers": transformers_throughput,
        "syncs": count_syncs,
        "graphs": graph_parity,
        "bench_cli": bench_cli,
        "spec": spec_decode,
        "tp": tensor_parallel,
    }[kind](spec)
    print("RESULT " + json.dumps(result), flush=True)


def _llm(spec: dict[str, Any], **overrides: Any) -> Any:
    from ladle.runtime import LLM

    args = {
        "max_model_len": 4096,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 16384,
        **spec.get("engine", {}),
        **overrides,
    }
    return LLM(spec["model"], **args)


def ladle_throughput(spec: dict[str, Any]) -> dict[str, Any]:
    from ladle.runtime import SamplingParams

    started = time.monotonic()
    llm = _llm(spec)
    load_s = time.monotonic() - started
    prompts, outs = workload(
        spec["num"], spec["vocab"], 0, spec.get("fixed_out"), spec.get("smoke", False)
    )
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in outs]
    sync()
    start = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sync()
    elapsed = time.perf_counter() - start
    generated = sum(len(r.outputs[0].token_ids) for r in results)
    return {"tok_s": generated / elapsed, "seconds": elapsed, "tokens": generated, "load_s": load_s}


def spec_decode(spec: dict[str, Any]) -> dict[str, Any]:
    """One stream, greedy, without drafts, with n-gram drafts and with an int4 copy of the
    model drafting, on a prompt that repeats (a passage of token ids, twice, then its start: a
    model that copies has its drafts accepted)."""
    from ladle.runtime import SamplingParams

    rng = random.Random(0)
    smoke = spec.get("smoke", False)  # the Triton interpreter runs every kernel: keep it short
    passage = [rng.randrange(1, spec["vocab"]) for _ in range(16 if smoke else 64)]
    prompt = {"prompt_token_ids": passage * 2 + passage[:8]}
    params = SamplingParams(temperature=0.0, max_tokens=8 if smoke else 128, ignore_eos=True)
    configs: dict[str, dict[str, Any]] = {
        "plain": {},
        "ngram": {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 4,
                  "prompt_lookup_min": 2},
        "draft_model": {"method": "draft_model", "num_speculative_tokens": 4},
    }  # fmt: skip
    out: dict[str, Any] = {}
    tokens: dict[str, list[int]] = {}
    for name, config in configs.items():
        llm = _llm(spec, **({"speculative_config": config} if config else {}))
        llm.generate([prompt], params, use_tqdm=False)  # warm: graphs, kernels
        sync()
        start = time.perf_counter()
        result = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        sync()
        out[f"{name}_tok_s"] = len(result.token_ids) / (time.perf_counter() - start)
        tokens[name] = list(result.token_ids)
        if config:
            out[f"{name}_acceptance"] = llm.engine.stats().spec_decode.acceptance_rate or 0.0
            out[f"{name}_identical"] = tokens[name] == tokens["plain"]
        llm.engine.shutdown()
    return out


def tensor_parallel(spec: dict[str, Any]) -> dict[str, Any]:
    """One size's throughput on a fixed batch, and its first greedy outputs (to compare with
    one GPU's): a worker per size, since a process holds one tensor-parallel group."""
    from ladle.runtime import SamplingParams

    smoke = spec.get("smoke", False)
    prompts, outs = workload(spec["num"], spec["vocab"], 0, spec["fixed_out"], smoke)
    llm = _llm(spec, tensor_parallel_size=spec["size"])
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=6 if smoke else 16, ignore_eos=True)
        first = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], greedy, use_tqdm=False)
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=outs[0])
        sync()
        start = time.perf_counter()
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        sync()
        elapsed = time.perf_counter() - start
    finally:
        llm.engine.shutdown()
    generated = sum(len(r.outputs[0].token_ids) for r in results)
    return {
        "tok_s": generated / elapsed,
        "greedy": [list(r.outputs[0].token_ids) for r in first],
    }


def transformers_throughput(spec: dict[str, Any]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    # Its paged cache takes 90% of the free memory unless told otherwise: on a GPU that is the
    # point, on the CPU (the smoke run) it took 14 GB of the host's RAM beside the whole suite.
    cb = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=1024) if dev == "cpu" else None
    prompts, outs = workload(
        spec["num"], spec["vocab"], 0, spec["fixed_out"], spec.get("smoke", False)
    )
    errors = []
    for attn in (None, "paged|sdpa", "sdpa_paged", "paged_attention"):
        try:
            kwargs: dict[str, Any] = {} if attn is None else {"attn_implementation": attn}
            model: Any = AutoModelForCausalLM.from_pretrained(
                spec["model"], dtype=torch.bfloat16, **kwargs
            )
            model = model.to(dev)
            gen = GenerationConfig(
                max_new_tokens=outs[0], do_sample=False, eos_token_id=None, pad_token_id=0
            )
            batch = {"generation_config": gen, "continuous_batching_config": cb}
            model.generate_batch(inputs=prompts[:2], **batch)  # warm-up
            sync()
            start = time.perf_counter()
            results = model.generate_batch(inputs=prompts, **batch)
            sync()
            elapsed = time.perf_counter() - start
            generated = sum(len(r.generated_tokens) for r in results.values())
            return {
                "tok_s": generated / elapsed,
                "seconds": elapsed,
                "tokens": generated,
                "attn": str(attn),
            }
        except Exception as exc:
            errors.append(f"{attn}: {type(exc).__name__}: {exc}"[:300])
            gc.collect()
    raise RuntimeError(" | ".join(errors))


def bench_cli(spec: dict[str, Any]) -> dict[str, Any]:
    """``ladle bench throughput --profile`` (its workloads A and B, its GEMM ceiling probe and
    its decode-step profile) on this GPU, so its CPU numbers have a GPU counterpart."""
    from ladle.cli import main as ladle

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        # The fixed-length runs above already compare with transformers.
        argv = ["bench", "throughput", "--model", spec["model"], "--skip-transformers", "--profile"]
        if spec.get("smoke"):
            argv += ["--kv-cache-memory", "256Mi"]  # not 8 GiB of the host's RAM
        ladle([*argv, "--repeats", "1", "--json", str(out)])
        rows: list[dict[str, Any]] = json.loads(out.read_text())["runs"]
    return {"rows": rows}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def count_syncs(spec: dict[str, Any]) -> dict[str, Any]:
    """Synchronizing CUDA calls per decode step at batch 1 and a large batch, with mixed
    sampling params: a sync per request would make the second count grow."""
    from ladle.runtime import SamplingParams

    llm = _llm(spec, max_num_seqs=64, gpu_memory_utilization=0.5)
    engine = llm.engine
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, max_tokens=64, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.9, max_tokens=64, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=7, max_tokens=64, ignore_eos=True),
        SamplingParams(temperature=0.9, min_p=0.05, logprobs=2, max_tokens=64, ignore_eos=True),
        SamplingParams(
            repetition_penalty=1.1, presence_penalty=0.2, max_tokens=64, ignore_eos=True
        ),
    ]
    per_step: dict[str, float] = {}
    large = len(kinds) if spec.get("smoke") else 64
    per_step["large_batch"] = large
    for batch in (1, large):
        for i in range(batch):
            engine.add_request(
                f"s{batch}-{i}", {"prompt_token_ids": [5 + i, 6, 7, 8]}, kinds[i % len(kinds)]
            )
        for _ in range(3):  # prefill, then decode steps
            engine.step()
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(4):
                engine.step()
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        syncs = sum(1 for w in caught if "synchroniz" in str(w.message).lower())
        per_step["batch_1" if batch == 1 else "large"] = syncs / 4
        engine.abort_request([f"s{batch}-{i}" for i in range(batch)])
    return per_step


def graph_parity(spec: dict[str, Any]) -> dict[str, Any]:
    """Greedy tokens with decode CUDA graphs vs eager, and one stream's time per token."""
    from ladle.runtime import SamplingParams

    smoke = spec.get("smoke", False)
    prompts, _ = workload(3 if smoke else 32, spec["vocab"], 1, None, smoke)
    params = SamplingParams(temperature=0.0, max_tokens=4 if smoke else 64, ignore_eos=True)
    stream = 4 if smoke else 128
    result: dict[str, Any] = {}
    tokens: dict[bool, list[list[int]]] = {}
    for eager in (False, True):
        llm = _llm(spec, enforce_eager=eager, gpu_memory_utilization=0.4, max_num_seqs=64)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens[eager] = [list(o.outputs[0].token_ids) for o in outs]
        one = SamplingParams(temperature=0.0, max_tokens=stream, ignore_eos=True)
        llm.generate([{"prompt_token_ids": prompts[0]}], one, use_tqdm=False)
        sync()
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompts[0]}], one, use_tqdm=False)
        sync()
        ms = (time.perf_counter() - start) / stream * 1e3
        result["eager_ms_per_token" if eager else "graph_ms_per_token"] = ms
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    same = sum(a == b for a, b in zip(tokens[False], tokens[True], strict=True))
    result["identical_sequences"] = same / len(prompts)
    return result


# -- 4/5. engine sections ---------------------------------------------------------------------

# Smoke runs: the tiny model in fp32 through the interpreted kernels.
SMOKE_ENGINE = {
    "device": "cpu",
    "attention_backend": "triton",
    "dtype": "float32",
    "kv_cache_memory": "64MiB",
    "max_model_len": 256,
}


def engine_checks(report: Report, default: Path, smoke: bool, interpret: bool) -> None:
    vocab = (TINY_LLAMA if smoke else SMOLLM2_135M)["vocab_size"]
    base: dict[str, Any] = {
        "model": str(default),
        "vocab": vocab,
        "smoke": smoke,
        "interpret": interpret,
        "section": "engine",
        "engine": SMOKE_ENGINE if smoke else {},
    }
    spec = {**base, "kind": "syncs", "label": "host syncs per decode step"}
    syncs = run_worker(report, spec, 240)
    if syncs is not None:
        ok = None if smoke else syncs["large"] <= syncs["batch_1"]
        name = f"syncs per decode step, batch {syncs['large_batch']}"
        note = f"batch 1: {syncs['batch_1']}"
        report.add(Row("engine", name, syncs["large"], "syncs", ok, note))
    spec = {**base, "kind": "graphs", "label": "graphs vs eager"}
    parity = run_worker(report, spec, 300)
    if parity is not None:
        frac = parity["identical_sequences"]
        name = "greedy outputs identical, graphs vs eager"
        report.add(Row("engine", name, frac, "frac", frac >= 0.9, "bf16 near-ties may flip"))
        ms = parity["graph_ms_per_token"]
        note = f"eager takes {parity['eager_ms_per_token'] / ms:.2f}x"
        report.add(Row("engine", "one stream's decode, graphs", ms, "ms/tok", None, note))
    spec = {**base, "kind": "spec", "label": "speculative decoding"}
    speculative = run_worker(report, spec, 300)
    for drafter, label in (("ngram", "n-gram drafts"), ("draft_model", "an int4 draft model")):
        if speculative is None:
            break
        same = speculative[f"{drafter}_identical"]
        report.add(Row("engine", f"greedy identical with {label}", float(same), "bool", same, ""))
        tok_s, plain = speculative[f"{drafter}_tok_s"], speculative["plain_tok_s"]
        note = (f"{tok_s:.0f} against {plain:.0f} tok/s, "
                f"{speculative[f'{drafter}_acceptance']:.0%} of draft tokens accepted")  # fmt: skip
        report.add(Row("engine", f"one stream, {label} / plain", tok_s / plain, "x", None, note))


def parallel_checks(report: Report, models_dir: Path, default: Path, dev: torch.device,
                    smoke: bool, interpret: bool) -> None:  # fmt: skip
    """Tensor parallelism 2, 4 and 8 against 1, as far as the machine's GPUs go (the smoke run:
    2 CPU processes over gloo): greedy outputs the same, and throughput on a fixed batch."""
    if smoke:
        base = {"model": str(default), "vocab": TINY_LLAMA["vocab_size"], "num": 2,
                "engine": SMOKE_ENGINE}  # fmt: skip
        sizes = [2]
    else:
        qwen = build_model(QWEN3_06B, models_dir / "qwen3-0.6b-shape", dev)
        base = {"model": str(qwen), "vocab": QWEN3_06B["vocab_size"], "num": 64, "engine": {}}
        sizes = [n for n in (2, 4, 8) if n <= torch.cuda.device_count()]
        if not sizes:
            report.add(Row("parallel", "tensor parallelism: skipped, one GPU", None, ""))
            return
    common = {**base, "kind": "tp", "section": "parallel", "smoke": smoke,
              "interpret": interpret, "fixed_out": 4 if smoke else 256}  # fmt: skip
    one = run_worker(report, {**common, "size": 1, "label": "tensor parallel 1"}, 300)
    for size in sizes:
        result = run_worker(report, {**common, "size": size, "label": f"tensor parallel {size}"},
                            300)  # fmt: skip
        if result is None or one is None:
            continue
        same = result["greedy"] == one["greedy"]
        note = "bf16 sums in another order may flip near-ties"
        name = f"greedy identical, tp {size} vs 1"
        report.add(Row("parallel", name, float(same), "bool", same if smoke else None, note))
        note = f"{result['tok_s']:.0f} against {one['tok_s']:.0f} tok/s"
        report.add(Row("parallel", f"throughput, tp {size} / 1", result["tok_s"] / one["tok_s"],
                       "x", None, note))  # fmt: skip


def throughput(
    report: Report, models_dir: Path, default: Path, dev: torch.device, smoke: bool, interpret: bool
) -> None:
    base: dict[str, Any] = {
        "kind": "ladle",
        "section": "throughput",
        "smoke": smoke,
        "interpret": interpret,
    }
    if smoke:
        name, fixed = "tiny", 6
        big = {"model": str(default), "vocab": TINY_LLAMA["vocab_size"], "num": 2}
        small = big
        engine: dict[str, Any] = SMOKE_ENGINE
    else:
        name, fixed = "Qwen3-0.6B shape", 512
        qwen = build_model(QWEN3_06B, models_dir / "qwen3-0.6b-shape", dev)
        big = {"model": str(qwen), "vocab": QWEN3_06B["vocab_size"], "num": 256}
        small = {"model": str(default), "vocab": SMOLLM2_135M["vocab_size"], "num": 256}
        engine = {}
    fixed_runs = [
        (f"Ladle, {name}, fixed out {fixed}", {**big, "fixed_out": fixed, "engine": engine}),
        (
            f"transformers CB, {name}, fixed out {fixed}",
            {**big, "kind": "transformers", "fixed_out": fixed},
        ),
    ]
    nano = [
        (f"{name}, nano-vllm workload, graphs", {**big, "engine": engine}),
        ("default model, nano-vllm workload", {**small, "engine": engine}),
        ("default model, nano-vllm, int8 weights", {**small, "engine": {"quantization": "int8"}}),
        (
            "default model, nano-vllm, int4 AWQ g32",
            {**small, "engine": {"quantization": "int4"}},
        ),
        (
            "default model, nano-vllm, int8 weights + KV",
            {**small, "engine": {"quantization": "int8", "kv_cache_dtype": "int8"}},
        ),
        (f"{name}, nano-vllm workload, eager", {**big, "engine": {"enforce_eager": True}}),
        (
            f"{name}, nano-vllm workload, torch attn",
            {**big, "engine": {"attention_backend": "torch"}},
        ),
    ]
    # Smoke: one Ladle run and the transformers path prove the plumbing (the quantized engine
    # runs under the interpreter in tests/kernels/test_engine.py).
    runs = fixed_runs if smoke else [nano[0], *fixed_runs, *nano[1:]]
    for label, extra in runs:
        result = run_worker(report, {**base, **extra, "label": label}, 600 if smoke else 180)
        if result is not None:
            note = f"{result['tokens']} tokens in {result['seconds']:.1f} s"
            report.add(Row("throughput", label, result["tok_s"], "tok/s", None, note))
    report.meta["public_reference"] = PUBLIC
    label = "ladle bench throughput --profile, default model"
    spec = {**base, "kind": "bench_cli", "model": str(default), "label": label}
    result = run_worker(report, spec, 240)
    for row in result["rows"] if result else []:
        name = f"bench throughput {row['workload']} {row['system']}"
        report.add(
            Row("throughput", name, row["tok_per_s"], "tok/s", None, "profile in workers.log")
        )


# -- main -------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="output folder (default: $OUT, else out/gpu_check)")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes; CPU interpreter if no GPU"
    )
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run")
    parser.add_argument("--models-dir", help="where random-weight checkpoints are built")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        sys.exit("no CUDA device: run with --smoke for the CPU interpreter check")
    interpret = not cuda
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    out = Path(args.out or os.environ.get("OUT") or ROOT / "out" / "gpu_check")
    if (out / "workers.log").exists():
        (out / "workers.log").unlink()
    report = Report(out, args.budget)
    dev = torch.device("cuda" if cuda else "cpu")
    import transformers
    import triton

    report.meta.update(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name()
        if cuda
        else f"cpu ({platform.processor() or 'unknown'}), Triton interpreter",
        torch=torch.__version__,
        triton=triton.__version__,
        transformers=transformers.__version__,
        python=platform.python_version(),
        smoke=args.smoke,
        command=" ".join(sys.argv),
    )
    models_dir = Path(args.models_dir or tempfile.gettempdir()) / "ladle_gpu_check_models"
    section(report, "ceiling", 10, lambda: ceilings(report, dev, args.smoke))
    section(report, "correct", 30, lambda: correctness(report, dev, args.smoke))
    section(report, "timing", 60, lambda: timings(report, dev, args.smoke))
    section(report, "quant", 30, lambda: quantized_gemms(report, dev, args.smoke))
    section(report, "lora", 20, lambda: lora_kernels(report, dev, args.smoke))
    holder: dict[str, Path] = {}
    section(
        report,
        "models",
        60,
        lambda: holder.update(default=default_model(report, models_dir, dev, args.smoke)),
    )
    if "default" in holder:
        section(
            report,
            "engine",
            60,
            lambda: engine_checks(report, holder["default"], args.smoke, interpret),
        )
        section(
            report,
            "throughput",
            60,
            lambda: throughput(report, models_dir, holder["default"], dev, args.smoke, interpret),
        )
        section(
            report,
            "parallel",
            60,
            lambda: parallel_checks(
                report, models_dir, holder["default"], dev, args.smoke, interpret
            ),
        )
    report.meta["seconds"] = round(time.monotonic() - report.started, 1)
    report.save()
    table = report.table()
    (out / "table.txt").write_text(table + "\n")
    if args.smoke and not args.models_dir:
        shutil.rmtree(models_dir, ignore_errors=True)
    print("\n" + table)
    sys.exit(1 if any(r.ok is False for r in report.rows) else 0)


if __name__ == "__main__":
    main()
