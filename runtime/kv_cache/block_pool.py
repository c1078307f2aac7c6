"""Physical KV blocks: reference counts, the prefix-cache index and the free list."""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    """Hands out block ids and keeps freed-but-cached blocks reusable until they are evicted.

    Free blocks sit in one LRU queue. A free block may still hold a cached prefix: it is found by
    its hash until allocation evicts it, so cache hits cost nothing while memory is plentiful.
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live sequences (cached free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def lookup(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash)

    def allocate(self) -> int:
        block, _ = self._free.popitem(last=False)
        old_hash = self._hash_of[block]
        if old_hash is not None:
            del self._cached[old_hash]
            self._hash_of[block] = None
        self.ref_counts[block] = 1
        return block

    def acquire(self, block: int) -> None:
        """Take another reference, reviving the block if it was free."""
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block, tail first, so that a prefix outlives its suffix."""
        for block in reversed(blocks):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None

    def cache(self, block: int, block_hash: bytes) -> None:
        """Make a full block findable by content; the first block with a given content wins."""
        if self.enable_prefix_caching and block_hash not in self._cached:
            self._cached[block_hash] = block
            self._hash_of[block] = block_hash

    def is_free(self, block: int) -> bool:
        return self.ref_counts[block] == 0

    def reset_prefix_cache(self) -> None:
        self._cached.clear()
        self._hash_of = [None] * self.num_blocks
