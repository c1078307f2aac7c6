"""``ladle bench throughput``: our engine against transformers and the machine's GEMM ceiling.

All three run the same requests in one invocation:

* the **ceiling probe** times only the model's linear layers (fused QKV, O, fused gate/up, down,
  and the LM head where logits are needed) as plain GEMMs over the workload's work: every
  prompt token in chunks of the engine's token budget, then one full-batch decode step per
  generated position. No engine built on torch's GEMMs can beat it;
* **ours**: ``LLM.generate`` over all requests at once;
* **transformers**: its own continuous batching, ``generate_batch``.

Equal work, measured fairly: the workloads draw distinct prompts; every system is warmed up on
other prompts first; our prefix cache is emptied before every timed run (nothing is served
from a warm-up, another workload or an earlier round); and the systems run interleaved for
``--repeats`` rounds, ours between the two baselines, their order flipped every round. The
VM's speed drifts from minute to minute, so each ratio is taken within a round and reported
as the median over rounds with its spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ladle.runtime.bench.profile import profile_decode
from ladle.runtime.bench.workloads import WORKLOADS, Workload
from ladle.runtime.llm import LLM
from ladle.runtime.models.llama import LlamaModel
from ladle.runtime.sampling_params import SamplingParams
from ladle.words import plural

# Warm-up requests: not from any workload, so no timed run finds them cached.
_WARMUP = Workload("warm-up", num_requests=4, min_words=8, max_words=40, output_len=4)


@dataclass
class Result:
    workload: str
    system: str
    round: int
    seconds: float
    output_tokens: int

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.seconds


def _linears(model: LlamaModel, rows: int) -> None:
    """One forward's worth of projection GEMMs for ``rows`` tokens (no LM head)."""
    cfg = model.config
    x = torch.randn(rows, cfg.hidden_size, dtype=model.dtype)
    attn = torch.randn(rows, cfg.q_size, dtype=model.dtype)
    act = torch.randn(rows, cfg.intermediate_size, dtype=model.dtype)
    for layer in model.layers:
        layer.qkv(x)
        layer.o_proj(attn)
        layer.gate_up(x)
        layer.down(act)


@torch.inference_mode()
def ceiling_probe(model: LlamaModel, prompt_lens: list[int], output_len: int, budget: int) -> float:
    """Seconds that the linear layers alone need for this workload."""
    hidden = model.config.hidden_size
    started = time.perf_counter()
    # Prefill: the prompts back to back, cut into chunks of the engine's token budget.
    ends, total = set(), 0
    for n in prompt_lens:
        total += n
        ends.add(total)
    for start in range(0, total, budget):
        rows = min(budget, total - start)
        _linears(model, rows)
        finishing = sum(1 for e in ends if start < e <= start + rows)
        model.lm_head(torch.randn(finishing, hidden, dtype=model.dtype))
    # Decode: the first token came from prefill; each later one is a full-batch step.
    batch = torch.randn(len(prompt_lens), hidden, dtype=model.dtype)
    for _ in range(output_len - 1):
        _linears(model, len(prompt_lens))
        model.lm_head(batch)
    return time.perf_counter() - started


