"""A prefill worker's cluster cache: its engine's prefix cache backed by a tiered store
(DRAM -> SSD) that other prefill workers can pull from.

- ``copy`` (``--prefix-store copy``, the default): after a prefill, every full prompt
  block the store lacks is copied out of the engine's pool into the store (one block =
  the engine's export layout of that block, ``[L, 2, 1, B, H_kv, D]``); the store's
  BlockStored / BlockEvicted events go to the Conductor, so its index follows the store.
- ``demote``: no copy after a prefill; a block goes to the store when the pool evicts it
  (:meth:`~halfmoon.engine.connector.EngineConnector.set_demote_hook`), so the pool and
  the store hold different blocks, not the same ones twice (blocks pulled from a peer
  for a prefill, too, go into the pool only). The pool's own events go to the Conductor
  too (:class:`Holdings` counts both sources), and a peer's pull of a block that lives
  only in the pool is served from the pool (:meth:`ClusterPrefixCache.read_for_peer`).
- Before a prefill, the longest prefix available — in the engine, then the local store,
  then (when the Conductor names another source) that worker's store through the
  transfer engine — is loaded into the engine's pool as *cached free blocks*, so the
  engine's own prefix matching picks it up and computes only the rest. Reads from the
  SSD tier and pulls from a peer run on a pull thread
  (:meth:`ClusterPrefixCache.begin_load`): the worker's loop keeps stepping the engine
  and answering commands meanwhile, and a slow disk or a slow or frozen peer delays only
  the requests that wait on it.

Blocks cross between engine and store as host bytes (the engine connector's
``block_bytes`` / ``seed_prefix``), whatever device the engine's pool is on. A request's ``cache_salt``
roots its hashes (:func:`~halfmoon.core.hashing.chain_root`), so its blocks are stored,
found and pulled only under its tenant's chain.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from halfmoon.core.buffers import uninitialized
from halfmoon.core.errors import HalfmoonError
from halfmoon.core.events import BlockStored, CacheEvent
from halfmoon.core.hashing import chain_root, hash_blocks
from halfmoon.serve.control.messages import HeldBlocks
from halfmoon.serve.control.protocol import hashes_to_wire
from halfmoon.serve.worker.kvstream import PEER_TIMEOUT_S
from halfmoon.serve.worker.main import PREFIX_STORE_POLICIES
from halfmoon.store import TIER_DRAM, BlockMeta, StoreConfig, StoreError, TieredStore
from halfmoon.store.meta import NO_NAMESPACE
from halfmoon.transfer import TransferEngine, TransferError, TransferTimeout

if TYPE_CHECKING:
    from halfmoon.engine.connector import EngineConnector, KVCodec, PrefixReservation

log = logging.getLogger(__name__)
#: A pull's deadline allows this many bytes per second on top of ``PEER_TIMEOUT_S``.
PULL_MIN_RATE = 100e6
#: Pulls from peers in flight at once per worker, each on its own thread.
PULL_THREADS = 4
#: Bytes of a prefix read from this worker's DRAM (or pool) on the caller's thread, the
#: worker's loop; past them the reads go to a pull thread, as SSD reads and pulls do (a
#: 128-block prefix of SmolLM2's float32 KV is 90 MiB, tens of milliseconds to copy).
INLINE_READ_BYTES = 4 << 20
#: A pull thread's result: the blocks it read from this worker, then those it pulled
#: (and put in this store).
FetchedRest = tuple[list[memoryview], list[memoryview]]


class PrefixFetch:
    """Blocks of a chain's continuation on their way in
    (:meth:`ClusterPrefixCache.begin_fetch`): ``local``, read at once, then the blocks of
    ``remote`` that a pull thread reads (from this worker's SSD) or pulls from a peer
    (``future``; None when nothing is left to fetch). The worker's loop checks
    :meth:`done` and takes the blocks with :meth:`ClusterPrefixCache.end_fetch`."""

    def __init__(
        self,
        local: list[memoryview],
        remote: Sequence[int] = (),
        future: Future[FetchedRest] | None = None,
    ) -> None:
        self.local = local
        self.remote = list(remote)
        self.future = future
        self.num_pulled = 0  # set by end_fetch

    def done(self) -> bool:
        """Whether the pull (if any) ended: succeeded, failed or timed out."""
        return self.future is None or self.future.done()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait up to ``timeout_s`` (None: until the pull's own deadline) for :meth:`done`."""
        if self.future is not None:
            futures_wait([self.future], timeout_s)
        return self.done()


@dataclass
class PrefixLoad:
    """A prompt's prefix on its way into the engine's pool
    (:meth:`ClusterPrefixCache.begin_load`): the pool held ``in_engine`` blocks of it when
    it began; ``fetch`` brings the blocks after those."""

    prompt_token_ids: list[int]
    cache_salt: str | None = None
    in_engine: int = 0
    fetch: PrefixFetch = field(default_factory=lambda: PrefixFetch([]))
    #: The pool blocks the fetched blocks are copied into as they arrive (None: the
    #: engine could not hold them, and they are seeded at the end).
    reservation: PrefixReservation | None = None


class Holdings:
    """Which blocks a worker holds, per tier, kept from the cache events of its store
    (this object is the store's listener) and, with ``demote``, of its engine's pool
    (:meth:`from_pool`), which it also forwards to the Conductor; :meth:`snapshot`
    re-announces them all (after the Conductor restarted).

    The pool and the store may hold the same block in the same tier (``dram``) while it
    is demoted: the Conductor hears a block arrive in a tier when its first source gets it
    and leave when no source holds it any more. Thread-safe: the store's events also come
    on the transfer threads that serve peers' pulls (an SSD block read moves to DRAM)."""

    def __init__(self, events: Any) -> None:
        self.events = events
        self.tiers: dict[int, dict[str, set[str]]] = {}  # hash -> tier -> sources
        self._lock = threading.Lock()

    def __call__(self, event: CacheEvent) -> None:
        """An event of the store."""
        self._heard(event, "store")

    def from_pool(self, event: CacheEvent) -> None:
        """An event of the engine's pool."""
        self._heard(event, "pool")

    def _heard(self, event: CacheEvent, source: str) -> None:
        with self._lock:
            self._count(event, source)

    def _count(self, event: CacheEvent, source: str) -> None:
        h, tier = event.block_hash, event.tier
        held = self.tiers.setdefault(h, {})
        sources = held.setdefault(tier, set())
        if isinstance(event, BlockStored):
            known = bool(sources)
            sources.add(source)
            if known:
                return  # already announced
        else:
            sources.discard(source)
            if sources:
                return  # the other source still holds it
            del held[tier]
        if not held:
            self.tiers.pop(h, None)
        self.events.cache_event(event)

    def snapshot(self) -> list[HeldBlocks]:
        """Every held block, one batch per tier."""
        by_tier: dict[str, list[int]] = {}
        with self._lock:
            for h, tiers in self.tiers.items():
                for tier in tiers:
                    by_tier.setdefault(tier, []).append(h)
        return [HeldBlocks(tier=t, hashes=hashes_to_wire(hs)) for t, hs in by_tier.items()]


class ClusterPrefixCache:
    """Moves prompt blocks between one engine, its store and peers' stores."""

    def __init__(
        self, engine: EngineConnector, store: TieredStore, events: Any, policy: str = "copy"
    ) -> None:
        """``policy``: ``copy`` or ``demote`` (see the module docstring); with ``demote``
        the engine's evictions come here and ``events`` (then the worker's
        :class:`Holdings`) also hears the pool's own cache events."""
        if policy not in PREFIX_STORE_POLICIES:
            raise ValueError(
                f"unknown prefix-store policy {policy!r}; use {' or '.join(PREFIX_STORE_POLICIES)}"
            )
        self.engine = engine
        self.store = store
        self.events = events
        self.policy = policy
        self.block_size = engine.layout.block_size
        self.num_blocks_loaded = 0
        self.num_blocks_pulled = 0
        self.num_blocks_demoted = 0
        self.num_blocks_read_for_peers = 0  # out of the pool (demote), by transfer threads
        #: The codec of blocks a peer sends compressed (``--kv-compression``; None: raw):
        #: a pulled block is decoded straight into its pool block where it can be.
        self.pull_codec: KVCodec | None = None
        self._stalled: dict[str, float] = {}  # peer endpoint -> skipped until (monotonic)
        self._pulls: ThreadPoolExecutor | None = None  # started at the first pull
        if policy == "demote" and engine.config.enable_prefix_caching:
            engine.set_demote_hook(self.demote)
            engine.set_cache_listener(events.from_pool)

    # -- demote: blocks leave the pool ----------------------------------------------------------
    def demote(
        self, block_hash: int, parent: int, position: int, payload: Callable[[], memoryview]
    ) -> None:
        """The pool evicts a cached block: keep it in the store (engine thread; copied
        out of the pool only when the store lacks it)."""
        if self.store.contains(block_hash):
            return
        try:
            self.store.put(block_hash, payload(), BlockMeta(self.block_size, parent), position)
            self.num_blocks_demoted += 1
        except StoreError as exc:  # full of pinned blocks: caching is best effort
            log.warning("store put of a demoted block failed: %s", exc)

    def read_for_peer(self, block_hash: int, dest: memoryview) -> BlockMeta | None:
        """A peer pulls a block the store lacks: copy it out of the engine's pool if it
        is cached there (a transfer thread; see ``read_cached_block``)."""
        found = self.engine.read_cached_block(block_hash)
        if found is None:
            return None
        parent, _position, payload = found
        dest[:] = payload
        self.num_blocks_read_for_peers += 1
        return BlockMeta(self.block_size, parent)

    @staticmethod
    def make_store(
        engine: EngineConnector,
        dram_mb: float,
        ssd_dir: str | None,
        ssd_mb: float,
        holdings: Holdings,
        ssd_namespace: bytes = NO_NAMESPACE,
    ) -> TieredStore:
        """A store sized in MiB whose events go through ``holdings`` to the Conductor;
        its SSD directory keyed by ``ssd_namespace`` (the model's fingerprint)."""
        config = StoreConfig(
            block_bytes=engine.kv_bytes_per_block,
            dram_capacity_bytes=int(dram_mb * 2**20),
            ssd_dir=ssd_dir,
            ssd_capacity_bytes=int(ssd_mb * 2**20) if ssd_dir else 0,
            ssd_namespace=ssd_namespace,
        )
        return TieredStore(config, listener=holdings)

    # -- after a prefill -------------------------------------------------------------------------
    def save(
        self, request_id: str, prompt_token_ids: Sequence[int], cache_salt: str | None = None
    ) -> int:
        """Copy the request's full prompt blocks the store lacks into it; returns how many
        (none when the engine runs without prefix caching, or with ``demote``: they go to
        the store when the pool evicts them)."""
        if not self.engine.config.enable_prefix_caching or self.policy == "demote":
            return 0
        parent = chain_root(cache_salt)
        hashes = hash_blocks(prompt_token_ids, self.block_size, parent).full
        saved = 0
        for i, h in enumerate(hashes):
            if not self.store.contains(h):
                payload = self.engine.block_bytes(request_id, i)  # a host copy
                try:
                    self.store.put(h, payload, BlockMeta(self.block_size, parent), position=i)
                    saved += 1
                except StoreError as exc:  # full of pinned blocks: caching is best effort
                    log.warning("store put failed: %s", exc)
                    break
            parent = h
        return saved

    # -- before a prefill --------------------------------------------------------------------------
    def load(
        self,
        prompt_token_ids: Sequence[int],
        source: TransferEngine | None = None,
        source_endpoint: str = "",
        cache_salt: str | None = None,
    ) -> int:
        """Make the longest available prefix (under ``cache_salt``) resident in the
        engine, waiting for any pull; returns the prompt's cached blocks there. (The
        worker's loop does not wait: :meth:`begin_load`, then :meth:`end_load` once done.)"""
        load = self.begin_load(prompt_token_ids, source, source_endpoint, cache_salt)
        load.fetch.wait()
        return self.end_load(load)

    def begin_load(
        self,
        prompt_token_ids: Sequence[int],
        source: TransferEngine | None = None,
        source_endpoint: str = "",
        cache_salt: str | None = None,
    ) -> PrefixLoad:
        """Start loading the longest available prefix: what the engine lacks is read
        from this store now and, past that, pulled from ``source_endpoint`` on a pull
        thread. The pool blocks it needs are held now (with the cached prefix they
        continue), so that each block is copied into the pool as soon as it is read or
        has arrived, on the thread that has it, not all at the end on the loop."""
        load = PrefixLoad(list(prompt_token_ids), cache_salt)
        if not self.engine.config.enable_prefix_caching:
            return load
        root = chain_root(cache_salt)
        hashes = list(hash_blocks(prompt_token_ids, self.block_size, root).full)
        # The block holding the prompt's last token is always recomputed by the engine.
        usable = min(len(hashes), (len(prompt_token_ids) - 1) // self.block_size)
        load.in_engine = self.engine.cached_prefix_blocks(prompt_token_ids, cache_salt)
        wanted = hashes[load.in_engine : usable]
        # As many blocks as can come: all of them from a peer (the Conductor saw it hold
        # them), else the run this store holds (holding more would evict for nothing).
        coming = len(wanted)
        if source is None or not source_endpoint:
            coming = next((i for i, h in enumerate(wanted) if not self.store.contains(h)), coming)
        if coming:
            load.reservation = self.engine.reserve_prefix(
                prompt_token_ids, load.in_engine, coming, cache_salt
            )
        # With demote, pulled blocks go into the pool only (and reach the store when the
        # pool evicts them), like the blocks this worker computes: none is kept twice.
        load.fetch = self.begin_fetch(
            wanted, source, source_endpoint, store_pulled=self.policy != "demote",
            into=load.reservation,
        )  # fmt: skip
        return load

    def end_load(self, load: PrefixLoad) -> int:
        """Seed a finished load's blocks into the engine's pool (the loop thread); returns
        the prompt's cached blocks there. With a reservation the blocks are in the pool
        already and are kept as cached now; without one they are copied in now, except
        blocks the pool gained meanwhile, and if it lost some of the prefix the load
        started from, the rest is dropped (a chain with a gap would not match)."""
        payloads = self.end_fetch(load.fetch)
        if not self.engine.config.enable_prefix_caching:
            return 0
        if load.reservation is not None:
            seeded = load.reservation.finish(len(payloads))
            self.num_blocks_loaded += seeded
            return self.engine.cached_prefix_blocks(load.prompt_token_ids, load.cache_salt)
        now = self.engine.cached_prefix_blocks(load.prompt_token_ids, load.cache_salt)
        skip = now - load.in_engine
        if not 0 <= skip < len(payloads):
            return now
        seeded = self.engine.seed_prefix(
            load.prompt_token_ids, now, payloads[skip:], load.cache_salt
        )
        self.num_blocks_loaded += seeded
        return now + seeded

    def fetch(
        self,
        hashes: Sequence[int],
        source: TransferEngine | None = None,
        source_endpoint: str = "",
    ) -> list[memoryview]:
        """Whole-block payloads of a leading run of ``hashes`` (a chain's continuation):
        from this store first, the rest pulled from ``source_endpoint``'s store (waits)."""
        fetch = self.begin_fetch(hashes, source, source_endpoint)
        fetch.wait()
        return self.end_fetch(fetch)

    def begin_fetch(
        self,
        hashes: Sequence[int],
        source: TransferEngine | None = None,
        source_endpoint: str = "",
        pool: bool = False,
        store_pulled: bool = True,
        into: PrefixReservation | None = None,
    ) -> PrefixFetch:
        """:meth:`fetch` without the wait: the first ``INLINE_READ_BYTES`` of the blocks
        this store holds in DRAM are read now (with ``pool``, a block the store lacks is
        read from the engine's pool if it is cached there: a pipeline stage's, whose own
        pool is not the engine's); past them, or from the first block that is only on
        SSD (milliseconds a block) or missing, the rest is read, and then pulled from
        ``source_endpoint`` (if named and not skipped as stalled), on a pull thread,
        which puts the pulled blocks in this store too (unless ``store_pulled`` is
        False). With ``into`` every block is also written into that reservation of the
        engine's pool (block ``i`` of ``hashes`` into its block ``i``) as soon as it is
        read or has arrived."""
        local: list[memoryview] = []
        inline = max(1, INLINE_READ_BYTES // self.engine.kv_bytes_per_block)
        for h in hashes:
            if len(local) == inline:
                break  # the rest is read on a pull thread
            tiers = self.store.tiers(h)
            if tiers and tiers[0] != TIER_DRAM:
                break  # on SSD only: read on a pull thread
            buf = self._read_local(h, in_store=bool(tiers), pool=pool)
            if buf is None:
                break  # not here (or evicted or corrupt meanwhile): stop at the gap
            _write(into, len(local), buf)
            local.append(buf)
        rest = list(hashes[len(local) :])
        remote = source is not None and bool(source_endpoint)
        remote = remote and not self._skipped(source_endpoint)
        more_here = bool(rest) and (len(local) == inline or self.store.contains(rest[0]))
        if not rest or not (remote or more_here):
            return PrefixFetch(local)
        future = self._pull_pool().submit(
            self._fetch_rest, rest, source if remote else None, source_endpoint, pool,
            store_pulled, into, len(local),
        )  # fmt: skip
        return PrefixFetch(local, rest, future)

    def end_fetch(self, fetch: PrefixFetch) -> list[memoryview]:
        """A finished fetch's payloads: read at once, read on the pull thread, pulled
        from the peer (the loop thread; the pull thread has put the pulled blocks in this
        store already: ~13 ms of copying for 90 MiB that the loop no longer does)."""
        if fetch.future is None:
            return fetch.local
        assert fetch.future.done(), "end_fetch() of a fetch still pulling"
        read, pulled = fetch.future.result()
        fetch.num_pulled = len(pulled)
        self.num_blocks_pulled += len(pulled)
        return fetch.local + read + pulled

    def _read_local(self, h: int, in_store: bool, pool: bool) -> memoryview | None:
        """Block ``h`` from this store (``in_store``: it may be there), else (``pool``)
        from the engine's pool; None when neither has it."""
        buf = uninitialized(self.engine.kv_bytes_per_block)
        if in_store and self.store.get_into(h, buf) is not None:
            return buf
        found = self.engine.read_cached_block(h) if pool else None
        if found is None:
            return None
        buf[:] = memoryview(found[2]).cast("B")
        return buf

    def _fetch_rest(
        self,
        hashes: list[int],
        transfer: TransferEngine | None,
        endpoint: str,
        pool: bool,
        store_pulled: bool = True,
        into: PrefixReservation | None = None,
        first: int = 0,
    ) -> FetchedRest:
        """A pull thread's part of a fetch: the leading blocks this worker holds (on SSD,
        or in the pool with ``pool``), then the rest pulled from ``endpoint`` (with a
        ``transfer`` engine; a failed pull is logged and gives nothing) and, with
        ``store_pulled``, put in this store, here rather than on the loop thread. With
        ``into``, each block is written into the reservation (``hashes[0]`` is its block
        ``first``) as it is read or arrives (a pulled one on the connection's thread)."""
        read: list[memoryview] = []
        for h in hashes:
            buf = self._read_local(h, in_store=True, pool=pool)
            if buf is None:
                break
            _write(into, first + len(read), buf)
            read.append(buf)
        rest = hashes[len(read) :]
        if transfer is None or not rest:
            return read, []
        arrived = take = None
        codec = self.pull_codec
        if into is not None:
            offset = first + len(read)

            def arrived(i: int, buf: memoryview) -> None:
                if not into.written(offset + i):  # (decoded into the pool already)
                    _write(into, offset + i, buf)

            if codec is not None and not store_pulled:
                # Nothing needs the decoded bytes but the pool: decode straight into it.
                def take(i: int, payload: memoryview) -> bool:
                    if offset + i >= into.num_blocks:
                        return False
                    into.write_encoded(offset + i, payload, codec)
                    return True

        try:
            blocks = self._pull(transfer, endpoint, rest, arrived, take)
        except TransferError as exc:
            log.warning("prefix pull from %s failed: %s", endpoint, exc)
            return read, []
        pulled: list[memoryview] = []
        for h, (meta, buf) in zip(rest, blocks, strict=True):
            if meta is None:  # the peer's run ends here: the rest would not chain
                break
            if store_pulled:
                try:
                    self.store.put(h, buf, meta)
                except StoreError:
                    pass  # still usable for this prefill
            pulled.append(buf)
        return read, pulled

    def _skipped(self, endpoint: str) -> bool:
        return time.monotonic() < self._stalled.get(endpoint, 0.0)

    def _pull(
        self,
        transfer: TransferEngine,
        endpoint: str,
        hashes: list[int],
        arrived: Callable[[int, memoryview], None] | None = None,
        take: Callable[[int, memoryview], bool] | None = None,
    ) -> list[tuple[BlockMeta | None, memoryview]]:
        """Pull ``hashes`` from a peer's store within a deadline (a pull thread); what a
        slow or frozen peer could not give, the engine computes. After a timeout the peer
        is skipped for ``PEER_TIMEOUT_S``, so a frozen peer costs one wait, not one per
        request (pulls queued behind it give up at once). ``arrived(i, buf)`` hears each
        block the peer had as soon as it is whole; ``take(i, payload)`` may decode an
        encoded one itself (then its buffer here is left undecoded)."""
        if self._skipped(endpoint):
            raise TransferError(f"{endpoint} is skipped after a timeout")
        dests = [uninitialized(self.engine.kv_bytes_per_block) for _ in hashes]
        timeout_s = PEER_TIMEOUT_S + len(hashes) * self.engine.kv_bytes_per_block / PULL_MIN_RATE
        try:
            on_block = None if arrived is None else lambda i: arrived(i, dests[i])
            decode = self.pull_codec.decode if self.pull_codec is not None else None
            metas = transfer.connect(endpoint).pull(
                hashes, dests, timeout_s=timeout_s, decode=decode, on_block=on_block,
                take_encoded=take,
            )  # fmt: skip
        except TransferTimeout:
            self._stalled[endpoint] = time.monotonic() + PEER_TIMEOUT_S
            raise
        return list(zip(metas, dests, strict=True))

    def _pull_pool(self) -> ThreadPoolExecutor:
        if self._pulls is None:
            self._pulls = ThreadPoolExecutor(PULL_THREADS, thread_name_prefix="prefix-pull")
        return self._pulls

    def close(self) -> None:
        """Stop the pull threads (pulls not begun are dropped; close the transfer engine
        first so that running ones fail at once)."""
        if self._pulls is not None:
            self._pulls.shutdown(wait=True, cancel_futures=True)
            self._pulls = None

    def begin_replicate(
        self, transfer: TransferEngine, endpoint: str, hashes: list[int]
    ) -> PrefixFetch:
        """Start copying blocks from a peer's store into ours (hot-spot replication): the
        ones this store lacks are pulled on a pull thread, and stored by :meth:`end_fetch`."""
        missing = [h for h in hashes if not self.store.contains(h)]
        return self.begin_fetch(missing, transfer, endpoint)


def _write(into: PrefixReservation | None, index: int, payload: memoryview) -> None:
    """Block ``index`` of a fetch into its reservation, if it holds a block for it (a
    block the store gained after the reservation was made has none: it is not seeded).
    A block the pool refuses (a payload of another size) is logged and left unwritten:
    the load then keeps the blocks before it, and the engine computes the rest."""
    if into is not None and index < into.num_blocks:
        try:
            into.write(index, payload)
        except HalfmoonError as exc:
            log.warning("a prefix block could not be seeded: %s", exc)
