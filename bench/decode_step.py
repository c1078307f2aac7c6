#!/usr/bin/env python3
"""The fused CPU decode step (``decode_step.c``) of this checkout against that of an earlier
commit, on the default model (fp32, or quantized with ``--quantization``), at the batch sizes
it serves, in one process.

For each batch size the engine runs that many 64-token prompts to their decode phase, and one
decode step's inputs are kept. Both builds (the earlier commit's sources compiled with this
checkout's flags) then run that same step over the same weights and KV cache, in interleaved
rounds (the order alternating; a read of more memory than the last-level cache holds before
each arm, so that neither finds weights the other left there). Both must give the same logits,
up to rounding where the sums' order changed (the largest difference is printed).
Reported per batch: the median time a step and its spread (min-max over rounds), the weights
read per second, and this checkout's step time over the baseline's, the median of the ratios
taken within each round.

    .venv/bin/python bench/decode_step.py --baseline-rev 29cdcdc     # about a minute
    .venv/bin/python bench/decode_step.py --baseline-rev 29cdcdc --batches 1 --threads 1
    .venv/bin/python bench/decode_step.py --baseline-rev 29cdcdc --quantization int8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from harness import baseline_library  # noqa: E402

from ladle.runtime.bench.profile import start_decoding  # noqa: E402
from ladle.runtime.kernels.decode_step import MAX_BATCH, CpuDecodeStep  # noqa: E402
from ladle.runtime.llm import LLM  # noqa: E402

FLUSH_BYTES = 1 << 30  # more than any last-level cache seen here (480 MB)
PROMPT_TOKENS = 64


def step_inputs(llm: LLM, batch: int, first_token: int) -> tuple[Any, ...]:
    """The arguments of the fused step's call for ``batch`` sequences in their decode phase
    (fresh prompts from ``first_token`` on); the requests are aborted again."""
    fused = llm.engine.runner.forward.fused
    assert fused is not None
    prompts = [
        list(range(first_token + i * PROMPT_TOKENS, first_token + (i + 1) * PROMPT_TOKENS))
        for i in range(batch)
    ]
    ids = start_decoding(llm, prompts, 8)
    seen: list[tuple[Any, ...]] = []
    run = fused.run

    def keep(*args: Any) -> Any:
        seen.append(args)
        return run(*args)

    fused.run = keep  # type: ignore[method-assign]
    try:
        llm.engine.step()
    finally:
        del fused.run  # the method again
        llm.engine.abort_request(ids)
    (inputs,) = seen
    assert inputs[2].num_seqs == batch
    return inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-rev", required=True, help="the commit to compare with")
    parser.add_argument("--batches", default="1,2,4,8", help="comma-separated batch sizes")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=10, help="steps a timed block")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--quantization", choices=["int8", "int4"], help="default: none, fp32")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if not all(1 <= b <= MAX_BATCH for b in batches):
        parser.error(f"--batches: each between 1 and {MAX_BATCH}, the fused step's most")
    torch.set_num_threads(args.threads)
    llm = LLM(dtype="float32", quantization=args.quantization)
    forward = llm.engine.runner.forward
    new = forward.fused
    assert new is not None, "the fused CPU decode step is not available here"
    weights = llm.engine.model.weight_bytes()
    flush = torch.ones(FLUSH_BYTES // 4)
    print(f"fused decode step, default model {args.quantization or 'fp32'} "
          f"({weights / 1e6:.0f} MB of weights), "
          f"{args.threads} threads, {args.rounds} rounds of {args.steps} steps an arm; "
          f"baseline {args.baseline_rev}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        old = CpuDecodeStep(baseline_library(args.baseline_rev, Path(tmp)), new.model,
                            forward.caches)  # fmt: skip
        arms = {"baseline": old, "this checkout": new}
        for n, batch in enumerate(batches):
            inputs = step_inputs(llm, batch, 1000 + 1000 * n)
            before, after = (arm.run(*inputs)[1].clone() for arm in arms.values())
            torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
            difference = float((after - before).abs().max())
            times: dict[str, list[float]] = {name: [] for name in arms}
            for r in range(args.rounds):
                for name in list(arms) if r % 2 == 0 else list(arms)[::-1]:
                    float(flush.sum())
                    start = time.perf_counter()
                    for _ in range(args.steps):
                        arms[name].run(*inputs)
                    times[name].append((time.perf_counter() - start) / args.steps * 1e3)
            print(f"batch {batch} (logits' largest difference {difference:.1e}):")
            for name, values in times.items():
                median = statistics.median(values)
                print(f"  {name:<14} {median:7.2f} ms a step ({min(values):.2f}-"
                      f"{max(values):.2f})  {weights / median / 1e6:5.1f} GB/s")  # fmt: skip
            ratios = [b / a for a, b in zip(times["baseline"], times["this checkout"], strict=True)]
            print(f"  this checkout / baseline: {statistics.median(ratios):.3f} "
                  f"({min(ratios):.3f}-{max(ratios):.3f})")  # fmt: skip


if __name__ == "__main__":
    main()
