#!/usr/bin/env python3
"""CPU decode attention over the paged cache, in interleaved rounds: this checkout's C kernel
against the one of an earlier commit (built from that commit's sources with the same flags), or
this checkout's kernel over an fp16 cache against the same over an fp32 cache.

The batch is what workload B's decode steps hold: 128 sequences of 40 to 270 tokens over
shuffled blocks of 16, with SmolLM2-135M's heads (9 query, 3 KV, 64 wide) and its 30 layers,
each with a cache of its own. A timed pass runs every layer once, as a decode step does, after
a read of more memory than the last-level cache holds: no layer's keys and values are still
cached from an earlier pass or the other arm. Reported: the median time a layer (spread:
min-max over rounds, the order alternating) for each arm, the ratio, and the rate at which the
second reads its KV cache.

    .venv/bin/python bench/attention.py --baseline-rev 88dd438
    .venv/bin/python bench/attention.py --baseline-rev 88dd438 --threads 1
    .venv/bin/python bench/attention.py --fp16-cache
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from harness import baseline_library  # noqa: E402

from ladle.runtime.kernels import cpu_kernels  # noqa: E402

SEQS, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 128, 9, 3, 64, 16, 30
FLUSH_BYTES = 1 << 30  # more than any last-level cache seen here (480 MB)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    against = parser.add_mutually_exclusive_group(required=True)
    against.add_argument("--baseline-rev", help="the commit to compare with")
    against.add_argument(
        "--fp16-cache", action="store_true", help="an fp16 cache against an fp32 one"
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    new = cpu_kernels.load()
    assert new is not None, "the CPU kernels did not build"
    torch.manual_seed(0)
    lens = torch.randint(40, 270, (SEQS,), dtype=torch.int32)
    per_seq = (lens + BLOCK - 1) // BLOCK
    blocks = int(per_seq.sum())
    shape = (blocks, BLOCK, KV_HEADS, HEAD_DIM)
    caches = [(torch.randn(shape), torch.randn(shape)) for _ in range(LAYERS)]
    order = torch.randperm(blocks).to(torch.int32).tolist()
    tables = torch.zeros(SEQS, int(per_seq.max()), dtype=torch.int32)
    for s in range(SEQS):
        for j in range(int(per_seq[s])):
            tables[s, j] = order.pop()
    q = torch.randn(SEQS, Q_HEADS, HEAD_DIM)
    flush = torch.ones(FLUSH_BYTES // 4)
    with tempfile.TemporaryDirectory() as tmp:
        if args.fp16_cache:
            halves = [(k.half(), v.half()) for k, v in caches]
            arms = {"fp32 cache": (new, caches), "fp16 cache": (new, halves)}
        else:
            old = baseline_library(args.baseline_rev, Path(tmp))
            arms = {"baseline": (old, caches), "this checkout": (new, caches)}
        outs = {name: torch.empty_like(q) for name in arms}
        times: dict[str, list[float]] = {name: [] for name in arms}
        for r in range(args.rounds):
            for name in list(arms) if r % 2 == 0 else list(arms)[::-1]:
                lib, layers = arms[name]
                float(flush.sum())
                start = time.perf_counter()
                for k, v in layers:
                    cpu_kernels.paged_decode_attention(
                        lib, q, k, v, tables, lens, HEAD_DIM**-0.5, outs[name]
                    )
                times[name].append((time.perf_counter() - start) / LAYERS * 1e3)
    first, second = arms
    # The same outputs, up to fp16's rounding of the keys and values.
    error = float((outs[second] - outs[first]).norm() / outs[first].norm())
    assert error < (1e-3 if args.fp16_cache else 1e-6), f"the arms disagree: {error:.2e}"
    element = arms[second][1][0][0].element_size()
    kv_bytes = 2 * int(lens.sum()) * KV_HEADS * HEAD_DIM * element
    print(f"decode attention, {SEQS} sequences of {int(lens.min())}-{int(lens.max())} tokens, "
          f"{Q_HEADS}/{KV_HEADS} heads of {HEAD_DIM}, {args.threads} threads, "
          f"{kv_bytes / 1e6:.1f} MB of KV a layer ({second})")  # fmt: skip
    for name, values in times.items():
        print(f"  {name:<14} {statistics.median(values):.3f} ms a layer "
              f"({min(values):.3f}-{max(values):.3f})")  # fmt: skip
    ratio = statistics.median(times[first]) / statistics.median(times[second])
    rate = kv_bytes / statistics.median(times[second]) / 1e6
    print(f"  {second} {ratio:.2f}x {first}'s speed; reads its KV cache at {rate:.1f} GB/s")


if __name__ == "__main__":
    main()
