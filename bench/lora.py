#!/usr/bin/env python3
"""LoRA serving speed against the base model alone, measured in one run on the default model.

Two engines are built up front: the base model with LoRA off (the baseline a user compares
with), and the same model with ``--enable-lora --max-loras 4`` holding four random adapters of
rank 16 on all seven projections (the heaviest adapters the slots take). Then, in interleaved
rounds (the order alternates each round, so that the machine's drift lands on both alike):

* **batch**: 32 requests of 64 fresh prompt tokens and 64 output tokens, all at once; the LoRA
  run spreads them over the four adapters (8 each, one batch mixing all four). Throughput is
  output tokens per second of the whole run, prefill included.
* **batch-1 TPOT**: one request, 64 prompt tokens, 65 output tokens; the time per output
  token after the first. The LoRA run uses one adapter.

Every timed run uses prompts no earlier run used (nothing is served from the prefix cache),
and the adapters are resident before the first round (their first load is not a served
token's cost). Reported: the median of each, its spread (min-max over rounds), and the ratio
of medians against the targets of issue 37: throughput >= 0.8x the base model's, TPOT <=
1.15x.

    .venv/bin/python bench/lora.py               # about 6 minutes on 2 cores
    .venv/bin/python bench/lora.py --rounds 2    # a quick look
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from harness import summary, time_alone  # noqa: E402 - after the path that finds ladle

THROUGHPUT_FLOOR = 0.8
TPOT_CEILING = 1.15
ADAPTERS = 4
RANK = 16
BATCH = 32
PROMPT_TOKENS = 64
OUTPUT_TOKENS = 64
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(base: Path, folder: Path) -> list[Path]:
    """Random PEFT adapters (A and B both random, so that nothing is skipped as zero)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folders = []
    for i in range(ADAPTERS):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        torch.manual_seed(i)
        config = LoraConfig(
            r=RANK, lora_alpha=2 * RANK, target_modules=MODULES, init_lora_weights=False
        )
        get_peft_model(model, config).save_pretrained(str(folder / f"adapter-{i}"))
        folders.append(folder / f"adapter-{i}")
    return folders


class Workloads:
    """Fresh prompts for every run: a run's seed decides its token ids."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.seed = 0

    def prompts(self, count: int) -> list[list[int]]:
        self.seed += 1
        s, v = self.seed, self.vocab - 1
        return [
            [(s * 7919 + i * 104729 + t * 31) % v + 1 for t in range(PROMPT_TOKENS)]
            for i in range(count)
        ]


def run_batch(llm: Any, prompts: list[list[int]], adapters: list[Any]) -> float:
    """Output tokens per second of one whole batch, prefill included."""
    from ladle.runtime import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    started = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False, lora_request=adapters or None)
    elapsed = time.perf_counter() - started
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def run_tpot(llm: Any, prompt: list[int], adapter: Any) -> float:
    """Seconds per output token after the first, for one request alone."""
    from ladle.runtime import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS + 1, ignore_eos=True)
    _, tpot, _ = time_alone(llm.engine, {"prompt_token_ids": prompt}, params, lora_request=adapter)
    return tpot


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    from ladle.runtime import LLM, LoRARequest
    from ladle.runtime.models.loader import resolve_model

    base_path = resolve_model(None)
    with tempfile.TemporaryDirectory(prefix="ladle-lora-bench-") as tmp:
        print("building 4 random rank-16 adapters on all projections...", flush=True)
        folders = make_adapters(base_path, Path(tmp))
        requests = [LoRARequest(f.name, i + 1, str(f)) for i, f in enumerate(folders)]
        flags: dict[str, Any] = {"kv_cache_memory": "2GiB", "max_model_len": 1024}
        base = LLM(None, **flags)
        lora = LLM(None, enable_lora=True, max_loras=ADAPTERS, max_lora_rank=RANK, **flags)
        for request in requests:
            lora.engine.add_lora(request)
        work = Workloads(base.engine.model_config.vocab_size)
        # Load every adapter into its slot, and warm both engines, outside every timing.
        run_batch(lora, work.prompts(ADAPTERS), requests)
        run_batch(base, work.prompts(ADAPTERS), [])

        spread = [requests[i % ADAPTERS] for i in range(BATCH)]
        runs: dict[str, Callable[[], float]] = {
            "batch/base": lambda: run_batch(base, work.prompts(BATCH), []),
            "batch/lora": lambda: run_batch(lora, work.prompts(BATCH), spread),
            "tpot/base": lambda: run_tpot(base, work.prompts(1)[0], None),
            "tpot/lora": lambda: run_tpot(lora, work.prompts(1)[0], requests[0]),
        }
        results: dict[str, list[float]] = {name: [] for name in runs}
        for r in range(args.rounds):
            for kind in ("batch", "tpot"):
                order = ["base", "lora"] if r % 2 == 0 else ["lora", "base"]
                for who in order:
                    name = f"{kind}/{who}"
                    results[name].append(runs[name]())
            print(f"round {r + 1}/{args.rounds} done", flush=True)

    print()
    print(summary("batch 32, base model", results["batch/base"], "tok/s"))
    print(summary("batch 32, 4 adapters", results["batch/lora"], "tok/s"))
    print(summary("batch-1 TPOT, base model", results["tpot/base"], "ms", 1000))
    print(summary("batch-1 TPOT, adapter", results["tpot/lora"], "ms", 1000))
    throughput = statistics.median(results["batch/lora"]) / statistics.median(results["batch/base"])
    tpot = statistics.median(results["tpot/lora"]) / statistics.median(results["tpot/base"])
    ok_throughput = throughput >= THROUGHPUT_FLOOR
    ok_tpot = tpot <= TPOT_CEILING
    print()
    print(f"throughput, adapters / base: {throughput:.3f}x (target >= {THROUGHPUT_FLOOR}x) "
          f"{'met' if ok_throughput else 'MISSED'}")  # fmt: skip
    print(f"batch-1 TPOT, adapter / base: {tpot:.3f}x (target <= {TPOT_CEILING}x) "
          f"{'met' if ok_tpot else 'MISSED'}")  # fmt: skip
    return 0 if ok_throughput and ok_tpot else 1


if __name__ == "__main__":
    sys.exit(main())
