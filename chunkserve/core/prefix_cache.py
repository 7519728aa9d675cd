"""The prefix cache's index: which block holds the KV of which full-block hash.

A cached block is either referenced (some request's table holds it) or *evictable*: no request
holds it, but its KV and hash are kept, in least-recently-freed order, so that a later request
with the same prefix can revive it. An evictable block loses its hash only when the pool hands
it out for new content (`evict_lru`), oldest first. This class never counts references; the
`BlockPool` tells it when a block's count reaches or leaves zero.
"""
from __future__ import annotations

from collections import OrderedDict

from chunkserve.core.block_hash import BlockHash


class PrefixCache:
    def __init__(self) -> None:
        self._block_of: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        # Unreferenced cached blocks, least recently freed first (an ordered set).
        self._evictable: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._block_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._block_of.get(block_hash)

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def insert(self, block: int, block_hash: BlockHash) -> bool:
        """Indexes a referenced block whose KV now holds `block_hash`'s tokens.

        Refused when the block is already indexed (a hit, or registered last step) or another
        block already holds this hash: two requests that computed the same prefix at the same
        time each keep their own copy, and only the first is shared from then on.
        """
        if block in self._hash_of or block_hash in self._block_of:
            return False
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
        return True

    def park(self, block: int) -> None:
        """A cached block's last reference went away: it becomes the most recent evictable."""
        assert block in self._hash_of and block not in self._evictable
        self._evictable[block] = None

    def unpark(self, block: int) -> None:
        """A hit takes a reference to an evictable block: it may no longer be evicted."""
        del self._evictable[block]

    def evict_lru(self) -> int:
        """Takes the least recently freed evictable block and forgets its hash."""
        block, _ = self._evictable.popitem(last=False)
        del self._block_of[self._hash_of.pop(block)]
        return block

    def clear(self) -> list[int]:
        """Forgets every hash; returns the evictable blocks, which are now plain free blocks.

        Referenced blocks just lose their index entry: their owners keep using them, and they
        are freed as ordinary blocks later.
        """
        freed = list(self._evictable)
        self._block_of.clear()
        self._hash_of.clear()
        self._evictable.clear()
        return freed
