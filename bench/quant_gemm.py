#!/usr/bin/env python3
"""Quantized products on the CPU at prefill sizes: our tiles against the weight dequantized once
per product and multiplied with torch's GEMM, with fp32's GEMM as the ceiling. Measured in one
run, interleaved.

``cpu_kernels.linear`` takes the second path from ``DEQUANTIZE_ROWS`` rows on; this prints,
for the default model's projections and each weight format, the median time of each path per
row count (spread: min-max over rounds, the path order rotating each round), and which path
is faster, to check that threshold on the machine at hand. Then whole requests on the int4
default model, both ways (fresh prompts, no prefix cache): a 512-token prompt's first token,
and the canary analysis's scoring requests (prompt logprobs over every position, then a short
greedy continuation), what a quantized canary's evaluation and a draft model's prompts pay.

    .venv/bin/python bench/quant_gemm.py              # about two minutes, 2 cores
    .venv/bin/python bench/quant_gemm.py --rounds 3   # a quick look
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from ladle.runtime.kernels import cpu_kernels  # noqa: E402
from ladle.runtime.quantization.formats import quantize_groups, quantize_int8  # noqa: E402

# SmolLM2-135M's projections (N, K): attention's q/o, MLP gate/up and down.
SHAPES = {"q/o 576x576": (576, 576), "gate/up 1536x576": (1536, 576), "down 576x1536": (576, 1536)}
ROWS = (16, 64, 128, 256, 512)
TILES = 1 << 30  # a DEQUANTIZE_ROWS no product reaches: always the tiles


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def products(rounds: int, repeats: int) -> None:
    lib = cpu_kernels.load()
    assert lib is not None, "the CPU kernels did not build"
    torch.manual_seed(0)
    default = cpu_kernels.DEQUANTIZE_ROWS
    print(f"threads {torch.get_num_threads()}, ISA {cpu_kernels.isa(lib)}, "
          f"DEQUANTIZE_ROWS {default}")  # fmt: skip
    print(f"{'shape':<18} {'format':<9} {'rows':>5} {'tiles ms':>16} {'dequant+GEMM ms':>18} "
          f"{'fp32 GEMM ms':>14}  faster")  # fmt: skip
    for label, (n, k) in SHAPES.items():
        w = torch.randn(n, k)
        formats = {
            "int8": quantize_int8(w),
            "int8-g32": quantize_groups(w, 32, bits=8),
            "int4-g32": quantize_groups(w, 32),
        }
        for name, q in formats.items():
            for rows in ROWS:
                x = torch.randn(rows, k)

                def tiles(x: torch.Tensor = x, q: object = q) -> object:
                    cpu_kernels.DEQUANTIZE_ROWS = TILES
                    return cpu_kernels.linear(lib, x, q, None)  # type: ignore[arg-type]

                def dequant(x: torch.Tensor = x, q: object = q) -> object:
                    cpu_kernels.DEQUANTIZE_ROWS = 0
                    return cpu_kernels.linear(lib, x, q, None)  # type: ignore[arg-type]

                def dense(x: torch.Tensor = x, wt: torch.Tensor = w.T) -> object:
                    return x @ wt

                paths = [tiles, dequant, dense]
                times: dict[str, list[float]] = {p.__name__: [] for p in paths}
                for r in range(rounds):
                    for p in paths[r % 3 :] + paths[: r % 3]:
                        times[p.__name__].append(median_ms(p, repeats))
                cpu_kernels.DEQUANTIZE_ROWS = default
                cells = [
                    f"{statistics.median(v):7.3f} ({min(v):.2f}-{max(v):.2f})"
                    for v in times.values()
                ]
                ratio = statistics.median(times["tiles"]) / statistics.median(times["dequant"])
                faster = f"dequant {ratio:.2f}x" if ratio > 1 else f"tiles {1 / ratio:.2f}x"
                print(f"{label:<18} {name:<9} {rows:>5} {cells[0]:>16} {cells[1]:>18} "
                      f"{cells[2]:>14}  {faster}")  # fmt: skip


def prefill(rounds: int) -> None:
    """Whole requests on the int4 default model, both ways, fresh prompts every run."""
    from ladle.runtime import LLM, SamplingParams

    llm = LLM(None, quantization="int4", enable_prefix_caching=False, kv_cache_memory="256Mi")
    vocab = llm.engine.tokenizer.vocab_size
    workloads = {
        "one 512-token prompt, first token": (1, 512, SamplingParams(max_tokens=1)),
        # What the canary analysis asks (runtime/eval/online.py): top-20 prompt logprobs and a
        # 16-token greedy continuation per prompt.
        "4 scoring requests of 200 tokens": (
            4, 200, SamplingParams(max_tokens=16, temperature=0, prompt_logprobs=20)
        ),
    }  # fmt: skip
    default = cpu_kernels.DEQUANTIZE_ROWS
    gen = torch.Generator().manual_seed(1)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)
    for label, (count, length, params) in workloads.items():
        times: dict[str, list[float]] = {"tiles": [], "dequant": []}
        for r in range(rounds):
            for path in ("tiles", "dequant") if r % 2 == 0 else ("dequant", "tiles"):
                cpu_kernels.DEQUANTIZE_ROWS = TILES if path == "tiles" else default
                ids = torch.randint(100, vocab, (count, length), generator=gen).tolist()
                prompts = [{"prompt_token_ids": row} for row in ids]
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                times[path].append(time.perf_counter() - start)
        cpu_kernels.DEQUANTIZE_ROWS = default
        tiles, dequant = (statistics.median(times[p]) for p in ("tiles", "dequant"))
        cells = ", ".join(
            f"{path} {statistics.median(v):.3f} s ({min(v):.3f}-{max(v):.3f})"
            for path, v in times.items()
        )
        print(f"int4 default model, {label}: {cells}; dequant + GEMM {tiles / dequant:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per round")
    args = parser.parse_args()
    products(args.rounds, args.repeats)
    prefill(args.rounds)


if __name__ == "__main__":
    main()
