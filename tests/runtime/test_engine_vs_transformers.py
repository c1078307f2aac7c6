"""Greedy outputs of our engine against transformers, in every scheduling situation.

Each scenario compares full 64-token continuations. A divergence is accepted only as a true
near-tie (see ``assert_matches_reference``); the exact-match counts are printed with -rA.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from random_weights import TINY_ARCHITECTURES

from ladle.runtime.config import EngineArgs
from ladle.runtime.engine import LLMEngine
from ladle.runtime.outputs import RequestOutput
from ladle.runtime.sampling_params import SamplingParams

from .conftest import (
    TransformersReference,
    assert_matches_reference,
    assert_no_blocks_leaked,
)

NEW_TOKENS = 64
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.\nThe sea",
    "def fibonacci(n):\n    ",
    "In a distant galaxy, a small robot named Pip discovered that the stars were "
    "not what they seemed. Every night, it climbed the tallest tower and",
]
SHARED_PREFIX = (
    "You are a helpful assistant for a Kubernetes platform team. Answer briefly and "
    "precisely, and say when you are unsure. The cluster runs GPU nodes in two pools, "
    "and every service exposes an OpenAI-compatible API behind a gateway. Question: "
)
SUFFIXES = ["What is a pod?", "How do I scale a deployment?", "What is a GPU pool?"]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def run_to_end(
    engine: LLMEngine, arrivals: dict[int, list[tuple[str, list[int]]]]
) -> dict[str, list[int]]:
    """Step the engine, adding requests at the given step numbers (mid-flight arrivals)."""
    done: dict[str, RequestOutput] = {}
    step = 0
    while arrivals or engine.has_unfinished_requests():
        for rid, ids in arrivals.pop(step, []):
            engine.add_request(rid, ids, greedy())
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
    return {rid: out.outputs[0].token_ids for rid, out in done.items()}


def tokenize(engine: LLMEngine, texts: list[str]) -> list[list[int]]:
    return [list(engine.tokenizer.encode(t)) for t in texts]


def check_all(
    results: dict[str, list[int]],
    prompts: dict[str, list[int]],
    reference: TransformersReference,
    report: list[str],
) -> None:
    for rid, ids in prompts.items():
        assert_matches_reference(results[rid], reference.greedy(ids, NEW_TOKENS), report, rid)


class TestDefaultModel:
    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls) -> LLMEngine:
        return LLMEngine(EngineArgs(kv_cache_memory="256MiB", max_num_batched_tokens=64))

    def test_each_request_alone(
        self, engine: LLMEngine, default_reference: TransformersReference, match_report: list[str]
    ) -> None:
        # What `auto` picks on a CPU: decode attention and RMSNorm in our C kernels.
        assert engine.attention.name == "cpu"
        prompts = dict(
            zip([f"alone-{i}" for i in range(len(PROMPTS))], tokenize(engine, PROMPTS), strict=True)
        )
        for rid, ids in prompts.items():
            check_all(
                run_to_end(engine, {0: [(rid, ids)]}), {rid: ids}, default_reference, match_report
            )
        assert_no_blocks_leaked(engine)

    def test_batched_with_mid_flight_arrivals(
        self, engine: LLMEngine, default_reference: TransformersReference, match_report: list[str]
    ) -> None:
        ids = tokenize(engine, PROMPTS)
        arrivals = {0: [("a0", ids[0]), ("a1", ids[1])], 5: [("a2", ids[2])], 11: [("a3", ids[3])]}
        prompts = {rid: p for batch in arrivals.values() for rid, p in batch}
        # The long prompt arrives while others decode and is chunked (budget 64 tokens).
        check_all(run_to_end(engine, dict(arrivals)), prompts, default_reference, match_report)
        assert_no_blocks_leaked(engine)

    def test_shared_prefix_served_from_cache(
        self, engine: LLMEngine, default_reference: TransformersReference, match_report: list[str]
    ) -> None:
        ids = tokenize(engine, [SHARED_PREFIX + s for s in SUFFIXES])
        hits_before = engine.kv.prefix_hits
        first = run_to_end(engine, {0: [("p0", ids[0])]})
        rest = run_to_end(engine, {0: [(f"p{i}", ids[i]) for i in range(1, len(ids))]})
        hits = engine.kv.prefix_hits - hits_before
        prefix_len = len(engine.tokenizer.encode(SHARED_PREFIX))
        assert hits >= (len(ids) - 1) * (prefix_len // engine.kv.block_size) * engine.kv.block_size
        check_all(
            {**first, **rest},
            {f"p{i}": p for i, p in enumerate(ids)},
            default_reference,
            match_report,
        )
        assert_no_blocks_leaked(engine)

    def test_under_preemption(
        self, default_reference: TransformersReference, match_report: list[str]
    ) -> None:
        # 12 blocks of 16 tokens cannot hold four ~40-token prompts plus 64 new tokens each.
        engine = LLMEngine(EngineArgs(num_gpu_blocks_override=12, enable_prefix_caching=False))
        ids = tokenize(engine, PROMPTS)
        prompts = {f"q{i}": p for i, p in enumerate(ids)}
        results = run_to_end(engine, {0: list(prompts.items())})
        assert engine.scheduler.num_preemptions > 0
        check_all(results, prompts, default_reference, match_report)
        assert_no_blocks_leaked(engine)


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_tiny_random_models(
    arch: str, tiny_model_factory: Callable[[str], Path], match_report: list[str]
) -> None:
    path = tiny_model_factory(arch)
    reference = TransformersReference(path)
    engine = LLMEngine(
        EngineArgs(
            model=str(path), num_gpu_blocks_override=24, block_size=4, max_num_batched_tokens=32
        )
    )
    ids = tokenize(engine, PROMPTS)
    arrivals = {0: [("t0", ids[0]), ("t1", ids[1])], 3: [("t2", ids[2]), ("t3", ids[3])]}
    prompts = {rid: p for batch in arrivals.values() for rid, p in batch}
    results = run_to_end(engine, arrivals)
    check_all(results, prompts, reference, match_report)
    assert engine.scheduler.num_preemptions > 0  # 24 blocks of 4 force recomputation
    assert_no_blocks_leaked(engine)
