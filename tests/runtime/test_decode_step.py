"""The fused CPU decode step (one C call per step) against the per-op forward pass.

Each decode step of a mixed batch (contexts of different lengths, some crossing a block
boundary, block size 4) runs both ways on the same inputs: hidden states must agree to
rounding, at every batch size from five rows down to one, for every architecture feature the
fused step handles (tied embeddings, QKV bias, per-head q/k norm with head_dim != hidden /
heads), both cache dtypes, int8 (per channel and in groups) and int4 weights (and a draft
model's int4 weights with int8 activations), LoRA adapters
mixed with the base model in one batch, and 1, 2 and 3 threads (more threads than this
machine's cores: the barrier's sleeping path).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_adapters import random_adapter

from ladle.runtime import LLM, LoRARequest, SamplingParams
from ladle.runtime.attention.backend import AttentionMetadata
from ladle.runtime.bench.profile import latency_profile
from ladle.runtime.forward_pass import Chunk, build_plan
from ladle.runtime.kernels import cpu_kernels, decode_step, quant_ops
from ladle.runtime.kernels.decode_step import CpuDecodeStep
from ladle.runtime.lora.batch import LoRABatch
from ladle.runtime.quantization.apply import int8_activations

# Eight, the fused step's most: the batch runs through every row count its GEMV specializes.
PROMPTS = [
    [5],
    [17, 300, 42],
    [9, 8, 7, 6],
    list(range(100, 109)),
    list(range(200, 217)),
    [11, 12],
    list(range(300, 305)),
    [400],
]
STEPS = 6


def _engine(path: Path, **flags: Any) -> LLM:
    return LLM(
        str(path),
        attention_backend="cpu",
        dtype="float32",
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        kv_cache_memory="1MiB",
        **flags,
    )


def _compare_decode_steps(
    llm: LLM, threads: list[int], adapters: list[LoRARequest | None] | None = None
) -> int:
    """Run the prompts to their decode phase, then compare every decode step both ways;
    returns how many steps were compared. ``adapters``: one per prompt."""
    engine = llm.engine
    fused = engine.runner.forward.fused
    assert isinstance(fused, CpuDecodeStep)
    for i, ids in enumerate(PROMPTS):
        # Each prompt runs two steps longer than the one before: the batch shrinks from all
        # eight rows (the GEMV's tiles of outputs) to one (its one output at a time).
        params = SamplingParams(max_tokens=STEPS + 2 * i, temperature=0.0, ignore_eos=True)
        engine.add_request(f"r{i}", ids, params, lora_request=adapters[i] if adapters else None)
    forward = engine.model.forward
    compared = 0
    # The engine takes an exception inside a step for a failing request and goes on: each
    # mismatch is kept here, so that it fails the test rather than one request.
    mismatches: list[str] = []

    def both(
        ids: torch.Tensor,
        positions: torch.Tensor,
        caches: Any,
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        nonlocal compared
        reference = forward(ids, positions, caches, meta, lora)
        if fused.can_run(meta):
            saved = torch.get_num_threads()
            torch.set_num_threads(threads[compared % len(threads)])
            try:
                hidden, logits = fused.run(ids, positions, meta, lora)
            finally:
                torch.set_num_threads(saved)
            try:
                torch.testing.assert_close(hidden, reference, rtol=1e-4, atol=1e-4)
                expected = engine.model.compute_logits(reference)
                torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-3)
            except AssertionError as exc:
                mismatches.append(str(exc))
                raise
            compared += 1
        return reference

    engine.runner.forward.fused = (
        None  # every step through `both`, which calls the fused step itself
    )
    engine.model.forward = both  # type: ignore[method-assign]
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.error is None, out.error
    finally:
        engine.model.forward = forward  # type: ignore[method-assign]
        engine.runner.forward.fused = fused
    assert not mismatches, mismatches[0]
    return compared


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float16", "int8"])
def test_fused_step_equals_per_op_forward(
    arch: str, kv_cache_dtype: str, tiny_model_factory: Callable[[str], Path]
) -> None:
    llm = _engine(tiny_model_factory(arch), kv_cache_dtype=kv_cache_dtype)
    assert _compare_decode_steps(llm, threads=[1, 2, 3]) >= STEPS


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_fused_step_with_adapters(
    quantization: str | None, tiny_model_factory: Callable[[str], Path], tmp_path: Path
) -> None:
    """Two adapters of different ranks and targets, and base-model rows, in every step, over
    a quantized base too (an adapter applies to the quantized projection's output)."""
    path = tiny_model_factory("qwen3")
    folders = [
        random_adapter(path, tmp_path / "all", seed=1),
        random_adapter(path, tmp_path / "qv", seed=2, rank=4, targets=("q_proj", "v_proj")),
    ]
    first, second = (LoRARequest(f.name, i + 1, str(f)) for i, f in enumerate(folders))
    flags: dict[str, Any] = {"enable_lora": True, "max_loras": 2}
    if quantization:
        flags |= {"quantization": quantization, "quantization_method": "rtn"}
    llm = _engine(path, **flags)
    adapters = [first, None, second, first, None, second, None, first]
    assert _compare_decode_steps(llm, threads=[1, 2, 3], adapters=adapters) >= STEPS


@pytest.mark.parametrize(("quantization", "group"), [("int8", None), ("int8", 32), ("int4", 32)])
def test_fused_step_with_quantized_weights(
    quantization: str, group: int | None, tiny_model_factory: Callable[[str], Path]
) -> None:
    llm = _engine(
        tiny_model_factory("qwen2"),
        quantization=quantization,
        quantization_method="rtn",
        quantization_group_size=group,
    )
    assert _compare_decode_steps(llm, threads=[2]) >= STEPS


def test_fused_step_with_int8_activations(tiny_model_factory: Callable[[str], Path]) -> None:
    """A draft model's int4 weights with int8-activation codes (where the CPU has VNNI): the
    fused step rounds the activations as the per-op path does, at every batch size."""
    llm = _engine(
        tiny_model_factory("qwen2"),
        quantization="int4",
        quantization_method="rtn",
        quantization_group_size=32,
    )
    lib = cpu_kernels.load()
    assert lib is not None, "the CPU kernels must build on the test machines"
    if not quant_ops.a8_supported(lib):
        pytest.skip("this CPU has no AVX-512 VNNI")
    engine = llm.engine
    assert int8_activations(engine.model) == 4 * len(engine.model.layers)
    forward = engine.runner.forward
    forward.fused = decode_step.for_model(engine.model, forward.caches)  # sees the new codes
    assert _compare_decode_steps(llm, threads=[1, 2]) >= STEPS


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_few_tokens_of_several_sequences_run_fused_as_causal_rows(
    threads: int, tiny_model_factory: Callable[[str], Path]
) -> None:
    """Steps of at most ``max_batch`` tokens in chunks of several (short prompts, a draft to
    verify beside a decode) run as the fused step's rows, each attending up to its own
    position: the logits are the per-op path's. The step's own slots hold NaN before it runs,
    so a row that read a slot of its step before it was written would show (the kernel stores
    every row's keys in one op before any row attends in the next)."""
    llm = _engine(tiny_model_factory("qwen3"))
    forward = llm.engine.runner.forward
    fused = forward.fused
    assert fused is not None
    steps = [
        [Chunk([11], 0, [3]), Chunk([5, 6, 7], 0, [1, 2]), Chunk([8, 9, 10, 12], 0, [4, 5])],
        [Chunk([13], 1, [3]), Chunk([1, 2, 3], 3, [1, 2]), Chunk([4, 14], 4, [4, 5])],
        [Chunk([15, 16, 17, 18, 19, 20, 21, 22], 2, [3, 6, 7])],
    ]
    runs: list[int] = []
    run = fused.run

    def counted(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        runs.append(len(args[0]))
        return run(*args, **kwargs)

    fused.run = counted  # type: ignore[method-assign]
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for chunks in steps:
            plan = build_plan(chunks, 4, list(range(sum(len(c.token_ids) for c in chunks))))
            assert plan.max_query_len > 1
            assert len(plan.positions) <= fused.max_batch
            before = [(c.key.clone(), c.value.clone()) for c in forward.caches]
            for cache in forward.caches:
                for t in (cache.key, cache.value):
                    t.view(-1, *t.shape[2:])[plan.slot_mapping] = float("nan")
            got = forward(plan)
            for cache, (key, value) in zip(forward.caches, before, strict=True):
                cache.key.copy_(key)
                cache.value.copy_(value)
            forward.fused = None
            try:
                expected = forward(plan)
            finally:
                forward.fused = fused
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-3)
    finally:
        torch.set_num_threads(saved)
    assert runs == [8, 6, 8]  # every step ran fused, one row per token


def test_fused_step_serves_small_decode_batches_only(
    tiny_model_factory: Callable[[str], Path],
) -> None:
    llm = _engine(tiny_model_factory("llama"))
    fused = llm.engine.runner.forward.fused
    assert fused is not None

    def meta(decodes: int, prefills: int) -> AttentionMetadata:
        lengths = [1] * decodes + [3] * prefills
        m = AttentionMetadata.for_prefills(lengths, 4, torch.device("cpu"))
        m.num_decodes = decodes
        return m

    assert fused.can_run(meta(fused.max_batch, 0))
    assert not fused.can_run(meta(fused.max_batch + 1, 0))  # a GEMM: torch does it better
    assert not fused.can_run(meta(2, 1))  # a prefill chunk in the step
    assert (
        _engine(tiny_model_factory("llama"), enforce_eager=True).engine.runner.forward.fused is None
    )


def test_latency_profile_runs_both_paths_and_puts_the_engine_back(
    tiny_model_factory: Callable[[str], Path],
) -> None:
    llm = _engine(tiny_model_factory("llama"))
    fused = llm.engine.runner.forward.fused
    text = latency_profile(llm, [5, 6, 7], steps=2, rounds=2, copy_megabytes=8)
    for heading in ("op by op (before):", "fused step (after):", "copy bandwidth"):
        assert heading in text
    after = text.split("fused step (after):")[1]
    assert "fused decode step (one C call)" in after
    share = after.split("one C call)")[1].split()[2]
    assert share.endswith("%")
    assert float(share[:-1]) > 0  # the fused step was timed
    assert llm.engine.runner.forward.fused is fused
    assert not llm.engine.has_unfinished_requests()
