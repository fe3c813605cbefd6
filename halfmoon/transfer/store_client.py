"""The requesting side of store puts and pulls (the peer's side is
:mod:`halfmoon.transfer.store_service`).

Two ways to move a batch:

- **In parallel** (``tcp``, and large blocks over shared memory): the batch is cut into
  one group per connection and the groups run at once, each on its own link and thread.
  Large blocks are bound by copies, which run outside the GIL, so two copying threads
  keep two cores busy.
- **Pipelined on one link** (small blocks over shared memory): the batch is cut into
  groups of ``PIPELINE_GROUP_BLOCKS`` that follow each other on one connection, with the
  next group's request in flight while this one is copied::

      client: RESERVE 0, RESERVE 1 | copy 0, COMMIT 0, RESERVE 2 | copy 1, COMMIT 1, ...
      peer:   slots 0, slots 1 (while the client copies 0) | ack 0, slots 2 | ...

  A small block's cost is Python bookkeeping on both sides, not its copy. Run on two
  connections, the peer's two connection threads take turns on one GIL: a thread that
  sent a reply waits for the other's switch interval (5 ms) before it reads the next
  request, and the client waits with it. On one link each side runs one thread and the
  two processes overlap. Measured: benchmarks/dataplane/store.py, docs/benchmarks.md.

Encoded pulls (compressed KV over ``tcp``: the peer encodes every block it sends) run
in parallel *and* pipelined: each connection's group is cut into requests of about
``ENCODED_GROUP_BYTES`` of raw KV, ``PIPELINE_DEPTH`` ahead, so that the peer encodes
the next request while this one crosses the wire and is decoded here. Sent as one
request per connection, the peer's encoding, the wire and the decoding ran one after
the other (benchmarks/micro/prefix_pull.py).

Replies come in the order of the requests, so the pipelined client reads them from a
queue of what it sent. An error reply for one request closes the link (the peer aborts
the reservations it still holds when the connection ends) and raises.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from halfmoon.core.buffers import uninitialized
from halfmoon.core.errors import HalfmoonError
from halfmoon.store.meta import BlockMeta
from halfmoon.transfer.errors import ProtocolError
from halfmoon.transfer.handles import CancelFlag
from halfmoon.transfer.link import Link, as_bytes_view
from halfmoon.transfer.memcopy import copy_blocks, copy_out_blocks
from halfmoon.transfer.messages import PutBlock, meta_from_wire, put_items_to_wire
from halfmoon.transfer.pool import LinkPool, OutFrame, split_batch
from halfmoon.transfer.protocol import Frame, Kind, hashes_to_wire
from halfmoon.transfer.regions import SegmentCache
from halfmoon.transfer.store_service import SLOT_INLINE, SLOT_PRESENT, PullDecoder

#: Blocks up to this size move pipelined on one link over shared memory (see above).
PIPELINE_MAX_BLOCK_BYTES = 256 << 10
#: Blocks per pipelined request.
PIPELINE_GROUP_BLOCKS = 128
#: Pipelined requests sent ahead of the group being copied.
PIPELINE_DEPTH = 2
#: Raw bytes per request of an encoded pull (at least one block).
ENCODED_GROUP_BYTES = 4 << 20


class StoreClient:
    """Puts into and pulls from one peer's store over a :class:`LinkPool` (thread-safe).

    ``transport`` reads the pool's resolved transport (``tcp``, ``shm``, ``inproc``);
    ``next_id`` gives a fresh transfer id.
    """

    def __init__(
        self,
        links: LinkPool,
        segments: SegmentCache,
        transport: Callable[[], str],
        next_id: Callable[[], str],
    ) -> None:
        self._links = links
        self._segments = segments
        self._transport = transport
        self._next_id = next_id
        self.endpoint = links.endpoint

    # ------------------------------------------------------------ put
    def put_blocks(self, blocks: Sequence[PutBlock], deadline: float) -> int:
        """Store ``blocks`` in the peer's store; how many were new there."""
        if not blocks:
            return 0
        xfer = self._next_id()
        views = [as_bytes_view(b.payload) for b in blocks]
        block_bytes = views[0].nbytes
        if any(v.nbytes != block_bytes for v in views):
            raise ValueError("put payloads must all have the store's block size")
        if self._transport() != "tcp" and _pipelined(len(blocks), block_bytes):
            return self._put_pipelined(xfer, blocks, views, deadline)
        wire = put_items_to_wire(blocks)
        groups = split_batch([v.nbytes for v in views], self._links.num_connections)
        if self._transport() == "tcp":
            frames = [
                OutFrame(
                    Kind.PUT, {"xfer": xfer, "blocks": [wire[i] for i in g]}, [views[i] for i in g]
                )
                for g in groups
            ]
            self._links.send_frames(frames, Kind.PUT_ACK, deadline, CancelFlag(), xfer)
            return sum(int(f.acks[0]["stored"]) for f in frames)
        stored = [0] * len(groups)

        def job(k: int) -> Callable[[], None]:
            def run() -> None:
                g = groups[k]
                stored[k] = self._put_group(
                    f"{xfer}.{k}", wire[g.start : g.stop], views[g.start : g.stop], deadline
                )

            return run

        self._links.run_parallel([job(k) for k in range(len(groups))])
        return sum(stored)

    def _put_group(
        self, xfer: str, wire: list[list[Any]], views: list[memoryview], deadline: float
    ) -> int:
        """Reserve slots, copy into the shared arena, commit (inline for the rest)."""
        with self._links.borrowed(deadline) as link:
            request = {"xfer": xfer, "blocks": wire, "block_bytes": views[0].nbytes}
            link.send(Kind.PUT_RESERVE, request, deadline=deadline)
            slots = self._links.expect(link, Kind.PUT_SLOTS, deadline)
            inline = self._place(slots.meta, views)
            link.send(Kind.PUT_COMMIT, {"xfer": xfer}, inline, deadline)
            return int(self._links.expect(link, Kind.PUT_ACK, deadline).meta["stored"])

    def _put_pipelined(
        self, xfer: str, blocks: Sequence[PutBlock], views: list[memoryview], deadline: float
    ) -> int:
        """The put's groups one after another on one link, ``PIPELINE_DEPTH`` ahead (each
        group's request is encoded as it goes out, not all before the first)."""
        groups = _groups(len(blocks))
        with self._links.borrowed(deadline) as link:
            expected: deque[tuple[Kind, int]] = deque()  # replies due, in request order

            def reserve(k: int) -> None:
                g = groups[k]
                meta = {
                    "xfer": f"{xfer}.{k}",
                    "blocks": put_items_to_wire(blocks[g.start : g.stop]),
                    "block_bytes": views[0].nbytes,
                }
                link.send(Kind.PUT_RESERVE, meta, deadline=deadline)
                expected.append((Kind.PUT_SLOTS, k))

            ahead = min(PIPELINE_DEPTH, len(groups))
            for k in range(ahead):
                reserve(k)
            stored = 0
            while expected:
                kind, k = expected.popleft()
                reply = self._links.expect(link, kind, deadline)
                if reply.meta.get("xfer") != f"{xfer}.{k}":
                    raise ProtocolError(f"peer {self.endpoint} answered out of order")
                if kind == Kind.PUT_ACK:
                    stored += int(reply.meta["stored"])
                    continue
                g = groups[k]
                inline = self._place(reply.meta, views[g.start : g.stop])
                link.send(Kind.PUT_COMMIT, {"xfer": f"{xfer}.{k}"}, inline, deadline)
                expected.append((Kind.PUT_ACK, k))
                if ahead < len(groups):
                    reserve(ahead)
                    ahead += 1
            return stored

    def _place(self, reply: dict[str, Any], views: list[memoryview]) -> list[memoryview]:
        """Copy the blocks the peer gave slots in its shared arena; the rest, to send
        inline with the commit."""
        slots = reply.get("slots")
        if not isinstance(slots, list) or len(slots) != len(views):
            got = len(slots) if isinstance(slots, list) else "no"
            raise ProtocolError(f"peer {self.endpoint} reserved {got} of {len(views)} slots")
        inline: list[memoryview] = []
        placed: list[tuple[int, memoryview]] = []
        try:
            for offset, view in zip(slots, views, strict=True):
                if offset >= 0:
                    placed.append((offset, view))
                elif offset == SLOT_INLINE:
                    inline.append(view)
                elif offset != SLOT_PRESENT:
                    raise ValueError(f"unknown slot {offset}")
            if placed:  # slots reserved back to back take one copy (see copy_blocks)
                copy_blocks(self._segments.view(str(reply["segment"])), placed)
        except (TypeError, ValueError, KeyError, OSError) as exc:  # OSError: no such segment
            raise ProtocolError(f"peer {self.endpoint} reserved a bad slot: {exc}") from exc
        return inline

    # ------------------------------------------------------------ pull
    def pull(
        self,
        block_hashes: Sequence[int],
        dests: Sequence[object],
        deadline: float,
        decode: PullDecoder | None = None,
        on_block: Callable[[int], None] | None = None,
        take_encoded: TakeEncoded | None = None,
    ) -> list[BlockMeta | None]:
        """Read blocks of the peer's store into ``dests``; each one's metadata or None.
        ``on_block(i)`` is called (on the thread that received it, before this returns)
        as soon as block ``i`` is whole in ``dests[i]``, for every block the peer had.
        ``take_encoded(i, payload)`` sees each block that came encoded before ``decode``
        does; when it returns True it has decoded the block itself (wherever it keeps
        blocks) and ``dests[i]`` is left as it was (``on_block`` still hears it)."""
        hooks = _Hooks(on_block, take_encoded)
        if len(block_hashes) != len(dests):
            raise ValueError(f"{len(block_hashes)} hashes but {len(dests)} destination buffers")
        if not dests:
            return []
        if self._transport() != "tcp":
            decode = None  # blocks come through shared memory: nothing to save on the wire
        if len(dests) == 1:  # the latency-critical single read: no grouping, no threads
            return self._pull_group(
                [block_hashes[0]], [as_bytes_view(dests[0])], deadline, decode, hooks
            )
        views = [as_bytes_view(d) for d in dests]
        if len({v.nbytes for v in views}) > 1:
            raise ValueError("pull destinations must all have the store's block size")
        if self._transport() != "tcp" and _pipelined(len(views), views[0].nbytes):
            return self._pull_pipelined(list(block_hashes), views, deadline, hooks=hooks)
        results: list[BlockMeta | None] = [None] * len(views)

        # An encoded pull's groups are pipelined in requests of ENCODED_GROUP_BYTES.
        step = max(1, ENCODED_GROUP_BYTES // views[0].nbytes) if decode is not None else 0

        def pull_group(hashes: list[int], group: range):
            done = hooks.shifted(group.start)
            group_views = views[group.start : group.stop]
            if step and len(group_views) > step:
                return self._pull_pipelined(hashes, group_views, deadline, decode, step, done)
            return self._pull_group(hashes, group_views, deadline, decode, done)

        def job(group: range) -> Callable[[], None]:
            def run() -> None:
                hashes = [block_hashes[i] for i in group]
                metas = pull_group(hashes, group)
                for i, meta in zip(group, metas, strict=True):
                    results[i] = meta

            return run

        groups = split_batch([v.nbytes for v in views], self._links.num_connections)
        if len(groups) == 1:  # the common small pull: no thread hand-off
            return pull_group(list(block_hashes), range(len(views)))
        self._links.run_parallel([job(g) for g in groups])
        return results

    def _pull_group(
        self,
        block_hashes: list[int],
        views: list[memoryview],
        deadline: float,
        decode: PullDecoder | None = None,
        hooks: _Hooks | None = None,
    ) -> list[BlockMeta | None]:
        with self._links.borrowed(deadline) as link:
            xfer = self._send_pull(link, block_hashes, views[0].nbytes, deadline, decode)
            reply = self._links.expect(link, Kind.PULL_REPLY, deadline)
            if reply.meta.get("xfer") != xfer:
                raise ProtocolError(f"peer {self.endpoint} answered another pull")
            return self._finish_pull(link, reply, views, deadline, decode, hooks)

    def _pull_pipelined(
        self,
        block_hashes: list[int],
        views: list[memoryview],
        deadline: float,
        decode: PullDecoder | None = None,
        step: int = PIPELINE_GROUP_BLOCKS,
        hooks: _Hooks | None = None,
    ) -> list[BlockMeta | None]:
        """The pull's groups of ``step`` blocks one after another on one link,
        ``PIPELINE_DEPTH`` ahead (encoded with ``decode``)."""
        groups = _groups(len(views), step)
        block_bytes = views[0].nbytes
        with self._links.borrowed(deadline) as link:
            expected: deque[tuple[str, int]] = deque()  # (xfer, group) of replies due

            def request(k: int) -> None:
                g = groups[k]
                xfer = self._send_pull(
                    link, block_hashes[g.start : g.stop], block_bytes, deadline, decode
                )
                expected.append((xfer, k))

            ahead = min(PIPELINE_DEPTH, len(groups))
            for k in range(ahead):
                request(k)
            metas: list[BlockMeta | None] = []
            while expected:
                xfer, k = expected.popleft()
                reply = self._links.expect(link, Kind.PULL_REPLY, deadline)
                if reply.meta.get("xfer") != xfer:
                    raise ProtocolError(f"peer {self.endpoint} answered out of order")
                if ahead < len(groups):  # the peer reads the next group while we copy
                    request(ahead)
                    ahead += 1
                g = groups[k]
                shifted = hooks.shifted(g.start) if hooks is not None else None
                metas += self._finish_pull(
                    link, reply, views[g.start : g.stop], deadline, decode, shifted
                )
            return metas

    def _send_pull(
        self,
        link: Link,
        block_hashes: list[int],
        block_bytes: int,
        deadline: float,
        decode: PullDecoder | None = None,
    ) -> str:
        """Send one PULL request; its transfer id."""
        xfer = self._next_id()
        request = {
            "xfer": xfer,
            "hashes": hashes_to_wire(block_hashes),
            "direct": self._transport() != "tcp",  # blocks may be read in place
            "block_bytes": block_bytes,
        }
        if decode is not None:
            request["encoded"] = True  # the peer may encode (it has a pull encoder)
        link.send(Kind.PULL, request, deadline=deadline)
        return xfer

    def _finish_pull(
        self,
        link: Link,
        reply: Frame,
        views: list[memoryview],
        deadline: float,
        decode: PullDecoder | None = None,
        hooks: _Hooks | None = None,
    ) -> list[BlockMeta | None]:
        """Take a PULL_REPLY's blocks into ``views``: inline payloads, encoded ones, or
        copies out of the peer's shared arena (then RELEASE); each one's metadata.
        ``hooks`` hear each block once it is whole (see :meth:`pull`)."""
        items: list[list[Any]] = reply.meta["items"]
        if len(items) != len(views):
            raise ProtocolError(f"peer {self.endpoint} answered {len(items)} of {len(views)} pulls")
        metas: list[BlockMeta | None] = []
        inline: list[int] = []
        in_place: list[int] = []
        for i, item in enumerate(items):  # [False] | [True, meta] | [True, meta, offset]
            if not item[0]:
                metas.append(None)
                continue
            metas.append(meta_from_wire(item[1]))
            if len(item) == 3:  # in the peer's shared arena (reply["segment"]): copied below
                in_place.append(i)
            else:
                inline.append(i)
        if reply.meta.get("encoded"):
            picked = hooks.picked(inline) if hooks is not None else None
            self._recv_encoded(link, reply, [views[i] for i in inline], decode, deadline, picked)
            return metas
        link.recv_payload_into(reply, [views[i] for i in inline], deadline)
        if in_place:
            self._copy_in_place(link, reply, views, in_place, deadline)
        if hooks is not None and hooks.on_block is not None:
            for i in sorted(inline + in_place):
                hooks.on_block(i)
        return metas

    def _recv_encoded(
        self,
        link: Link,
        reply: Frame,
        dests: list[memoryview],
        decode: PullDecoder | None,
        deadline: float,
        hooks: _Hooks | None = None,
    ) -> None:
        """Receive encoded blocks (one payload each, sizes in the reply) and decode each
        into its destination, unless ``hooks.take_encoded`` takes it (then
        ``hooks.on_block`` hears its index)."""
        lengths = [int(n) for n in reply.meta.get("lengths", [])]
        if decode is None or len(lengths) != len(dests) or any(n <= 0 for n in lengths):
            link.close()  # an answer we cannot read: its payload's end is unknown
            raise ProtocolError(f"peer {self.endpoint} sent encoded blocks we did not ask for")
        payloads = [uninitialized(n) for n in lengths]
        link.recv_payload_into(reply, payloads, deadline)
        take = hooks.take_encoded if hooks is not None else None
        for k, (payload, dest) in enumerate(zip(payloads, dests, strict=True)):
            try:
                if take is None or not take(k, payload):
                    decode(payload, dest)
            except (HalfmoonError, ValueError) as exc:
                raise ProtocolError(
                    f"a block pulled from {self.endpoint} does not decode: {exc}"
                ) from exc
            if hooks is not None and hooks.on_block is not None:
                hooks.on_block(k)

    def _copy_in_place(
        self,
        link: Link,
        reply: Frame,
        views: list[memoryview],
        in_place: list[int],
        deadline: float,
    ) -> None:
        """Copy blocks out of the peer's shared arena (runs of slots as one copy, see
        :func:`copy_out_blocks`), then let the peer drop their lease."""
        try:
            items = reply.meta["items"]
            try:
                arena = self._segments.view(str(reply.meta["segment"]))
                copy_out_blocks(arena, [(items[i][2], views[i]) for i in in_place])
            except (TypeError, ValueError, KeyError, OSError) as exc:  # OSError: no segment
                raise ProtocolError(
                    f"peer {self.endpoint} pointed at a bad place in its arena: {exc}"
                ) from exc
        finally:
            link.send(Kind.RELEASE, {"xfer": reply.meta["xfer"]}, deadline=deadline)


#: ``take_encoded(i, payload) -> bool`` of :meth:`StoreClient.pull`.
TakeEncoded = Callable[[int, memoryview], bool]


class _Hooks:
    """A pull's per-block callbacks (see :meth:`StoreClient.pull`), with the indices of
    a slice of the pull mapped back to the whole pull's."""

    def __init__(
        self, on_block: Callable[[int], None] | None, take_encoded: TakeEncoded | None
    ) -> None:
        self.on_block = on_block
        self.take_encoded = take_encoded

    def _mapped(self, index: Callable[[int], int]) -> _Hooks:
        on_block, take = self.on_block, self.take_encoded
        return _Hooks(
            None if on_block is None else lambda k: on_block(index(k)),
            None if take is None else lambda k, payload: take(index(k), payload),
        )

    def shifted(self, start: int) -> _Hooks:
        """The hooks of the slice of the pull that begins at block ``start``."""
        return self if start == 0 else self._mapped(lambda k: start + k)

    def picked(self, indices: list[int]) -> _Hooks:
        """The hooks of the pull's blocks ``indices``, in that order."""
        return self._mapped(indices.__getitem__)


def _pipelined(num_blocks: int, block_bytes: int) -> bool:
    """Whether a co-located batch goes pipelined on one link (small blocks, and more
    than one group's worth)."""
    return num_blocks > PIPELINE_GROUP_BLOCKS and block_bytes <= PIPELINE_MAX_BLOCK_BYTES


def _groups(num_blocks: int, step: int = PIPELINE_GROUP_BLOCKS) -> list[range]:
    """Consecutive groups of ``step`` blocks."""
    return [range(start, min(start + step, num_blocks)) for start in range(0, num_blocks, step)]
