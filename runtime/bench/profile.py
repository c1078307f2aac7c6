"""Where a decode step's time goes: GEMMs, attention, sampling, other kernels, Python.

Runs a full batch of decodes under ``torch.profiler`` and sorts operator self-time into
buckets. The sampler, our C kernels and the fused CPU decode step are timed by wrapping them
for the duration of the profile, so the engine's own code carries no instrumentation.
:func:`latency_profile` compares a batch-1 step with the fused step and op by op, in one
process, interleaved, and sets the step against the machine's copy bandwidth.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from ladle.runtime.kernels import cpu_kernels, quant_ops
from ladle.runtime.llm import LLM
from ladle.runtime.sampling_params import SamplingParams
from ladle.words import plural

_GEMM = ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul")
_ATTENTION = ("scaled_dot_product", "aten::index_select", "aten::index_copy", "aten::bmm")
# Our C kernels (ctypes calls, invisible to torch.profiler): the module that wraps each, and
# the bucket it belongs to.
_C_KERNELS: dict[str, tuple[ModuleType, str]] = {
    "linear": (quant_ops, "gemm"),
    "paged_decode_attention": (cpu_kernels, "attention"),
    "paged_decode_attention_int8": (quant_ops, "attention"),
    "store_kv": (cpu_kernels, "attention"),
    "store_kv_int8": (quant_ops, "attention"),
    "rms_norm": (cpu_kernels, "other"),
    "rope_": (cpu_kernels, "other"),
    "silu_and_mul": (cpu_kernels, "other"),
}


@dataclass
class DecodeProfile:
    batch: int
    steps: int
    wall: float
    gemm: float
    attention: float
    sampling: float
    other_ops: float
    fused: float = 0.0

    @property
    def python(self) -> float:
        spent = self.gemm + self.attention + self.sampling + self.other_ops + self.fused
        return max(self.wall - spent, 0.0)

    def table(self) -> str:
        rows = [
            ("fused decode step (one C call)", self.fused),
            ("GEMMs (projections, LM head)", self.gemm),
            ("attention (kernel or SDPA, KV store)", self.attention),
            ("sampling", self.sampling),
            ("other kernels (norms, RoPE, SiLU)", self.other_ops),
            ("Python and scheduling", self.python),
        ]
        per_step = 1e3 / self.steps
        lines = [
            f"decode profile: batch {self.batch}, {plural(self.steps, 'step')}, "
            f"{self.wall * per_step:.1f} ms/step"
        ]
        lines += [f"  {name:<36} {t * per_step:7.1f} ms  {t / self.wall:6.1%}" for name, t in rows]
        return "\n".join(lines)


def start_decoding(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """Admit the prompts and step until every one of them decodes; their request ids."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"profile-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()
    engine.step()  # warm the decode path
    return ids


def profile_decode(llm: LLM, prompts: list[list[int]], steps: int = 8) -> DecodeProfile:
    engine = llm.engine
    ids = start_decoding(llm, prompts, steps + 4)
    prof, wall, timers = _profiled_steps(llm, steps)
    engine.abort_request(ids)
    return _buckets(prof, wall, timers, len(prompts), steps)


def _profiled_steps(llm: LLM, steps: int) -> tuple[Any, float, dict[str, _Timed]]:
    engine = llm.engine
    runner = engine.runner
    sampler, fused = runner.sampler, runner.forward.fused
    timers = {name: _Timed(getattr(module, name)) for name, (module, _) in _C_KERNELS.items()}
    timers["sampler"] = _Timed(sampler)
    runner.sampler = timers["sampler"]  # type: ignore[assignment]
    if fused is not None:
        timers["fused"] = _Timed(fused.run)
        fused.run = timers["fused"]  # type: ignore[method-assign]
    for name, (module, _) in _C_KERNELS.items():
        setattr(module, name, timers[name])
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            started = time.perf_counter()
            for _ in range(steps):
                engine.step()
            wall = time.perf_counter() - started
    finally:
        runner.sampler = sampler
        if fused is not None:
            del fused.run  # the method again
        for name, (module, _) in _C_KERNELS.items():
            setattr(module, name, timers[name].wrapped)
    return prof, wall, timers


