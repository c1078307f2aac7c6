#!/usr/bin/env python3
"""The quality table of docs/quantization.md: every quantized variant against fp32.

Each row is what ``ladle eval`` prints for that variant (the same library function, with the
reference model loaded once): offline, full-vocabulary KLD over our default prompt set, on the
default model. The numbers do not depend on timing, so any machine reproduces them (up to
float summation order across instruction sets)::

    .venv/bin/python bench/quality.py --json docs/quality.json   # ~5 minutes per row on 2 cores

One row by hand: ``ladle eval --quantization int4 --quantization-method rtn``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))


# (row label, engine flags, the field's gate it is held to)
def _int4(method: str, group: int) -> tuple[str, dict[str, Any], str]:
    flags = {"quantization": "int4", "quantization_method": method}
    return (f"int4 g{group} {method.upper()}", {**flags, "quantization_group_size": group}, "int4")


def _int8(method: str, group: int | None = None) -> tuple[str, dict[str, Any], str]:
    flags = {"quantization": "int8", "quantization_method": method}
    if group is None:
        return (f"int8 {method.upper()}", flags, "int8")
    return (f"int8 g{group} {method.upper()}", {**flags, "quantization_group_size": group}, "int8")


ROWS: list[tuple[str, dict[str, Any], str]] = [
    *(_int8(method) for method in ("rtn", "awq", "gptq", "awq-gptq")),
    *(_int8(method, 32) for method in ("rtn", "awq")),
    *(_int4(method, group) for group in (32, 64, 128) for method in ("rtn", "awq")),
    *(_int4("awq-gptq", group) for group in (64, 128)),
    ("fp16 KV cache", {"kv_cache_dtype": "float16"}, "int8"),
    ("int8 KV cache", {"kv_cache_dtype": "int8"}, "int8"),
    ("int8 AWQ + int8 KV", {"quantization": "int8", "kv_cache_dtype": "int8"}, "int8"),
    (
        "int8 g32 AWQ + int8 KV",
        {"quantization": "int8", "quantization_group_size": 32, "kv_cache_dtype": "int8"},
        "int8",
    ),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", help="only the rows whose label starts so")
    parser.add_argument("--json", type=Path, help="write (and resume from) this file")
    args = parser.parse_args()
    from ladle.runtime import LLM
    from ladle.runtime.eval.metrics import GATES
    from ladle.runtime.eval.offline import evaluate_offline
    from ladle.runtime.eval.prompts import load_prompts

    prompts = load_prompts()
    done: dict[str, Any] = {}
    if args.json and args.json.is_file():
        done = json.loads(args.json.read_text())
    engine = {"kv_cache_memory": "512MiB"}
    reference = LLM(**engine)
    for label, flags, gate in ROWS:
        if args.rows and not any(label.startswith(r) for r in args.rows):
            continue
        if label in done:
            continue
        started = time.monotonic()
        result = evaluate_offline(reference, LLM(**engine, **flags), prompts)
        failures = GATES[gate].failures(result)
        done[label] = {"flags": flags, "gate": gate, "failures": failures, **result.to_dict()}
        print(f"{label}: {time.monotonic() - started:.0f} s\n{result.summary()}", flush=True)
        if args.json:
            args.json.write_text(json.dumps(done, indent=1) + "\n")
    ppl = next(iter(done.values()))["ppl_reference"]
    print(f"\n| variant | KLD | top-1 | PPL (fp32 {ppl:.2f}) | ΔPPL | greedy 16 | gate |")
    print("|---|---|---|---|---|---|---|")
    for label, r in done.items():
        verdict = "passes" if not r["failures"] else "misses: " + "; ".join(r["failures"])
        print(
            f"| {label} | {r['kld_mean']:.4f} | {r['top1_agreement']:.1%} | "
            f"{r['ppl_candidate']:.2f} | {r['ppl_delta']:+.1%} | {r['greedy_agreement']:.0%} | "
            f"{r['gate']}: {verdict} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
