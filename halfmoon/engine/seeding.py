"""Pool blocks held for a prompt's prefix while its KV is on the way in.

A prefill worker that pulls a prefix from a peer (or reads it from its SSD tier) used
to copy every block into the engine's pool at the end, on its loop thread, after the
whole pull: 11-14 ms for 90 MiB of SmolLM2's KV, during which the loop neither stepped
the engine nor answered commands, and which every pull waited for after its last byte.
A :class:`PrefixReservation` takes the blocks the prefix needs when the load begins, so
that each block can be copied into the pool the moment it arrives (on the thread that
received it, while the next ones are still on the wire; one that came compressed is
decoded straight into its pool block, :meth:`PrefixReservation.write_encoded`); once the
load ended, the loop thread registers the blocks that arrived as cached
(:meth:`PrefixReservation.finish`).

Held blocks are ordinary blocks of the :class:`~halfmoon.engine.block_manager.BlockManager`
owned by a holder that is not a request: the engine cannot hand them out, evict them
or schedule into them, and the cached prefix they continue is held with them, so it
cannot be evicted while the rest arrives either.

Threads: :func:`reserve_prefix` and :meth:`PrefixReservation.finish` run on the engine
thread; :meth:`PrefixReservation.write` on any thread, until the fetch that feeds the
reservation has ended (only then may ``finish`` be called: a block written after it
could be another request's by then).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence

from halfmoon.core.errors import HalfmoonError
from halfmoon.engine.block_manager import BlockManager
from halfmoon.engine.kv_cache import KVCache
from halfmoon.engine.kvcodec import KVCodec

#: Holder names: a NUL cannot start a request id that came through the API, so a holder
#: never collides with a request.
_HOLDERS = (f"\0seed{n}" for n in itertools.count())
_HOLDERS_LOCK = threading.Lock()


class PrefixReservation:
    """``len(block_ids)`` pool blocks held for blocks ``first_block..`` of ``token_ids``'s
    chain (see the module docstring). Payloads are whole-model one-block export buffers
    (what the block store holds), as :meth:`KVCache.import_payloads` takes them."""

    def __init__(
        self,
        blocks: BlockManager,
        kv_cache: KVCache,
        holder: str,
        token_ids: Sequence[int],
        first_block: int,
        block_ids: list[int],
    ) -> None:
        self.blocks = blocks
        self.kv_cache = kv_cache
        self.holder = holder
        self.token_ids = list(token_ids)
        self.first_block = first_block
        self.block_ids = block_ids
        self._written = [False] * len(block_ids)
        self.finished = False

    @property
    def num_blocks(self) -> int:
        """Blocks held for the prefix's continuation."""
        return len(self.block_ids)

    def write(self, index: int, payload: bytes | bytearray | memoryview) -> None:
        """Copy ``payload`` into held block ``index`` (0: block ``first_block`` of the
        chain); any thread, until the load's fetch ended."""
        self.kv_cache.import_payloads([self._block(index)], [payload])
        self._written[index] = True

    def write_encoded(self, index: int, payload: memoryview, codec: KVCodec) -> None:
        """:meth:`write` of a block that came encoded by ``codec`` (``--kv-compression``):
        decoded straight into its pool block, without a buffer in between."""
        self.kv_cache.import_encoded(self._block(index), payload, codec)
        self._written[index] = True

    def _block(self, index: int) -> int:
        """The pool block held for block ``index`` (raises once finished, or out of range)."""
        if self.finished:
            raise HalfmoonError("a finished prefix reservation takes no more blocks")
        if not 0 <= index < len(self.block_ids):
            raise HalfmoonError(f"block {index} of a {len(self.block_ids)}-block reservation")
        return self.block_ids[index]

    def written(self, index: int) -> bool:
        """Whether held block ``index`` has been written."""
        return 0 <= index < len(self._written) and self._written[index]

    def num_written(self) -> int:
        """The leading run of held blocks written so far (what :meth:`finish` can keep)."""
        return next((i for i, w in enumerate(self._written) if not w), len(self._written))

    def finish(self, count: int | None = None) -> int:
        """Register the first ``count`` held blocks (None: all; at most the leading run
        written) as cached under their hashes and give every held block back to the
        pool (the engine thread, once the fetch ended); returns how many it registered.
        A block the pool gained meanwhile by computing it keeps its first copy (see
        :meth:`BlockManager.commit`; the held copy is not counted). Calling it again
        does nothing."""
        if self.finished:
            return 0
        self.finished = True
        kept = self.num_written() if count is None else min(count, self.num_written())
        registered = 0
        if kept:
            size = self.blocks.block_size
            registered = self.blocks.commit(
                self.holder, self.token_ids, (self.first_block + kept) * size
            )
        self.blocks.free(self.holder)
        return registered

    def release(self) -> None:
        """Give every held block back without keeping any (the engine thread)."""
        self.finish(0)


def reserve_prefix(
    blocks: BlockManager,
    kv_cache: KVCache,
    token_ids: Sequence[int],
    first_block: int,
    count: int,
    cache_salt: str | None = None,
) -> PrefixReservation | None:
    """Hold ``count`` blocks for blocks ``first_block..first_block+count-1`` of
    ``token_ids``'s chain under ``cache_salt``, with the pool's cached prefix (blocks
    ``0..first_block-1``); None (nothing held) when the pool lacks the free blocks, when
    its cached prefix is no longer ``first_block`` blocks long, or when ``count`` is 0."""
    size = blocks.block_size
    have = first_block + count
    if count < 1 or len(token_ids) < have * size or not blocks.enable_prefix_caching:
        return None
    with _HOLDERS_LOCK:
        holder = next(_HOLDERS)
    # One token past the blocks: the block manager never matches a prompt's last block.
    cached = blocks.admit(holder, list(token_ids[: have * size + 1]), count * size, cache_salt)
    if cached is None:
        return None
    if cached != first_block * size:
        blocks.free(holder)
        return None
    table = blocks.block_table(holder)
    return PrefixReservation(
        blocks, kv_cache, holder, token_ids, first_block, table[first_block:have]
    )


def seed_prefix(
    blocks: BlockManager,
    kv_cache: KVCache,
    token_ids: Sequence[int],
    first_block: int,
    payloads: Sequence[bytes | bytearray | memoryview],
    cache_salt: str | None = None,
) -> int:
    """Copy ``payloads`` into the pool as cached blocks ``first_block..`` of ``token_ids``'s
    chain at once (a reservation written whole and finished); returns how many were
    registered (0 when :func:`reserve_prefix` finds no room or another cached prefix)."""
    held = reserve_prefix(blocks, kv_cache, token_ids, first_block, len(payloads), cache_salt)
    if held is None:
        return 0
    try:
        for i, payload in enumerate(payloads):
            held.write(i, payload)
    except BaseException:
        held.release()
        raise
    return held.finish()