def _buckets(
    prof: Any, wall: float, timers: dict[str, _Timed], batch: int, steps: int
) -> DecodeProfile:
    gemm = attention = other = 0.0
    for event in prof.key_averages():
        seconds = event.self_cpu_time_total / 1e6
        if event.key.startswith(_GEMM):
            gemm += seconds
        elif any(tag in event.key for tag in _ATTENTION):
            attention += seconds
        elif event.key.startswith("aten::"):
            other += seconds
    for name, (_, bucket) in _C_KERNELS.items():
        if bucket == "gemm":
            gemm += timers[name].seconds
        elif bucket == "attention":
            attention += timers[name].seconds
        else:
            other += timers[name].seconds
    sampling = timers["sampler"].seconds
    fused = timers["fused"].seconds if "fused" in timers else 0.0
    # The sampler's own kernels landed in "other"; count them once, as sampling.
    return DecodeProfile(
        batch, steps, wall, gemm, attention, sampling, max(other - sampling, 0.0), fused
    )


def copy_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """The machine's memory bandwidth as torch's copy sees it: GB/s read plus written, best of
    ``repeats``."""
    src = torch.ones(megabytes * 2**18)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    return 2 * src.nbytes / best / 1e9


def latency_profile(
    llm: LLM, prompt: list[int], steps: int = 32, rounds: int = 5, copy_megabytes: int = 512
) -> str:
    """A batch-1 decode step with the fused CPU step ("after") and op by op ("before"): step
    times interleaved in one process (median and spread over ``rounds`` blocks of ``steps``
    steps each), a profile of each, and the weight bytes read per step against the machine's
    copy bandwidth."""
    engine = llm.engine
    runner = engine.runner
    fused = runner.forward.fused
    modes = {"op by op (before)": None, "fused step (after)": fused}
    if fused is None:
        modes = {"op by op (engine default here)": None}
    total = (rounds + 1) * steps * len(modes) + 8
    ids = start_decoding(llm, [prompt], total)
    times: dict[str, list[float]] = {name: [] for name in modes}
    try:
        for round_ in range(rounds):
            order = list(modes) if round_ % 2 == 0 else list(modes)[::-1]
            for name in order:
                runner.forward.fused = modes[name]
                started = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                times[name].append((time.perf_counter() - started) / steps)
        profiles = {}
        for name, mode in modes.items():
            runner.forward.fused = mode
            prof, wall, timers = _profiled_steps(llm, steps)
            profiles[name] = _buckets(prof, wall, timers, 1, steps)
    finally:
        runner.forward.fused = fused
        engine.abort_request(ids)
    weights = engine.model.weight_bytes()
    bandwidth = copy_bandwidth(copy_megabytes)
    lines = [
        f"batch-1 decode step, {torch.get_num_threads()} threads, "
        f"{weights / 1e6:.0f} MB of weights read per step; copy bandwidth {bandwidth:.1f} GB/s",
        "step time, median [min-max] over rounds; weights / step time as GB/s and as a "
        "fraction of the copy bandwidth:",
    ]
    for name, values in times.items():
        median = statistics.median(values)
        lines.append(
            f"  {name:<32} {median * 1e3:7.2f} ms [{min(values) * 1e3:.2f}-"
            f"{max(values) * 1e3:.2f}]  {weights / median / 1e9:6.1f} GB/s "
            f"({weights / median / 1e9 / bandwidth:.0%})"
        )
    for name, prof in profiles.items():
        lines += ["", f"{name}:", prof.table()]
    return "\n".join(lines)


class _Timed:
    """Delegates to a callable (the sampler, a C kernel) and adds up the time spent in it."""

    def __init__(self, wrapped: Callable[..., Any]) -> None:
        self.wrapped = wrapped
        self.seconds = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return self.wrapped(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)
