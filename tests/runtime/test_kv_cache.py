"""Block accounting, prefix caching and copy-on-write, without a model."""

from __future__ import annotations

from ladle.runtime.kv_cache.manager import KVCacheManager
from ladle.runtime.sampling_params import SamplingParams
from ladle.runtime.sequence import Sequence


def make_seq(tokens: list[int]) -> Sequence:
    return Sequence("r", tokens, SamplingParams(), arrival_time=0.0)


def compute_all(kv: KVCacheManager, seq: Sequence) -> None:
    """Pretend the model ran over every known token."""
    seq.num_computed_tokens = seq.num_tokens
    kv.commit_computed(seq)


def test_allocation_covers_tokens_and_free_returns_everything() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    seq = make_seq(list(range(10)))
    assert kv.allocate_slots(seq, 10, kv.find_cached_prefix(seq))
    assert len(kv.block_tables[seq.seq_id]) == 3
    assert kv.num_free_blocks == 5
    kv.free(seq)
    assert kv.num_free_blocks == 8
    assert kv.usage == 0.0


def test_allocation_is_all_or_nothing() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    seq = make_seq(list(range(12)))
    assert not kv.allocate_slots(seq, 12, [])
    assert kv.num_free_blocks == 2
    assert seq.seq_id not in kv.block_tables


def test_prefix_hit_reuses_full_blocks_and_leaves_one_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    first = make_seq(list(range(12)))
    assert kv.allocate_slots(first, 12, kv.find_cached_prefix(first))
    compute_all(kv, first)
    first_blocks = list(kv.block_tables[first.seq_id])
    kv.free(first)

    same = make_seq(list(range(12)))
    hits = kv.find_cached_prefix(same)
    # 12 tokens = 3 full blocks, but the last token must be recomputed for its logits.
    assert hits == first_blocks[:2]
    assert kv.allocate_slots(same, 12 - 8, hits)
    assert same.num_computed_tokens == 8
    assert kv.prefix_hits == 8

    other = make_seq([*range(4), 99, 98, 97, 96, 95])
    assert len(kv.find_cached_prefix(other)) == 1  # only the first block matches


def test_prefix_cache_can_be_disabled() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    first = make_seq(list(range(12)))
    assert kv.allocate_slots(first, 12, [])
    compute_all(kv, first)
    kv.free(first)
    assert kv.find_cached_prefix(make_seq(list(range(12)))) == []


def test_cached_free_blocks_are_evicted_least_recent_first() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    old = make_seq([1, 2, 3, 4, 5])
    assert kv.allocate_slots(old, 5, [])
    compute_all(kv, old)
    kv.free(old)
    # A new unrelated sequence needing all 4 blocks evicts the cached ones.
    new = make_seq([9, 9, 9, 9, 9, 9, 9])
    assert kv.allocate_slots(new, 7, kv.find_cached_prefix(new))
    assert kv.find_cached_prefix(make_seq([1, 2, 3, 4, 5])) == []


def test_fork_shares_blocks_and_copies_on_first_write() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    parent = make_seq(list(range(6)))
    assert kv.allocate_slots(parent, 6, [])
    compute_all(kv, parent)
    child = make_seq(list(range(6)))
    kv.fork(parent, child)
    assert kv.block_tables[child.seq_id] == kv.block_tables[parent.seq_id]
    assert kv.num_allocated_blocks() == 2

    # Both append a token into the shared, half-full second block.
    parent.append_token(7)
    child.append_token(8)
    assert kv.allocate_slots(parent, 1)
    shared_full, partial = kv.block_tables[child.seq_id]
    assert kv.block_tables[parent.seq_id][0] == shared_full
    assert kv.block_tables[parent.seq_id][1] != partial
    assert kv.take_pending_copies() == [(partial, kv.block_tables[parent.seq_id][1])]
    # The child is now the sole owner of the original block: it writes in place.
    assert kv.allocate_slots(child, 1)
    assert kv.block_tables[child.seq_id][1] == partial
    assert kv.take_pending_copies() == []
    assert kv.num_allocated_blocks() == 3
    kv.free(parent)
    kv.free(child)
    assert kv.num_allocated_blocks() == 0


def test_copy_on_write_of_a_sequence_freed_in_the_same_schedule_is_cancelled() -> None:
    """A sequence that copied a shared block and is then preempted before the copies run must
    take its copy with it: the destination is free again and may be handed out at once."""
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    parent = make_seq(list(range(6)))
    assert kv.allocate_slots(parent, 6, [])
    compute_all(kv, parent)
    child = make_seq(list(range(6)))
    kv.fork(parent, child)
    parent.append_token(7)
    child.append_token(8)
    assert kv.allocate_slots(parent, 1)
    partial = kv.block_tables[child.seq_id][1]
    # Until the copy is handed over, its source stays referenced (nothing can take it).
    assert kv.pool.ref_counts[partial] == 2
    kv.free(parent)
    assert kv.take_pending_copies() == []
    assert kv.pool.ref_counts[partial] == 1  # the child alone: it writes in place
    assert kv.allocate_slots(child, 1)
    assert kv.block_tables[child.seq_id][1] == partial
    assert kv.take_pending_copies() == []
    kv.free(child)
    assert kv.num_allocated_blocks() == 0