def run_ours(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    """One timed ``LLM.generate``, from an empty prefix cache."""
    llm.engine.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    return seconds


class Transformers:
    """transformers' continuous batching on the same weights, loaded once (untimed)."""

    def __init__(self, path: str, budget: int) -> None:
        from transformers import AutoModelForCausalLM, ContinuousBatchingConfig

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.config = ContinuousBatchingConfig(max_batch_tokens=budget)

    def run(self, prompts: list[list[int]], output_len: int) -> float:
        from transformers import GenerationConfig

        gen = GenerationConfig(
            max_new_tokens=output_len, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        started = time.perf_counter()
        outs = self.model.generate_batch(
            prompts, generation_config=gen, continuous_batching_config=self.config
        )
        seconds = time.perf_counter() - started
        assert all(len(o.generated_tokens) == output_len for o in outs.values())
        return seconds


def bench(args: argparse.Namespace) -> list[Result]:
    llm = LLM(
        args.model,
        max_num_seqs=max(w.num_requests for w in WORKLOADS.values()),
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
        quantization=args.quantization,
        quantization_method=args.quantization_method,
        quantization_group_size=args.quantization_group_size,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    tokenizer = llm.get_tokenizer()
    budget = args.max_num_batched_tokens
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    work: dict[str, tuple[Workload, list[list[int]]]] = {}
    for name in names:
        workload = WORKLOADS[name]
        prompts = [list(tokenizer.encode(p)) for p in workload.prompts(args.seed)]
        lens = [len(p) for p in prompts]
        work[name] = (workload, prompts)
        print(
            f"workload {name}: {plural(len(prompts), 'request')}, "
            f"prompt tokens {min(lens)}-{max(lens)} "
            f"(total {sum(lens)}), {workload.output_len} new tokens each",
            flush=True,
        )
    hf = None if args.skip_transformers else Transformers(str(llm.engine.model_path), budget)
    systems: dict[str, Callable[[list[list[int]], int], float]] = {
        "ceiling": lambda p, n: ceiling_probe(llm.engine.model, [len(x) for x in p], n, budget),
        "ladle": lambda p, n: run_ours(llm, p, n),
    }
    if hf is not None:
        systems["transformers"] = hf.run
    warmup = [list(tokenizer.encode(p)) for p in _WARMUP.prompts(args.seed)]
    for run in systems.values():
        run(warmup, _WARMUP.output_len)

    results: list[Result] = []
    for round_ in range(args.repeats):
        # Ours runs between the baselines, adjacent to both; their order flips every round
        # so that neither always meets the VM's slower minutes.
        order = list(systems) if round_ % 2 == 0 else list(systems)[::-1]
        for name, (workload, prompts) in work.items():
            for system in order:
                seconds = systems[system](prompts, workload.output_len)
                result = Result(
                    name, system, round_, seconds, workload.num_requests * workload.output_len
                )
                results.append(result)
                print(
                    f"  round {round_ + 1}/{args.repeats}  {name}  {system:<13} {seconds:8.1f} s"
                    f"  {result.tok_per_s:7.1f} output tok/s",
                    flush=True,
                )
    summary = summarize(results)
    print("\n" + format_summary(summary))
    if args.profile:
        _, prompts = work[names[0]]
        llm.engine.reset_prefix_cache()
        print("\n" + profile_decode(llm, prompts).table())
    if args.json:
        with open(args.json, "w") as f:
            runs = [{**asdict(r), "tok_per_s": r.tok_per_s} for r in results]
            json.dump({"runs": runs, "summary": summary}, f, indent=2)
    return results


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(results: list[Result]) -> dict[str, Any]:
    """Per workload: each system's tok/s, and the ratios taken within each round, as median,
    min and max over the rounds."""
    summary: dict[str, Any] = {}
    for name in dict.fromkeys(r.workload for r in results):
        mine = [r for r in results if r.workload == name]
        rounds = sorted({r.round for r in mine})
        by = {(r.system, r.round): r.tok_per_s for r in mine}
        systems = list(dict.fromkeys(r.system for r in mine))
        entry: dict[str, Any] = {
            s: _spread([by[s, i] for i in rounds if (s, i) in by]) for s in systems
        }
        for base in ("ceiling", "transformers"):
            if base in systems:
                entry[f"ladle/{base}"] = _spread([by["ladle", i] / by[base, i] for i in rounds])
        summary[name] = entry
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    def cell(s: dict[str, float], fmt: str) -> str:
        return f"{s['median']:{fmt}} [{s['min']:{fmt}}-{s['max']:{fmt}}]"

    lines = ["median [min-max] over rounds; ratios are taken within each round"]
    for name, entry in summary.items():
        lines.append(f"workload {name}")
        for key, value in entry.items():
            fmt = ".0%" if key == "ladle/ceiling" else ".2f" if "/" in key else ".1f"
            unit = "" if "/" in key else " tok/s"
            lines.append(f"  {key:<20} {cell(value, fmt)}{unit}")
    return "\n".join(lines)
