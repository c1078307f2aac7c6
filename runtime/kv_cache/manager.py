"""Block tables for sequences: allocation, prefix-cache hits, copy-on-write forks."""

from __future__ import annotations

import hashlib
from array import array

from ladle.runtime.kv_cache.block_pool import BlockPool
from ladle.runtime.sequence import Sequence

_ROOT_HASH = b"ladle-kv-root"


def chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    """Content hash of a full block, chained to its prefix so equal blocks at different
    positions or after different prefixes never collide."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def root_hash(seq: Sequence) -> bytes:
    """The chain's start: an adapter changes every layer's KV, so each adapter (each load of
    one) has a prefix cache of its own."""
    if seq.lora is None:
        return _ROOT_HASH
    return chain_hash(_ROOT_HASH, [seq.lora.lora_int_id])


class KVCacheManager:
    """Maps each sequence to the physical blocks that hold its KV.

    Invariants: a block referenced by several sequences is full or is never written again
    without a copy first (copy-on-write), and a block's hash is registered only once all of its
    slots hold computed KV.

    A copy-on-write keeps its source block referenced until the copies are handed to the model
    runner, so that nothing allocated in the same schedule can take it; a sequence freed in
    that schedule (preempted, finished) takes its pending copies with it, since their
    destination is one of its own blocks, now free for someone else.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.block_tables: dict[int, list[int]] = {}
        # How many leading blocks of each sequence are already published in the prefix cache.
        self._num_published: dict[int, int] = {}
        # (src, dst) block copies that the model runner must perform before the next forward,
        # by the sequence that owns dst.
        self.pending_copies: dict[int, list[tuple[int, int]]] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _update_hashes(self, seq: Sequence, num_tokens: int) -> None:
        full = num_tokens // self.block_size
        bs = self.block_size
        for i in range(len(seq.block_hashes), full):
            parent = seq.block_hashes[i - 1] if i else root_hash(seq)
            seq.block_hashes.append(chain_hash(parent, seq.token_ids[i * bs : (i + 1) * bs]))

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks that already hold a prefix of ``seq``. At least one token is always left to
        compute, since the last prompt token's logits are needed. Requests for prompt logprobs
        get no hits (as in vLLM): every prompt position's logits are needed."""
        if not self.pool.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        self._update_hashes(seq, seq.num_tokens - 1)
        hits: list[int] = []
        for block_hash in seq.block_hashes[: (seq.num_tokens - 1) // self.block_size]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] | None = None
    ) -> bool:
        """Make room for ``num_new_tokens`` after the computed ones; all or nothing."""
        cached_blocks = cached_blocks or []
        table = self.block_tables.get(seq.seq_id)
        start = len(cached_blocks) * self.block_size if table is None else seq.num_computed_tokens
        current = cached_blocks if table is None else table
        needed = self.blocks_needed(start + num_new_tokens) - len(current)
        revived = sum(1 for b in cached_blocks if self.pool.is_free(b))
        cow = self._needs_copy(current, start)
        if max(needed, 0) + revived + int(cow) > self.pool.num_free_blocks:
            return False
        if table is None:
            for block in cached_blocks:
                self.pool.acquire(block)
            table = self.block_tables[seq.seq_id] = list(cached_blocks)
            self._num_published[seq.seq_id] = len(cached_blocks)
            seq.num_computed_tokens = start
            seq.num_cached_tokens = start
            if self.pool.enable_prefix_caching:
                self.prefix_queries += seq.num_tokens
                self.prefix_hits += start
        if cow:
            self._copy_on_write(seq, table, start // self.block_size)
        for _ in range(needed):
            table.append(self.pool.allocate())
        return True

    def _needs_copy(self, table: list[int], first_slot: int) -> bool:
        index = first_slot // self.block_size
        return index < len(table) and self.pool.ref_counts[table[index]] > 1

    def _copy_on_write(self, seq: Sequence, table: list[int], index: int) -> None:
        """Point the table at a fresh block; the reference to the shared one becomes a pin on
        the copy's source, dropped when the copies are taken."""
        shared = table[index]
        table[index] = self.pool.allocate()
        self.pending_copies.setdefault(seq.seq_id, []).append((shared, table[index]))

    def commit_computed(self, seq: Sequence) -> None:
        """Register blocks that became full of computed KV, so later requests can reuse them."""
        if not self.pool.enable_prefix_caching:
            return
        table = self.block_tables[seq.seq_id]
        self._update_hashes(seq, seq.num_computed_tokens)
        full = seq.num_computed_tokens // self.block_size
        for i in range(self._num_published[seq.seq_id], full):
            self.pool.cache(table[i], seq.block_hashes[i])
        self._num_published[seq.seq_id] = full

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child`` the parent's blocks by reference; writes copy lazily."""
        table = self.block_tables[parent.seq_id]
        for block in table:
            self.pool.acquire(block)
        self.block_tables[child.seq_id] = list(table)
        self._num_published[child.seq_id] = self._num_published[parent.seq_id]
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)

    def free(self, seq: Sequence) -> None:
        table = self.block_tables.pop(seq.seq_id, None)
        self._num_published.pop(seq.seq_id, None)
        cancelled = self.pending_copies.pop(seq.seq_id, [])
        if table is not None:
            self.pool.release(table)
        self.pool.release([src for src, _ in cancelled])

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The copies to perform before the next forward; their sources are unpinned now,
        after which nothing is allocated until the copies are done."""
        copies = [c for pending in self.pending_copies.values() for c in pending]
        self.pending_copies = {}
        self.pool.release([src for src, _ in copies])
        return copies

    def num_allocated_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free_blocks
