"""Where a decode step's time goes: GEMMs, attention, sampling, other kernels, Python.

Runs a full batch of decodes under ``torch.profiler`` and sorts operator self-time into
buckets. The sampler and our C kernels are timed by wrapping them for the duration of the
profile, so the engine's own code carries no instrumentation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.profiler import ProfilerActivity, profile

from ladle.runtime.kernels import cpu_kernels
from ladle.runtime.llm import LLM
from ladle.runtime.sampling_params import SamplingParams

_GEMM = ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul")
_ATTENTION = ("scaled_dot_product", "aten::index_select", "aten::index_copy", "aten::bmm")
# Our C kernels (ctypes calls, invisible to torch.profiler) and the bucket each belongs to.
_C_KERNELS = {
    "linear": "gemm",
    "paged_decode_attention": "attention",
    "paged_decode_attention_int8": "attention",
    "store_kv": "attention",
    "store_kv_int8": "attention",
    "rms_norm": "other",
    "rope_": "other",
    "silu_and_mul": "other",
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

    @property
    def python(self) -> float:
        return max(self.wall - self.gemm - self.attention - self.sampling - self.other_ops, 0.0)

    def table(self) -> str:
        rows = [
            ("GEMMs (projections, LM head)", self.gemm),
            ("attention (kernel or SDPA, KV store)", self.attention),
            ("sampling", self.sampling),
            ("other kernels (norms, RoPE, SiLU)", self.other_ops),
            ("Python and scheduling", self.python),
        ]
        per_step = 1e3 / self.steps
        lines = [
            f"decode profile: batch {self.batch}, {self.steps} steps, "
            f"{self.wall * per_step:.1f} ms/step"
        ]
        lines += [f"  {name:<36} {t * per_step:7.1f} ms  {t / self.wall:6.1%}" for name, t in rows]
        return "\n".join(lines)


def profile_decode(llm: LLM, prompts: list[list[int]], steps: int = 8) -> DecodeProfile:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"profile-{i}", ids, params)
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()
    engine.step()  # warm the decode path
    sampler = engine.runner.sampler
    timed_sampler = _Timed(sampler)
    kernels = {name: _Timed(getattr(cpu_kernels, name)) for name in _C_KERNELS}
    engine.runner.sampler = timed_sampler  # type: ignore[assignment]
    for name, timed in kernels.items():
        setattr(cpu_kernels, name, timed)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            started = time.perf_counter()
            for _ in range(steps):
                engine.step()
            wall = time.perf_counter() - started
    finally:
        engine.runner.sampler = sampler
        for name, timed in kernels.items():
            setattr(cpu_kernels, name, timed.wrapped)
    engine.abort_request([f"profile-{i}" for i in range(len(prompts))])
    gemm = attention = other = 0.0
    for event in prof.key_averages():
        seconds = event.self_cpu_time_total / 1e6
        if event.key.startswith(_GEMM):
            gemm += seconds
        elif any(tag in event.key for tag in _ATTENTION):
            attention += seconds
        elif event.key.startswith("aten::"):
            other += seconds
    for name, timed in kernels.items():
        bucket = _C_KERNELS[name]
        if bucket == "gemm":
            gemm += timed.seconds
        elif bucket == "attention":
            attention += timed.seconds
        else:
            other += timed.seconds
    # The sampler's own kernels landed in "other"; count them once, as sampling.
    return DecodeProfile(
        len(prompts),
        steps,
        wall,
        gemm,
        attention,
        timed_sampler.seconds,
        max(other - timed_sampler.seconds, 0.0),
    )


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
