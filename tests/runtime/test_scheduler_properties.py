"""A stateful property test of the scheduler and the KV cache manager, through the engine on a
tiny model, under KV budgets far too small for what is asked of them.

Hypothesis adds requests of every kind (greedy, sampled, seeded, n>1, best_of, beam search,
stop strings, prompt logprobs, prompts near and past the limits), aborts some, and steps. After
every step:

- block accounting is exact: each block's reference count is the number of block tables that
  hold it, and the free list is exactly the unreferenced blocks;
- no block is owned twice within one table, and a block written by one sequence (reference
  count one) belongs to one table only;
- the copy-on-write copies handed to the model runner (checked as each schedule is made) have
  distinct destinations, each held by one sequence alone, and no destination is also a source;
- every admitted request finishes within a bound on its work (no livelock), or was refused at
  admission with a RequestError.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ladle.runtime.config import EngineArgs
from ladle.runtime.engine import LLMEngine
from ladle.runtime.errors import RequestError
from ladle.runtime.input_processor import Request
from ladle.runtime.kv_cache.manager import KVCacheManager
from ladle.runtime.model_runner import ModelRunnerOutput
from ladle.runtime.sampler import TokenLogprobs
from ladle.runtime.sampling_params import BeamSearchParams, SamplingParams
from ladle.runtime.scheduler import Scheduler
from ladle.runtime.scheduler_output import SchedulerOutput

from .conftest import assert_no_blocks_leaked

# Budgets: blocks of 4 tokens. The model's own max_model_len (512) is lowered to what fits.
CONFIGS = [
    {"num_gpu_blocks_override": 12, "max_num_seqs": 4, "max_num_batched_tokens": 16},
    {"num_gpu_blocks_override": 24, "max_num_seqs": 8, "max_num_batched_tokens": 8},
    {"num_gpu_blocks_override": 9, "max_num_seqs": 3, "max_num_batched_tokens": 40},
]


@pytest.fixture(scope="module")
def engines(tiny_model_factory: Callable[[str], Path]) -> list[LLMEngine]:
    path = str(tiny_model_factory("llama"))
    return [LLMEngine(EngineArgs(model=path, block_size=4, **config)) for config in CONFIGS]


def sampling_params(draw: Callable[[Any], Any]) -> SamplingParams:
    n = draw(st.integers(1, 3))
    best_of = draw(st.one_of(st.none(), st.integers(n, 4)))
    sampled = draw(st.booleans())
    return SamplingParams(
        n=n,
        best_of=best_of,
        temperature=draw(st.sampled_from([0.7, 1.0])) if sampled else 0.0,
        top_k=draw(st.sampled_from([0, 5])),
        # Always seeded, so that Hypothesis can replay an example exactly.
        seed=draw(st.integers(0, 1000)),
        max_tokens=draw(st.integers(1, 40)),
        ignore_eos=draw(st.booleans()),
        stop=draw(st.lists(st.sampled_from(["e", "th", " a", "\n"]), max_size=2)),
        logprobs=draw(st.sampled_from([None, 0, 2])),
        prompt_logprobs=draw(st.sampled_from([None, None, 1])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.2])),
    )


class EngineMachine(RuleBasedStateMachine):
    engines: ClassVar[list[LLMEngine]] = []

    def __init__(self) -> None:
        super().__init__()
        self.engine: LLMEngine | None = None
        self.ids = 0
        # Request id -> (steps since admitted, bound on the steps it may take).
        self.live: dict[str, list[int]] = {}

    @property
    def running(self) -> LLMEngine:
        assert self.engine is not None
        return self.engine

    @precondition(lambda self: self.engine is None)
    @rule(which=st.integers(0, len(CONFIGS) - 1))
    def pick_engine(self, which: int) -> None:
        self.engine = self.engines[which]
        assert not self.engine.has_unfinished_requests()
        self.engine.reset_prefix_cache()
        scheduler = self.engine.scheduler
        schedule = type(scheduler).schedule

        def recorded() -> SchedulerOutput:
            out = schedule(scheduler)
            kv = scheduler.kv
            tables = list(kv.block_tables.values())
            destinations = [dst for _, dst in out.block_copies]
            assert len(set(destinations)) == len(destinations), f"COW targets {out.block_copies}"
            assert not set(destinations) & {src for src, _ in out.block_copies}
            for dst in destinations:
                assert kv.pool.ref_counts[dst] == 1, "a COW target is shared"
                assert sum(dst in t for t in tables) == 1
            return out

        scheduler.schedule = recorded  # type: ignore[method-assign]

    @precondition(lambda self: self.engine is not None)
    @rule(data=st.data(), prompt_len=st.integers(1, 60), beam=st.booleans())
    def add(self, data: st.DataObject, prompt_len: int, beam: bool) -> None:
        engine = self.running
        rid = f"r{self.ids}"
        self.ids += 1
        prompt = [1000 + (7 * i + self.ids) % 500 for i in range(prompt_len)]
        params: SamplingParams | BeamSearchParams
        if beam:
            params = BeamSearchParams(
                beam_width=data.draw(st.integers(1, 3)),
                max_tokens=data.draw(st.integers(1, 12)),
                ignore_eos=data.draw(st.booleans()),
            )
            width, max_tokens = params.beam_width, params.max_tokens
        else:
            params = sampling_params(data.draw)
            width, max_tokens = params.num_samples, params.max_tokens or 0
        try:
            engine.add_request(rid, prompt, params)
        except RequestError:
            return  # refused at the door: allowed, as long as it is said there
        # Generous, but finite: a livelock shows up as a request that never ends.
        work = width * (prompt_len + max_tokens)
        self.live[rid] = [0, 4 * work + 4 * sum(b for _, b in self.live.values()) + 50]

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        (output,) = self.running.abort_request(rid)
        assert output.finished
        del self.live[rid]

    @precondition(lambda self: self.engine is not None)
    @rule(steps=st.integers(1, 6))
    def step(self, steps: int) -> None:
        for _ in range(steps):
            self._step()

    def _step(self) -> None:
        for output in self.running.step():
            assert output.error is None, output.error
            if output.finished:
                self.live.pop(output.request_id)
        for age_bound in self.live.values():
            age_bound[0] += 1
            assert age_bound[0] <= age_bound[1], "a request made no way to its end"

    @invariant()
    def blocks_are_accounted_for(self) -> None:
        if self.engine is None:
            return
        kv = self.engine.kv
        held: Counter[int] = Counter()
        for table in kv.block_tables.values():
            assert len(set(table)) == len(table), "a block is twice in one table"
            held.update(table)
        pool = kv.pool
        for block in range(pool.num_blocks):
            assert pool.ref_counts[block] == held[block], f"block {block} miscounted"
            assert pool.is_free(block) == (held[block] == 0)
        assert pool.num_free_blocks == sum(1 for b in range(pool.num_blocks) if held[b] == 0)
        assert not kv.pending_copies

    def teardown(self) -> None:
        if self.engine is None:
            return
        try:
            while self.live:
                self._step()
            assert_no_blocks_leaked(self.engine)
        finally:
            self.engine.abort_request(list(self.live))
            del self.engine.scheduler.schedule


@pytest.mark.slow
def test_scheduler_and_kv_cache_invariants(engines: list[LLMEngine]) -> None:
    EngineMachine.engines = engines
    machine = EngineMachine.TestCase
    machine.settings = settings(
        max_examples=25,
        stateful_step_count=25,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    machine().runTest()


@st.composite
def beam_workloads(draw: st.DrawFn) -> tuple[Scheduler, int]:
    """A scheduler over a tiny cache, and beam searches that each fit in it alone (as the
    input processor admits them) but not all together."""
    block_size = draw(st.sampled_from([2, 4]))
    num_blocks = draw(st.integers(6, 16))
    scheduler = Scheduler(
        KVCacheManager(num_blocks, block_size, enable_prefix_caching=False),
        max_num_seqs=draw(st.integers(3, 8)),
        max_num_batched_tokens=draw(st.integers(3, 10)),
        max_model_len=num_blocks * block_size,
        eos_token_ids=[2],
    )
    requests = 0
    for i in range(draw(st.integers(2, 4))):
        width = draw(st.integers(2, 3))
        prompt_len, max_tokens = draw(st.integers(1, 10)), draw(st.integers(2, 8))
        longest = min(prompt_len + max_tokens, num_blocks * block_size)
        fits = width * -(-longest // block_size) <= num_blocks
        if not fits or width > min(scheduler.max_num_batched_tokens, scheduler.max_num_seqs):
            continue
        step = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True, logprobs=2 * width)
        beam = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True)
        prompt = list(range(5, 5 + prompt_len))
        scheduler.add_request(Request(f"b{i}", None, prompt, step, float(i), 0, beam))
        requests += 1
    return scheduler, requests


@settings(max_examples=300, deadline=None)
@given(workload=beam_workloads(), seed=st.integers(0, 2**16))
def test_competing_beam_searches_never_deadlock(workload: tuple[Scheduler, int], seed: int) -> None:
    """Beams parked with their blocks while their siblings catch up must not wait on a
    request that waits on them: without eviction of parked beams, about 1 in 130 of these
    workloads stopped for good. The model is replaced by random top candidates."""
    scheduler, _ = workload
    rng = random.Random(seed)
    idle, progress = 0, scheduler.progress
    while scheduler.groups:
        out = scheduler.schedule()
        sampled = {}
        for item in out.scheduled:
            if item.completes_prompt:
                width = item.seq.params.logprobs or 1
                ids = rng.sample(range(3, 60), width)
                lps = sorted((-3 * rng.random() for _ in ids), reverse=True)
                sampled[item.seq.seq_id] = TokenLogprobs(ids[0], lps[0], 1, ids, lps)
        scheduler.update_from_output(out, ModelRunnerOutput(sampled=sampled))
        idle = 0 if scheduler.progress > progress else idle + 1
        progress = scheduler.progress
        assert idle < 50, "the scheduler stopped making progress"
    assert scheduler.kv.num_allocated_blocks() == 0
