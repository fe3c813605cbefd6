"""Block allocator with reference counts, per-request block tables and a prefix cache.

Pure Python, no tensors: it hands out block *ids*; :class:`~halfmoon.engine.kv_cache.KVCache`
holds the data. A block is in exactly one of two states:

- **in use**: ``ref_count >= 1`` (one per request whose table holds it);
- **free**: ``ref_count == 0``, queued for reuse. A free block that still carries a hash
  is a *cached* block: a later request whose prefix hashes to it takes it back without
  recomputing. Free blocks are reused least-recently-freed first (LRU); reusing a cached
  block evicts its hash.

Hashes come from :func:`halfmoon.core.hashing.hash_blocks` (chained xxh3_128), so a hit
on block ``i`` implies the whole prefix ``0..i`` matches. Only full, computed blocks are
registered. The block holding a prompt's last token is never taken from the cache: its
logits must be computed, and recomputing into a shared block would write into it.
A request's ``cache_salt`` roots its chain elsewhere (:func:`~halfmoon.core.hashing.chain_root`):
requests with different salts never share a block.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TypeVar

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.events import BlockEvicted, BlockStored, CacheEvent
from halfmoon.core.hashing import chain_root, hash_blocks

T = TypeVar("T")


class BlockManager:
    """Owns ``num_blocks`` block ids and the block table of every live request."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        # Free blocks in reuse order (first = next to reuse); values unused.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._block_by_hash: dict[int, int] = {}
        self._hash_by_block: dict[int, int] = {}
        self._tables: dict[str, list[int]] = {}
        # Hash chain of each request's full computed blocks (also unregistered duplicates).
        self._chains: dict[str, list[int]] = {}
        # Parent of block 0 of each request's chain (NONE_HASH unless it has a cache salt).
        self._roots: dict[str, int] = {}
        #: Hears a :class:`~halfmoon.core.events.BlockStored` / ``BlockEvicted`` (tier
        #: ``dram``) when a hash enters or leaves the prefix cache (a worker forwards these
        #: to the Conductor).
        self.listener: Callable[[CacheEvent], None] | None = None
        #: Called as ``evict_hook(block_hash, parent_hash, position, block_id)`` when a
        #: cached block is about to be reused, while its KV is still intact (a prefill
        #: worker demotes it to its store then), before the listener hears the eviction.
        self.evict_hook: Callable[[int, int, int, int], None] | None = None
        #: Held while a cached block is evicted, and by :meth:`read_cached` (another
        #: thread): a block being read is not handed out for new KV meanwhile.
        self.evict_lock = threading.Lock()
        # Parent hash and chain position of every registered block (for demotion).
        self._origin_by_block: dict[int, tuple[int, int]] = {}

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner (cached ones included: they are reusable)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently registered under a hash (in use or free)."""
        return len(self._block_by_hash)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        """A copy of ``request_id``'s block table (block of token ``p`` is ``[p // B]``)."""
        return list(self._tables[request_id])

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` holds a block table."""
        return request_id in self._tables

    def match_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[int]:
        """Ids of the cached blocks covering a leading run of ``token_ids`` (hashed under
        ``cache_salt``); no side effects.

        Stops before the block holding the last token (see the module docstring).
        """
        if not self.enable_prefix_caching or len(token_ids) < 2:
            return []
        max_blocks = (len(token_ids) - 1) // self.block_size
        root = chain_root(cache_salt)
        hashes = hash_blocks(token_ids[: max_blocks * self.block_size], self.block_size, root).full
        hits = []
        for h in hashes:
            block = self._block_by_hash.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    # -- allocation ------------------------------------------------------------------------
    def admit(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_new_tokens: int,
        cache_salt: str | None = None,
        max_cached_tokens: int | None = None,
    ) -> int | None:
        """Start ``request_id``: take its cached prefix and blocks for ``num_new_tokens`` more.

        Returns the number of prefix tokens served from the cache, or None (and changes
        nothing) when the free blocks do not suffice. ``cache_salt`` roots the request's
        hash chain (matching here and registering in :meth:`commit`);
        ``max_cached_tokens`` caps the prefix taken from the cache (None: no cap).
        """
        if request_id in self._tables:
            raise HalfmoonError(f"request {request_id!r} already holds blocks")
        hits = self.match_prefix(token_ids, cache_salt)
        if max_cached_tokens is not None:
            hits = hits[: max_cached_tokens // self.block_size]
        num_cached_tokens = len(hits) * self.block_size
        num_new_tokens = min(num_new_tokens, len(token_ids) - num_cached_tokens)
        needed = self.blocks_for(num_cached_tokens + num_new_tokens) - len(hits)
        free_hits = sum(1 for b in hits if self._ref_counts[b] == 0)
        if needed > self.num_free_blocks - free_hits:
            return None
        for block in hits:
            self._take(block)
        after = hits[-1] if hits else None
        self._tables[request_id] = hits + self._pop_free_run(needed, after)
        self._chains[request_id] = [self._hash_by_block[b] for b in hits]
        self._roots[request_id] = chain_root(cache_salt)
        return num_cached_tokens

    def grow(self, request_id: str, num_tokens: int) -> bool:
        """Extend ``request_id``'s table to hold ``num_tokens`` tokens; False (no change) when
        the free blocks do not suffice."""
        table = self._tables[request_id]
        needed = self.blocks_for(num_tokens) - len(table)
        if needed > self.num_free_blocks:
            return False
        if needed > 0:
            table.extend(self._pop_free_run(needed, table[-1] if table else None))
        return True

    def allocate(
        self, request_id: str, num_tokens: int, cache_salt: str | None = None
    ) -> list[int] | None:
        """A fresh table of uncached blocks for ``num_tokens`` tokens (KV import; its hashes
        chain under ``cache_salt``); None when the free blocks do not suffice."""
        if request_id in self._tables:
            raise HalfmoonError(f"request {request_id!r} already holds blocks")
        needed = self.blocks_for(num_tokens)
        if needed > self.num_free_blocks:
            return None
        self._tables[request_id] = self._pop_free_run(needed)
        self._chains[request_id] = []
        self._roots[request_id] = chain_root(cache_salt)
        return list(self._tables[request_id])

    def commit(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> int:
        """Register the hashes of ``request_id``'s blocks that ``num_computed_tokens`` fill;
        returns how many it registered (not those registered before, nor a block whose
        hash another block already holds)."""
        if not self.enable_prefix_caching:
            return 0
        registered = 0
        chain = self._chains[request_id]
        table = self._tables[request_id]
        num_full = num_computed_tokens // self.block_size
        size = self.block_size
        while len(chain) < num_full:
            i = len(chain)
            parent = chain[-1] if chain else self._roots[request_id]
            h = hash_blocks(token_ids[i * size : (i + 1) * size], size, parent).hashes[0]
            chain.append(h)
            block = table[i]
            # A block computed twice concurrently keeps its first copy registered.
            if h not in self._block_by_hash and block not in self._hash_by_block:
                # Origin first: another thread's read_cached keys on _block_by_hash.
                self._origin_by_block[block] = (parent, i)
                self._hash_by_block[block] = h
                self._block_by_hash[h] = block
                registered += 1
                if self.listener is not None:
                    self.listener(BlockStored(h))
        return registered

    def free(self, request_id: str) -> None:
        """Release ``request_id``'s blocks; cached ones stay reusable until evicted.

        Tail blocks are queued for reuse before head blocks: a tail is useless without its
        head, a head may serve many later prompts.
        """
        table = self._tables.pop(request_id)
        self._chains.pop(request_id)
        self._roots.pop(request_id)
        for block in reversed(table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
                if block not in self._hash_by_block:
                    # Holds nothing reusable: hand it out before any cached block.
                    self._free.move_to_end(block, last=False)

    def _take(self, block: int) -> None:
        if self._ref_counts[block] == 0:
            del self._free[block]
        self._ref_counts[block] += 1

    def _pop_free_run(self, count: int, after: int | None = None) -> list[int]:
        """``count`` free blocks to extend a table ending in block ``after``, laid out so
        that the table runs through consecutive ids where it can.

        Attention reads a sequence's blocks in table order, and runs of consecutive
        blocks read faster than scattered ones (the hardware prefetches within a run);
        the KV export hands out consecutive blocks without a copy. Which cached blocks
        are evicted, and in what order, is exactly what popping the queue's front would
        give: the blocks after ``after`` are taken only while they are free and
        uncached (all uncached free blocks come before every cached one in the queue,
        so taking one out of turn evicts nothing earlier), and the popped rest are only
        sorted.
        """
        blocks: list[int] = []
        if after is not None:
            block = after + 1
            while len(blocks) < count and block in self._free and block not in self._hash_by_block:
                del self._free[block]
                self._ref_counts[block] = 1
                blocks.append(block)
                block += 1
        rest = [self._pop_free() for _ in range(count - len(blocks))]
        rest.sort()
        return blocks + rest

    def _pop_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        if block in self._hash_by_block:
            with self.evict_lock:
                h = self._hash_by_block.pop(block)
                parent, position = self._origin_by_block.pop(block)
                del self._block_by_hash[h]
                if self.evict_hook is not None:
                    self.evict_hook(h, parent, position, block)
            if self.listener is not None:
                self.listener(BlockEvicted(h))
        self._ref_counts[block] = 1
        return block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's ``reset_prefix_cache``); False, with nothing
        forgotten, while any block is in use (a running request's). The listener hears
        each eviction; nothing is demoted (the evict hook is not called)."""
        if len(self._free) != self.num_blocks:
            return False
        with self.evict_lock:
            hashes = list(self._block_by_hash)
            self._block_by_hash.clear()
            self._hash_by_block.clear()
            self._origin_by_block.clear()
            self._free = OrderedDict((b, None) for b in range(self.num_blocks))
        if self.listener is not None:
            for h in hashes:
                self.listener(BlockEvicted(h))
        return True

    def read_cached(self, block_hash: int, read: Callable[[int], T]) -> tuple[int, int, T] | None:
        """``(parent_hash, position, read(block_id))`` of the cached block ``block_hash``,
        or None; safe from another thread: the block is not reused while ``read`` runs
        (a registered block's KV never changes until then)."""
        with self.evict_lock:
            block = self._block_by_hash.get(block_hash)
            if block is None:
                return None
            parent, position = self._origin_by_block[block]
            return parent, position, read(block)

    # -- checks ----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise ``AssertionError`` unless every block is either free or owned, ref counts
        equal table memberships, and the hash maps are mutual inverses."""
        owners = [0] * self.num_blocks
        for request_id, table in self._tables.items():
            assert len(set(table)) == len(table), f"{request_id} holds a block twice: {table}"
            for block in table:
                owners[block] += 1
        assert owners == self._ref_counts, "ref counts differ from block-table memberships"
        free = set(self._free)
        for block in range(self.num_blocks):
            in_use = self._ref_counts[block] > 0
            assert in_use != (block in free), f"block {block} is both/neither free and in use"
        assert len(free) + sum(1 for r in self._ref_counts if r) == self.num_blocks
        assert len(self._block_by_hash) == len(self._hash_by_block)
        for h, block in self._block_by_hash.items():
            assert self._hash_by_block.get(block) == h, f"hash maps disagree on block {block}"
        assert self._origin_by_block.keys() == self._hash_by_block.keys(), "origins differ"
        for request_id, chain in self._chains.items():
            assert len(chain) <= len(self._tables[request_id]), f"{request_id}: chain too long"
        assert self._roots.keys() == self._tables.keys(), "chain roots differ from block tables"
