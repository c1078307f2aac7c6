"""Scheduling decisions on their own: budgets, chunked prefill, preemption, priorities."""

from __future__ import annotations

import itertools

from ladle.runtime.input_processor import Request
from ladle.runtime.kv_cache.manager import KVCacheManager
from ladle.runtime.model_runner import ModelRunnerOutput
from ladle.runtime.sampler import TokenLogprobs
from ladle.runtime.sampling_params import SamplingParams
from ladle.runtime.scheduler import Scheduler
from ladle.runtime.scheduler_output import SchedulerOutput
from ladle.runtime.sequence import Sequence, SequenceStatus

_ids = itertools.count()


def add(sched: Scheduler, n_prompt: int, arrival: float, priority: int = 0) -> Sequence:
    """Add a request with an ``n_prompt``-token prompt; returns its sequence."""
    rid = f"r{next(_ids)}"
    prompt = list(range(1, n_prompt + 1))
    sched.add_request(Request(rid, None, prompt, SamplingParams(), arrival, priority))
    return sched.groups[rid].seqs[0]


def run_step(sched: Scheduler, sampled_token: int = 7) -> SchedulerOutput:
    """Schedule, then act as the model: every sequence that reached its end samples a token."""
    out = sched.schedule()
    sampled = {
        item.seq.seq_id: TokenLogprobs(sampled_token, 0.0)
        for item in out.scheduled
        if item.completes_prompt
    }
    sched.update_from_output(out, ModelRunnerOutput(sampled=sampled))
    return out


def test_long_prompt_is_chunked_and_shares_steps_with_decodes() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=10)
    short = add(sched, 3, 0.0)
    run_step(sched)  # short prefills fully and samples
    long = add(sched, 25, 1.0)
    out = run_step(sched)
    sizes = {item.seq.seq_id: item.num_new_tokens for item in out.scheduled}
    assert sizes == {short.seq_id: 1, long.seq_id: 9}
    assert out.num_batched_tokens == 10
    assert not next(i for i in out.scheduled if i.seq is long).completes_prompt
    run_step(sched)
    out = run_step(sched)
    assert long.num_computed_tokens == 25
    assert long.output_token_ids == [7]


def test_max_num_seqs_limits_admission() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        add(sched, 4, float(i))
    out = run_step(sched)
    assert len(out.scheduled) == 2
    assert len(sched.waiting) == 1


def test_newest_running_sequence_is_preempted_when_blocks_run_out() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    old, new = add(sched, 4, 0.0), add(sched, 4, 1.0)
    run_step(sched)  # 2 blocks each, pool full; both sampled a 5th token
    out = run_step(sched)  # each needs a 3rd block for that token's KV: none left
    assert out.preempted == [new]
    assert [i.seq for i in out.scheduled] == [old]
    assert new.num_computed_tokens == 0
    assert new.output_token_ids == [7]  # tokens are kept; KV is recomputed later
    assert sched.num_preemptions == 1
    assert sched.waiting == [new]


def test_priority_policy_preempts_less_urgent_work() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100, policy="priority")
    background = add(sched, 8, 0.0, priority=10)
    run_step(sched)
    urgent = add(sched, 8, 1.0, priority=0)
    out = run_step(sched)
    assert urgent in [i.seq for i in out.scheduled]
    assert background in sched.waiting


def test_priority_policy_takes_a_seat_from_a_lower_priority_only() -> None:
    """Every seat taken: a more urgent request displaces the least urgent running one (the
    newest of the lowest priority) at once; one of equal priority waits, as under FCFS."""
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=100, policy="priority")
    low_old, low_new = add(sched, 4, 0.0, priority=1), add(sched, 4, 1.0, priority=1)
    run_step(sched)
    peer = add(sched, 4, 2.0, priority=1)
    out = run_step(sched)
    assert {i.seq for i in out.scheduled} == {low_old, low_new}
    assert sched.waiting == [peer]
    urgent = add(sched, 4, 3.0, priority=0)
    out = run_step(sched)
    assert out.preempted == [low_new]
    assert {i.seq for i in out.scheduled} == {low_old, urgent}
    assert low_new.output_token_ids == [7, 7]  # kept; its KV is recomputed later
    assert sched.waiting == [low_new, peer]  # by arrival within a priority


def test_fcfs_never_takes_a_seat() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=100)
    running = add(sched, 4, 0.0, priority=1)
    run_step(sched)
    urgent = add(sched, 4, 1.0, priority=0)
    out = run_step(sched)
    assert [i.seq for i in out.scheduled] == [running]
    assert sched.waiting == [urgent]


def test_fcfs_waits_instead_of_preempting_for_newcomers() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    first = add(sched, 8, 0.0)
    run_step(sched)
    second = add(sched, 8, 1.0)
    out = run_step(sched)
    assert [i.seq for i in out.scheduled] == [first]
    assert sched.waiting == [second]


def test_finish_frees_blocks_immediately() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    s = add(sched, 9, 0.0)
    run_step(sched)
    assert kv.num_free_blocks == 5
    sched.finish_requests([s.request_id], "abort")
    assert kv.num_free_blocks == 8
    assert sched.num_unfinished == 0


def test_busy_adapters_cannot_keep_a_rarely_used_one_out_for_good() -> None:
    """One slot, adapter A always busy (a new request for it every step): B's request is
    passed over at first (vLLM's rule), then requests for A wait behind it, A drains, and B
    runs; the base model's requests pass throughout."""
    from ladle.runtime.lora.admission import LORA_MAX_PASSES
    from ladle.runtime.lora.request import LoRARequest

    kv = KVCacheManager(num_blocks=256, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100, max_loras=1)
    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")

    def request(lora: LoRARequest | None, arrival: float) -> Sequence:
        rid = f"r{next(_ids)}"
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        sched.add_request(Request(rid, None, [1, 2, 3], params, arrival, lora_request=lora))
        return sched.groups[rid].seqs[0]

    request(a, 0.0)
    rare = request(b, 0.5)
    base_admitted = []
    for step in range(1, 4 * LORA_MAX_PASSES):
        request(a, float(step))
        base = request(None, float(step))
        run_step(sched)
        base_admitted.append(base.status is not SequenceStatus.WAITING)
        if rare.status is not SequenceStatus.WAITING:
            break
    assert rare.status is not SequenceStatus.WAITING, "the rare adapter never got its slot"
    assert rare.lora_passes > LORA_MAX_PASSES
    # It took the passes and then the time A's running requests needed to finish.
    assert step <= LORA_MAX_PASSES + 5
    assert all(base_admitted)
