"""No request can hurt the engine, and every limit is explicit: bad requests are refused at the
door, a failure inside a step fails its request alone, nothing waits for ever, deadlines free
blocks, and a model runner that fails everything is reported as dead."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ladle.runtime import LLM, SamplingParams
from ladle.runtime.config import ConfigError
from ladle.runtime.engine import LLMEngine
from ladle.runtime.errors import RequestError
from ladle.runtime.limits import RequestLimits
from ladle.runtime.outputs import RequestOutput
from ladle.runtime.sampler import Sampler
from ladle.runtime.sampling_params import BeamSearchParams
from ladle.runtime.sequence import Sequence

from .conftest import assert_no_blocks_leaked

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_path(tiny_model_factory: Callable[[str], Path]) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def llm(tiny_path: str) -> LLM:
    limits = RequestLimits(max_n=4, max_stop=2, max_stop_length=8, max_logit_bias=3)
    return LLM(tiny_path, limits=limits, kv_cache_memory="16MiB", max_model_len=128)


def run(engine: LLMEngine, max_steps: int = 500) -> dict[str, RequestOutput]:
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        done.update({o.request_id: o for o in engine.step() if o.finished})
    raise AssertionError("the engine did not finish its requests")


def test_fork_seeds_past_the_seed_range_are_refused_and_the_engine_serves_on(llm: LLM) -> None:
    engine = llm.engine
    with pytest.raises(RequestError, match=r"seed: seed \+ 1 \(one seed per sample\)") as info:
        engine.add_request("s", [5, 6, 7], SamplingParams(n=2, seed=2**63 - 1))
    assert info.value.param == "seed"
    # One below the edge is fine: the second sample draws from 2**63 - 1.
    engine.add_request("ok", [5, 6, 7], SamplingParams(n=2, seed=2**63 - 2, max_tokens=2))
    assert run(engine)["ok"].outputs[1].finish_reason == "length"
    assert_no_blocks_leaked(engine)


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (SamplingParams(n=5), "n"),
        (SamplingParams(n=2, best_of=5), "best_of"),
        (SamplingParams(stop=["a", "b", "c"]), "stop"),
        (SamplingParams(stop=["x" * 9]), "stop"),
        (SamplingParams(stop_token_ids=[1, 2, 3]), "stop_token_ids"),
        (SamplingParams(logit_bias={1: 1, 2: 1, 3: 1, 4: 1}), "logit_bias"),
        (SamplingParams(bad_words=["a" * 9]), "bad_words"),
        (SamplingParams(logprobs=21), "logprobs"),
        (SamplingParams(prompt_logprobs=21), "prompt_logprobs"),
        (BeamSearchParams(beam_width=5, max_tokens=2), "beam_width"),
    ],
)
def test_over_limit_requests_are_refused_naming_the_parameter(
    llm: LLM, params: SamplingParams | BeamSearchParams, param: str
) -> None:
    with pytest.raises(RequestError) as info:
        llm.engine.add_request("over", [5, 6, 7], params)
    assert info.value.param == param
    assert param in str(info.value)
    assert not llm.engine.has_unfinished_requests()


def test_sequences_beyond_max_num_seqs_are_refused(tiny_path: str) -> None:
    small = LLM(tiny_path, kv_cache_memory="8MiB", max_model_len=64, max_num_seqs=2)
    with pytest.raises(RequestError, match="max-num-seqs") as info:
        small.generate([5, 6], SamplingParams(n=3), use_tqdm=False)
    assert info.value.param == "n"
    # n=2 fills both seats; a second request waits until they are free instead of squeezing in.
    engine = small.engine
    engine.add_request("pair", [5, 6, 7], SamplingParams(n=2, max_tokens=3, ignore_eos=True))
    engine.add_request("next", [8, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    for _ in range(4):
        engine.step()
        assert len(engine.scheduler.running) + len(engine.scheduler.parked) <= 2
    run(engine)


def test_priority_needs_the_priority_policy(llm: LLM) -> None:
    with pytest.raises(RequestError, match="scheduling-policy priority") as info:
        llm.generate([5, 6], GREEDY, priority=[3], use_tqdm=False)
    assert info.value.param == "priority"


def test_a_bad_prompt_in_a_batch_adds_none_of_it(llm: LLM) -> None:
    with pytest.raises(RequestError):
        llm.generate([[5, 6], [7, 8], [1] * 500], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(RequestError, match="list of integer token ids"):
        llm.generate([[5, 6.5]], GREEDY, use_tqdm=False)  # type: ignore[list-item]
    assert_no_blocks_leaked(llm.engine)


def test_a_failure_inside_a_step_fails_that_request_alone(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether the model step, the scheduler's update or the output processing breaks, the
    request it broke for ends with finish reason "error" and the others finish normally."""
    engine = llm.engine
    execute = engine.runner.execute

    def execute_unless_poisoned(out: Any) -> Any:
        if any(i.seq.request_id == "model" for i in out.scheduled):
            raise RuntimeError("kernel fault")
        return execute(out)

    monkeypatch.setattr(engine.runner, "execute", execute_unless_poisoned)
    check_stop = engine.scheduler._check_stop

    def check_unless_poisoned(seq: Sequence, token: int) -> None:
        if seq.request_id == "update":
            raise KeyError("scheduler bug")
        check_stop(seq, token)

    monkeypatch.setattr(engine.scheduler, "_check_stop", check_unless_poisoned)
    output_seq = engine.output_processor._apply_seq

    def apply_unless_poisoned(state: Any, index: int, update: Any) -> bool:
        if state.request.request_id == "output":
            raise UnicodeDecodeError("utf-8", b"", 0, 1, "detokenizer bug")
        result: bool = output_seq(state, index, update)
        return result

    monkeypatch.setattr(engine.output_processor, "_apply_seq", apply_unless_poisoned)
    for rid in ("a", "model", "update", "output", "b"):
        engine.add_request(rid, [5, 6, 7], GREEDY)
    done = run(engine)
    for rid in ("model", "update", "output"):
        assert done[rid].error, rid
        assert done[rid].outputs[0].finish_reason == "error"
    for rid in ("a", "b"):
        assert done[rid].error is None
        assert len(done[rid].outputs[0].token_ids) == 4
    assert_no_blocks_leaked(engine)


