#!/usr/bin/env python3
"""Quantized products on the CPU at prefill sizes: our tiles against the weight dequantized once
per product and multiplied with torch's GEMM, with fp32's GEMM as the ceiling. Measured in one
run, interleaved.

``quant_ops.linear`` takes the second path from ``DEQUANTIZE_ROWS`` rows on; this prints,
for the default model's projections and each weight format, the median time of each path per
row count (spread: min-max over rounds, the path order rotating each round), and which path
is faster, to check that threshold on the machine at hand. Then whole requests on the int4
default model, both ways (fresh prompts, no prefix cache): a 512-token prompt's first token,
and the canary analysis's scoring requests (prompt logprobs over every position, then a short
greedy continuation), what a quantized canary's evaluation and a draft model's prompts pay.

Last, what a draft model's decode pays where the CPU has VNNI: its int4 GEMVs with weight-only
fp32 activations against int8 activations (``kernels/a8_kernels.c``) at 1, 4 and 8 rows, and
the int4 default model's batch-1 TPOT both ways (the drafter's own decode step), in turns.

    .venv/bin/python bench/quant_gemm.py              # about three minutes, 2 cores
    .venv/bin/python bench/quant_gemm.py --rounds 3   # a quick look
    .venv/bin/python bench/quant_gemm.py --sections drafting
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

from ladle.runtime.kernels import cpu_kernels, quant_ops  # noqa: E402
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
    default = quant_ops.DEQUANTIZE_ROWS
    print(f"threads {torch.get_num_threads()}, ISA {quant_ops.isa(lib)}, "
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
                    quant_ops.DEQUANTIZE_ROWS = TILES
                    return quant_ops.linear(lib, x, q, None)  # type: ignore[arg-type]

                def dequant(x: torch.Tensor = x, q: object = q) -> object:
                    quant_ops.DEQUANTIZE_ROWS = 0
                    return quant_ops.linear(lib, x, q, None)  # type: ignore[arg-type]

                def dense(x: torch.Tensor = x, wt: torch.Tensor = w.T) -> object:
                    return x @ wt

                paths = [tiles, dequant, dense]
                times: dict[str, list[float]] = {p.__name__: [] for p in paths}
                for r in range(rounds):
                    for p in paths[r % 3 :] + paths[: r % 3]:
                        times[p.__name__].append(median_ms(p, repeats))
                quant_ops.DEQUANTIZE_ROWS = default
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
    default = quant_ops.DEQUANTIZE_ROWS
    gen = torch.Generator().manual_seed(1)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)
    for label, (count, length, params) in workloads.items():
        times: dict[str, list[float]] = {"tiles": [], "dequant": []}
        for r in range(rounds):
            for path in ("tiles", "dequant") if r % 2 == 0 else ("dequant", "tiles"):
                quant_ops.DEQUANTIZE_ROWS = TILES if path == "tiles" else default
                ids = torch.randint(100, vocab, (count, length), generator=gen).tolist()
                prompts = [{"prompt_token_ids": row} for row in ids]
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                times[path].append(time.perf_counter() - start)
        quant_ops.DEQUANTIZE_ROWS = default
        tiles, dequant = (statistics.median(times[p]) for p in ("tiles", "dequant"))
        cells = ", ".join(
            f"{path} {statistics.median(v):.3f} s ({min(v):.3f}-{max(v):.3f})"
            for path, v in times.items()
        )
        print(f"int4 default model, {label}: {cells}; dequant + GEMM {tiles / dequant:.2f}x")


def spread(label: str, values: list[float], unit: str) -> str:
    return f"{label} {statistics.median(values):.3f} {unit} ({min(values):.3f}-{max(values):.3f})"


def drafting(rounds: int, repeats: int) -> None:
    """A draft model's decode: int4 GEMVs and whole steps, weight-only against int8
    activations."""
    import dataclasses

    from harness import time_alone

    from ladle.runtime import LLM, SamplingParams
    from ladle.runtime.kernels import decode_step
    from ladle.runtime.quantization.apply import int8_activations
    from ladle.runtime.quantization.formats import GroupWeight, pack_a8
    from ladle.runtime.quantization.linear import QuantizedLinear

    lib = cpu_kernels.load()
    assert lib is not None, "the CPU kernels did not build"
    if not quant_ops.a8_supported(lib):
        print("drafting: this CPU has no AVX-512 VNNI; drafts use the weight-only GEMV")
        return
    for label, (n, k) in SHAPES.items():
        plain = quantize_groups(torch.randn(n, k), 32)
        a8 = dataclasses.replace(plain, a8=pack_a8(plain))
        for rows in (1, 4, 8):
            x = torch.randn(rows, k)
            times: dict[str, list[float]] = {"weight-only": [], "int8 activations": []}
            for r in range(rounds):
                order = [("weight-only", plain), ("int8 activations", a8)]
                for name, q in order if r % 2 == 0 else order[::-1]:

                    def product(q: GroupWeight = q, x: torch.Tensor = x) -> object:
                        return quant_ops.linear(lib, x, q, None)

                    times[name].append(median_ms(product, repeats))
            ratio = statistics.median(times["weight-only"]) / statistics.median(
                times["int8 activations"]
            )
            cells = ", ".join(spread(name, v, "ms") for name, v in times.items())
            print(f"draft GEMV {label}, {rows} rows: {cells}; int8 activations {ratio:.2f}x")

    llm = LLM(None, quantization="int4", enable_prefix_caching=False, kv_cache_memory="256Mi")
    engine = llm.engine
    forward = engine.runner.forward
    model = engine.model
    assert int8_activations(model), "the int4 default model's projections take int8 codes"
    linears = [
        linear
        for layer in model.layers
        for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
        if isinstance(linear, QuantizedLinear)
    ]
    coded = [linear.weight for linear in linears]

    def use(codes: bool) -> None:
        for linear, weight in zip(linears, coded, strict=True):
            assert isinstance(weight, GroupWeight)
            linear.weight = weight if codes else dataclasses.replace(weight, a8=None)
        forward.fused = decode_step.for_model(model, forward.caches)

    vocab = engine.tokenizer.vocab_size
    gen = torch.Generator().manual_seed(2)
    params = SamplingParams(max_tokens=65, temperature=0.0, ignore_eos=True)
    tpot: dict[str, list[float]] = {"weight-only": [], "int8 activations": []}
    for r in range(rounds):
        turns = [("weight-only", False), ("int8 activations", True)]
        for name, codes in turns if r % 2 == 0 else turns[::-1]:
            use(codes)
            prompt = {"prompt_token_ids": torch.randint(100, vocab, (64,), generator=gen).tolist()}
            tpot[name].append(time_alone(engine, prompt, params)[1] * 1e3)
    ratio = statistics.median(tpot["weight-only"]) / statistics.median(tpot["int8 activations"])
    cells = ", ".join(spread(name, v, "ms") for name, v in tpot.items())
    print(f"int4 default model, batch-1 TPOT (64 in, 65 out): {cells}; int8 activations "
          f"{ratio:.2f}x faster")  # fmt: skip


SECTIONS = ("products", "prefill", "drafting")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per round")
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    args = parser.parse_args()
    if "products" in args.sections:
        products(args.rounds, args.repeats)
    if "prefill" in args.sections:
        prefill(args.rounds)
    if "drafting" in args.sections:
        drafting(args.rounds, args.repeats)


if __name__ == "__main__":
    main()
