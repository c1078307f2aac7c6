#!/usr/bin/env python3
"""Tensor parallelism 2 against 1 on this machine, measured in one run on the default model.

Three engines are built up front: one rank (as users run it, with the fused CPU decode step),
one rank eager (the same op-by-op path that split ranks run, to tell the split's cost from
the fast path's gain), and two ranks (two processes over gloo, each with half the cores).
Then, in interleaved rounds (the order rotates each round, so that the machine's drift lands
on all alike), each engine serves the same requests, greedy, 64 new tokens:

* **batch 1**: one request at a time, for TPOT and output tokens per second;
* **batch 8**: eight requests together, for output tokens per second.

Every round uses prompts of ``ladle bench throughput``'s workload A that no earlier round
used, every engine the same ones (nothing is served from an earlier run's prefix cache).
Reported: medians and spreads over rounds, and the ratios of two ranks to one. On a 2-core
machine two ranks are expected to be slower (the same cores, plus an all-reduce per
projection); the GPU script (``bench/gpu_check.py``) times sizes 2, 4 and 8 on GPUs.

    .venv/bin/python bench/tensor_parallel.py              # about 4 minutes on 2 cores
    .venv/bin/python bench/tensor_parallel.py --rounds 2   # a quick look
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from harness import summary, time_alone  # noqa: E402 - after the path that finds ladle

OUTPUT_TOKENS = 64
BATCH = 8
ENGINES = {
    "1 rank": {},
    "1 rank, eager": {"enforce_eager": True},
    "2 ranks": {"tensor_parallel_size": 2},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    from ladle.runtime import LLM, SamplingParams
    from ladle.runtime.bench.workloads import WORKLOADS

    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    flags: dict[str, Any] = {"kv_cache_memory": "512MiB", "max_model_len": 1024}
    engines = {name: LLM(None, **flags, **extra) for name, extra in ENGINES.items()}
    workload = WORKLOADS["A"]
    for llm in engines.values():  # first-step costs, outside every timing
        llm.generate(workload.prompts(seed=999)[:2], params, use_tqdm=False)

    results: dict[str, list[float]] = {}
    names = list(engines)
    try:
        for r in range(args.rounds):
            prompts = workload.prompts(seed=r + 1)[: BATCH + 1]
            for who in names[r % len(names) :] + names[: r % len(names)]:
                llm = engines[who]
                seconds, tpot, tokens = time_alone(llm.engine, prompts[0], params)
                results.setdefault(f"{who}/b1/tok_s", []).append(tokens / seconds)
                results.setdefault(f"{who}/b1/tpot", []).append(tpot)
                started = time.perf_counter()
                outs = llm.generate(prompts[1:], params, use_tqdm=False)
                elapsed = time.perf_counter() - started
                made = sum(len(o.outputs[0].token_ids) for o in outs)
                results.setdefault(f"{who}/b{BATCH}/tok_s", []).append(made / elapsed)
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    finally:
        for llm in engines.values():
            llm.engine.shutdown()

    print()
    for who in names:
        print(summary(f"{who}, batch 1, output", results[f"{who}/b1/tok_s"], "tok/s"))
        print(summary(f"{who}, batch 1, TPOT", results[f"{who}/b1/tpot"], "ms", 1e3))
        print(summary(f"{who}, batch {BATCH}, output", results[f"{who}/b{BATCH}/tok_s"], "tok/s"))
    print()
    for base in ("1 rank", "1 rank, eager"):
        ratios = [
            statistics.median(results[f"2 ranks/{key}"])
            / statistics.median(results[f"{base}/{key}"])
            for key in ("b1/tok_s", "b1/tpot", f"b{BATCH}/tok_s")
        ]
        print(
            f"2 ranks / {base}: batch 1 output tok/s {ratios[0]:.3f}x, TPOT {ratios[1]:.3f}x; "
            f"batch {BATCH} output tok/s {ratios[2]:.3f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
