"""``ladle bench throughput``: our engine against transformers and the machine's GEMM ceiling.

All three run the same requests in one invocation:

* the **ceiling probe** times only the model's linear layers (fused QKV, O, fused gate/up, down,
  and the LM head where logits are needed) as plain GEMMs over the workload's work: every
  prompt token in chunks of the engine's token budget, then one full-batch decode step per
  generated position. No engine built on torch's GEMMs can beat it;
* **ours**: ``LLM.generate`` over all requests at once;
* **transformers**: its own continuous batching, ``generate_batch``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import torch

from ladle.runtime.bench.profile import profile_decode
from ladle.runtime.bench.workloads import WORKLOADS, Workload
from ladle.runtime.llm import LLM
from ladle.runtime.models.llama import LlamaModel
from ladle.runtime.sampling_params import SamplingParams


@dataclass
class Result:
    workload: str
    system: str
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
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    return seconds


def run_transformers(path: str, prompts: list[list[int]], output_len: int, budget: int) -> float:
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = GenerationConfig(
        max_new_tokens=output_len, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    cb = ContinuousBatchingConfig(max_batch_tokens=budget)
    started = time.perf_counter()
    outs = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
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
    path = str(llm.engine.model_path)
    budget = args.max_num_batched_tokens
    results: list[Result] = []
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    for name in names:
        workload: Workload = WORKLOADS[name]
        prompts = [list(tokenizer.encode(p)) for p in workload.prompts(args.seed)]
        lens = [len(p) for p in prompts]
        out_tokens = workload.num_requests * workload.output_len
        print(
            f"workload {name}: {len(prompts)} requests, prompt tokens {min(lens)}-{max(lens)} "
            f"(total {sum(lens)}), {workload.output_len} new tokens each",
            flush=True,
        )
        timings = {
            "ceiling": ceiling_probe(llm.engine.model, lens, workload.output_len, budget),
            "ladle": run_ours(llm, prompts, workload.output_len),
        }
        if not args.skip_transformers:
            timings["transformers"] = run_transformers(path, prompts, workload.output_len, budget)
        for system, seconds in timings.items():
            result = Result(name, system, seconds, out_tokens)
            results.append(result)
            print(
                f"  {system:<13} {seconds:8.1f} s  {result.tok_per_s:7.1f} output tok/s", flush=True
            )
    _summary(results)
    if args.profile:
        workload = WORKLOADS[names[0]]
        prompts = [list(tokenizer.encode(p)) for p in workload.prompts(args.seed)]
        print("\n" + profile_decode(llm, prompts).table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**asdict(r), "tok_per_s": r.tok_per_s} for r in results], f, indent=2)
    return results


def _summary(results: list[Result]) -> None:
    print("\nworkload  ceiling  ladle  transformers  ladle/transformers  ladle/ceiling")
    for name in dict.fromkeys(r.workload for r in results):
        by = {r.system: r.tok_per_s for r in results if r.workload == name}
        hf = by.get("transformers")
        print(
            f"{name:<9} {by['ceiling']:7.1f} {by['ladle']:6.1f} "
            f"{hf if hf is not None else float('nan'):13.1f} "
            f"{by['ladle'] / hf if hf else float('nan'):19.2f}x {by['ladle'] / by['ceiling']:13.0%}"
        )
