#!/usr/bin/env python3
"""Speed and memory of quantized variants against fp32, measured in one run.

For each configuration (fp32 first, the baseline) one engine is built up front (AWQ's
calibration is cached, and outside every timing). Then, for each batch size, every
configuration's decode step is timed in interleaved rounds (the order rotates each round), so
that the machine's drift lands on all of them alike; each timed run prefills a fresh batch of
distinct prompts (prefix caching off: no work carried over) and times ``--steps`` full decode
steps of the engine (forward, sampling, scheduling: what a served token costs). Reported per
configuration and batch: median ms per step, the spread (min-max over rounds), the speed-up
over fp32's median, and at batch 1 the weight bytes read per second. Memory: weight bytes,
and KV-cache tokens per GiB of budget.

Targets (issue 13, on CPU): int8 at batch 1 >= 2x fp32, int4 >= 3x, none below 0.85x at batch
32; an int8 KV cache holds >= 3.5x the tokens.

    .venv/bin/python bench/quantization.py                      # about 10 minutes, 2 cores
    .venv/bin/python bench/quantization.py --rounds 2 --steps 4 # a quick look
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

CONFIGS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "int8": {"quantization": "int8"},
    "int8-g32": {"quantization": "int8", "quantization_group_size": 32},
    "int4-awq-g32": {"quantization": "int4", "quantization_group_size": 32},
    "int8+kv-int8": {"quantization": "int8", "kv_cache_dtype": "int8"},
}
TARGETS = {("int8", 1): 2.0, ("int8-g32", 1): 2.0, ("int4-awq-g32", 1): 3.0}
BATCH_32_FLOOR = 0.85
KV_TARGET = 3.5
PROMPT_TOKENS = 64


@dataclass
class Timing:
    config: str
    batch: int
    ms_per_step: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.ms_per_step)


def decode_step_ms(llm: Any, batch: int, steps: int, seed: int) -> float:
    """Prefill ``batch`` fresh prompts, then time ``steps`` decode steps of the whole batch."""
    from ladle.runtime import SamplingParams

    engine = llm.engine
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        # Distinct prompts per run and request: nothing is served from an earlier run.
        ids = [(seed * 7919 + i * 104729 + t * 31) % (vocab - 1) + 1 for t in range(PROMPT_TOKENS)]
        engine.add_request(f"bench-{seed}-{i}", ids, params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()
    engine.step()  # every sequence now decodes: the first step with a full batch
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - started
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed / steps * 1e3


def kv_tokens_per_gib(llm: Any) -> float:
    spec = llm.engine.attention.spec
    return (1 << 30) / spec.bytes_per_block * spec.block_size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per batch")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per timed run")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    import torch

    from ladle.runtime import LLM
    from ladle.runtime.kernels import cpu_kernels, quant_ops

    configs = ["fp32", *[c for c in args.configs if c != "fp32"]]
    engine_args = {
        "max_num_seqs": max(args.batches),
        "enable_prefix_caching": False,
        "kv_cache_memory": "1GiB",
    }
    llms = {}
    for name in configs:
        started = time.monotonic()
        llms[name] = LLM(args.model, **engine_args, **CONFIGS[name])
        print(f"built {name} in {time.monotonic() - started:.1f} s", flush=True)
    lib = cpu_kernels.load()
    print(
        f"threads {torch.get_num_threads()}, kernels {quant_ops.isa(lib) if lib else 'none'}, "
        f"{args.rounds} rounds x {args.steps} steps per batch size",
        flush=True,
    )
    timings = {(c, b): Timing(c, b) for c in configs for b in args.batches}
    seed = 0
    for batch in args.batches:
        for round_ in range(args.rounds):
            order = configs[round_ % len(configs) :] + configs[: round_ % len(configs)]
            for name in order:
                seed += 1
                timings[(name, batch)].ms_per_step.append(
                    decode_step_ms(llms[name], batch, args.steps, seed)
                )
        line = ", ".join(f"{c} {timings[(c, batch)].median:.1f}" for c in configs)
        print(f"batch {batch}: median ms/step {line}", flush=True)

    results: dict[str, Any] = {"configs": {}, "batches": args.batches, "rounds": args.rounds}
    print(f"\n{'config':<14} {'batch':>5} {'ms/step':>9} {'spread':>15} {'vs fp32':>8}  target")
    failures = []
    for name in configs:
        model = llms[name].engine.model
        weight_bytes = model.weight_bytes()
        entry: dict[str, Any] = {
            "weight_bytes": weight_bytes,
            "kv_tokens_per_gib": kv_tokens_per_gib(llms[name]),
            "batches": {},
        }
        for batch in args.batches:
            t = timings[(name, batch)]
            base = timings[("fp32", batch)].median
            speedup = base / t.median
            target = TARGETS.get((name, batch), BATCH_32_FLOOR if batch == 32 else None)
            verdict = (
                ""
                if target is None
                else (f">= {target}x {'ok' if speedup >= target else 'MISSED'}")
            )
            if target is not None and speedup < target:
                failures.append(f"{name} batch {batch}: {speedup:.2f}x < {target}x")
            spread = f"{min(t.ms_per_step):.1f}-{max(t.ms_per_step):.1f}"
            print(
                f"{name:<14} {batch:>5} {t.median:>9.1f} {spread:>15} {speedup:>7.2f}x  {verdict}"
            )
            entry["batches"][str(batch)] = {
                "ms_per_step": t.ms_per_step,
                "median_ms": t.median,
                "speedup": speedup,
            }
            if batch == 1:
                entry["weight_gbps_batch_1"] = weight_bytes / (t.median * 1e-3) / 1e9
        results["configs"][name] = entry
    print(f"\n{'config':<14} {'weight MB':>10} {'vs fp32':>8} {'KV tokens/GiB':>14} {'vs fp32':>8}")
    base = results["configs"]["fp32"]
    for name, entry in results["configs"].items():
        kv_ratio = entry["kv_tokens_per_gib"] / base["kv_tokens_per_gib"]
        if "kv-int8" in name and kv_ratio < KV_TARGET:
            failures.append(f"{name}: KV holds {kv_ratio:.2f}x the tokens < {KV_TARGET}x")
        gbps = entry.get("weight_gbps_batch_1")
        note = "" if gbps is None else f"  (batch 1 reads weights at {gbps:.1f} GB/s)"
        print(
            f"{name:<14} {entry['weight_bytes'] / 1e6:>10.1f} "
            f"{base['weight_bytes'] / entry['weight_bytes']:>7.2f}x "
            f"{entry['kv_tokens_per_gib']:>14,.0f} {kv_ratio:>7.2f}x{note}"
        )
    results["failures"] = failures
    print("\n" + ("all targets met" if not failures else "missed: " + "; ".join(failures)))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