def test_a_model_step_that_fails_for_everyone_kills_the_engine(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A broken device is not a bad request: after three all-failed steps, step() raises."""

    def broken(out: Any) -> Any:
        raise RuntimeError("device lost")

    monkeypatch.setattr(llm.engine.runner, "execute", broken)
    for step in range(3):
        llm.engine.add_request(f"x{step}", [5, 6, 7], GREEDY)
        if step < 2:
            assert llm.engine.step()[0].error
    with pytest.raises(RuntimeError, match="failed for every sequence 3 times"):
        llm.engine.step()
    llm.engine.abort_request(["x2"])


def test_a_sequence_longer_than_the_cache_is_capped_not_stuck(tiny_path: str) -> None:
    """12 blocks of 4 hold 48 tokens: the model's 512 is lowered to 48, and a request that
    would outgrow the cache ends at that length instead of preempting itself for ever."""
    llm = LLM(tiny_path, num_gpu_blocks_override=12, block_size=4, max_num_batched_tokens=16)
    assert llm.engine.max_model_len == 48
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    outs = llm.generate([[5] * 30, [6] * 20], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [18, 28]
    assert {o.outputs[0].finish_reason for o in outs} == {"length"}
    assert_no_blocks_leaked(llm.engine)
    with pytest.raises(ConfigError, match="max_model_len 64 does not fit"):
        LLM(tiny_path, num_gpu_blocks_override=12, block_size=4, max_model_len=64)


def test_beam_searches_that_cannot_fit_are_refused_and_those_that_can_all_finish(
    tiny_path: str,
) -> None:
    """Parked beams hold blocks while their siblings catch up; two searches competing for a
    cache that holds one at a time must both finish, not wait on each other."""
    llm = LLM(tiny_path, num_gpu_blocks_override=16, block_size=4, max_num_batched_tokens=8)
    with pytest.raises(RequestError, match="beam_width: 3 beams of up to 30 tokens would need 24"):
        llm.beam_search([[5] * 20], BeamSearchParams(beam_width=3, max_tokens=10))
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    both = llm.beam_search([[5] * 9, [6] * 10], params)
    alone = [llm.beam_search([p], params)[0] for p in ([5] * 9, [6] * 10)]
    assert [[s.tokens for s in o.sequences] for o in both] == [
        [s.tokens for s in o.sequences] for o in alone
    ]
    assert_no_blocks_leaked(llm.engine)


def test_a_deadline_aborts_the_request_and_frees_its_blocks(llm: LLM) -> None:
    engine = llm.engine
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    engine.add_request("late", [5, 6, 7], long, deadline=time.monotonic() + 0.05)
    engine.add_request("free", [5, 6, 7], GREEDY)
    engine.step()
    assert engine.kv.num_allocated_blocks() > 0
    time.sleep(0.1)
    done = run(engine)
    assert done["late"].outputs[0].finish_reason == "abort"
    assert 0 < len(done["late"].outputs[0].token_ids) < 100
    assert done["free"].outputs[0].finish_reason == "length"
    assert_no_blocks_leaked(engine)


def test_no_progress_is_measured_while_work_waits(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The liveness watchdog's input: an engine that steps without scheduling anything makes
    no progress, and the clock runs only while requests are open."""
    engine = llm.engine
    assert engine.seconds_without_progress() == 0.0
    from ladle.runtime.scheduler_output import SchedulerOutput

    monkeypatch.setattr(engine.scheduler, "schedule", SchedulerOutput)
    engine.add_request("stuck", [5, 6, 7], GREEDY)
    for _ in range(3):
        engine.step()
        time.sleep(0.02)
    assert engine.seconds_without_progress() >= 0.05
    monkeypatch.undo()
    run(engine)
    assert engine.seconds_without_progress() == 0.0


def test_top_k_for_one_row_leaves_the_others_alone() -> None:
    """A batch mixing top_k with rows without it filters only the top_k row (the others keep
    their whole distribution), and logprobs are computed only for rows that asked."""
    sampler = Sampler(torch.device("cpu"))
    probs = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), -1)
    filtered = sampler._top_k(probs.clone(), [0, 3, 50])
    assert torch.equal(filtered[0], probs[0])
    assert torch.equal(filtered[2], probs[2])
    assert int((filtered[1] > 0).sum()) == 3

    def seq(**kwargs: Any) -> Sequence:
        params = SamplingParams(temperature=0, **kwargs).bind(None, set(), 50)
        return Sequence("r", [1], params, 0.0)

    logits = torch.randn(3, 50)
    results = sampler(logits, [seq(), seq(logprobs=1), seq(n=1, best_of=2)])
    assert results[0].logprob is None
    expected = torch.log_softmax(logits, -1)
    for row in (1, 2):
        token = results[row].token_id
        assert results[row].logprob == pytest.approx(float(expected[row, token]), abs=1e-5)
