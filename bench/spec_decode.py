#!/usr/bin/env python3
"""Speculative decoding against plain decoding, at batch 1, measured in one run on the default
model, for each drafter: n-gram prompt lookup, and a copy of the model rounded to int4.

The engines are built up front, the same but for ``--speculative-config``. Then, in
interleaved rounds (the order rotates each round, so that the machine's drift lands on all
alike), each engine serves the same requests one at a time, greedy, 128 new tokens:

* **rewrite**: "rewrite this passage" over a paragraph of the standard library's own prose:
  the answer repeats its prompt, where drafts should be accepted;
* **A**: prompts of ``ladle bench throughput``'s workload A (random words), where drafts
  mostly fail.

Every round uses prompts no earlier round used, every engine the same ones (nothing is served
from the prefix cache of an earlier run). Reported per workload: output tokens per second and
TPOT (after the first token), medians and spreads over rounds, and the acceptance rate;
against the targets of issue 38: at least 1.5x tokens/s on rewrite, at least 0.97x on A.
llama.cpp has no place in this table: its peer is ``ladle bench latency --baseline llama.cpp``,
without speculation.

    .venv/bin/python bench/spec_decode.py              # about 10 minutes on 2 cores
    .venv/bin/python bench/spec_decode.py --rounds 2 --drafters draft_model   # a quick look
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from harness import summary, time_alone  # noqa: E402 - after the path that finds ladle

REWRITE_FLOOR = 1.5
A_FLOOR = 0.97
OUTPUT_TOKENS = 128
PER_ROUND = 2  # requests of each workload per round
CONFIGS: dict[str, dict[str, Any]] = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 4,
              "prompt_lookup_min": 2},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 7,
                    "quantization": "int4"},
}  # fmt: skip
# Modules whose docstrings are paragraphs of plain English.
SOURCES = (
    "argparse", "bisect", "calendar", "colorsys", "contextlib", "csv", "difflib", "fnmatch",
    "fractions", "functools", "getopt", "gettext", "heapq", "imaplib", "json", "locale",
    "mailbox", "numbers", "optparse", "pickle", "pprint", "queue", "sched", "shlex", "string",
    "tabnanny", "textwrap", "timeit", "tokenize", "zipfile",
)  # fmt: skip


def passages() -> list[str]:
    out = []
    for name in SOURCES:
        doc = " ".join((importlib.import_module(name).__doc__ or "").split())
        if len(doc) >= 300:
            out.append(doc[:700])
    return out


def rewrite_prompt(passage: str, round_: int, i: int) -> str:
    return (
        f"Request {round_}.{i}. Rewrite the passage below word for word.\n\n"
        f"Passage:\n{passage}\n\nRewritten passage:\n"
    )


def serve(llm: Any, prompt: str) -> tuple[float, float]:
    """(output tokens per second, seconds per output token after the first)."""
    from ladle.runtime import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    seconds, tpot, tokens = time_alone(llm.engine, prompt, params)
    return tokens / seconds, tpot


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--drafters", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS), metavar="NAME"
    )
    args = parser.parse_args()

    from ladle.runtime import LLM
    from ladle.runtime.bench.workloads import WORKLOADS

    texts = passages()
    needed = args.rounds * PER_ROUND + 1
    if len(texts) < needed:
        parser.error(f"--rounds {args.rounds} needs {needed} passages; there are {len(texts)}")
    flags: dict[str, Any] = {"kv_cache_memory": "1GiB", "max_model_len": 1024}
    engines = {"plain": LLM(None, **flags)}
    for name in args.drafters:
        engines[name] = LLM(None, speculative_config=CONFIGS[name], **flags)
    workload_a = WORKLOADS["A"]
    # Warm every engine (first-step costs, the fused kernels' setup) outside every timing.
    for llm in engines.values():
        serve(llm, rewrite_prompt(texts[-1], 0, 0))
        serve(llm, workload_a.prompts(seed=999)[0])

    results: dict[str, list[float]] = {}
    accepted: dict[str, list[int]] = {}  # by workload/drafter: accepted, proposed
    names = list(engines)
    for r in range(args.rounds):
        prompts = {
            "rewrite": [
                rewrite_prompt(texts[r * PER_ROUND + i], r + 1, i) for i in range(PER_ROUND)
            ],
            "A": workload_a.prompts(seed=r + 1)[:PER_ROUND],
        }
        order = names[r % len(names) :] + names[: r % len(names)]
        for workload, batch in prompts.items():
            for who in order:
                llm = engines[who]
                before = llm.engine.stats().spec_decode
                counts = (before.accepted_tokens, before.draft_tokens)
                speeds, tpots = [], []
                for prompt in batch:
                    speed, tpot = serve(llm, prompt)
                    speeds.append(speed)
                    tpots.append(tpot)
                results.setdefault(f"{workload}/{who}/tok_s", []).append(statistics.mean(speeds))
                results.setdefault(f"{workload}/{who}/tpot", []).append(statistics.mean(tpots))
                after = llm.engine.stats().spec_decode
                total = accepted.setdefault(f"{workload}/{who}", [0, 0])
                total[0] += after.accepted_tokens - counts[0]
                total[1] += after.draft_tokens - counts[1]
        print(f"round {r + 1}/{args.rounds} done", flush=True)

    print()
    verdicts = []
    for workload, floor in (("rewrite", REWRITE_FLOOR), ("A", A_FLOOR)):
        for who in names:
            print(
                summary(f"{workload}, {who}, output", results[f"{workload}/{who}/tok_s"], "tok/s")
            )
            print(summary(f"{workload}, {who}, TPOT", results[f"{workload}/{who}/tpot"], "ms", 1e3))
        for who in args.drafters:
            ratio = statistics.median(results[f"{workload}/{who}/tok_s"]) / statistics.median(
                results[f"{workload}/plain/tok_s"]
            )
            tpot = statistics.median(results[f"{workload}/{who}/tpot"]) / statistics.median(
                results[f"{workload}/plain/tpot"]
            )
            got, proposed = accepted[f"{workload}/{who}"]
            rate = f"{got / proposed:.0%} of {proposed} draft tokens" if proposed else "no drafts"
            ok = ratio >= floor
            verdicts.append(ok)
            print(
                f"{workload}: {who} / plain output tok/s {ratio:.3f}x (target >= {floor}x) "
                f"{'met' if ok else 'MISSED'}; TPOT {tpot:.3f}x; accepted {rate}"
            )
        print()
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
