"""The gateway's connections to a cluster's processes (the Conductor and the workers):
one asyncio DEALER socket per peer, signed messages, and a receive task per socket that
routes each reply to the call that awaits it (by message id) or to its request's queue
(by request id; a decode step's ``batch`` is split up). :class:`ClusterLink` is the base
of :class:`~halfmoon.serve.gateway.cluster_client.ClusterBackend`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time

import zmq
import zmq.asyncio

from halfmoon.serve.control.messages import (
    Abort,
    Batch,
    ConductorPong,
    Error,
    MalformedMessage,
    Message,
    Ping,
    decode_message,
    encode_message,
)
from halfmoon.serve.control.protocol import ProtocolError
from halfmoon.serve.gateway.backend import BackendError

log = logging.getLogger("halfmoon.serve.gateway.cluster_client")


class WorkerLost(BackendError):
    """A worker holding the request died (or could not be reached): place it again.

    ``suspect`` names the worker to report to the Conductor, which drops it from placement
    until it registers again (a live worker's next heartbeat does that at once)."""

    def __init__(self, message: str, suspect: str = "") -> None:
        super().__init__(message)
        self.suspect = suspect


def reason_of(reply: Message) -> str:
    """What an unexpected answer says: an error's text, else the kind of message it is."""
    return reply.error if isinstance(reply, Error) else reply.wire_name


class Peer:
    """One DEALER connection and the task reading it."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.task: asyncio.Task | None = None


class ClusterLink:
    """Signed request/reply and streams with the Conductor at ``conductor_endpoint`` and
    with any worker, over sockets opened on first use; a subclass's :meth:`_watch` runs
    in the background from then on, until :meth:`close`."""

    def __init__(self, conductor_endpoint: str, secret: bytes) -> None:
        self.secret = secret
        self._conductor_endpoint = conductor_endpoint
        self._ctx: zmq.asyncio.Context | None = None
        self._peers: dict[str, Peer] = {}
        #: Each request's (attempt's) queue of the messages about it.
        self._queues: dict[str, asyncio.Queue] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._watcher: asyncio.Task | None = None
        self._conductor_seen_s = time.monotonic()

    async def _watch(self) -> None:
        """What runs in the background while the link is open (here: nothing)."""

    def _peer(self, endpoint: str) -> Peer:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        if self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch())
        peer = self._peers.get(endpoint)
        if peer is None:
            peer = self._peers[endpoint] = Peer(self._ctx, endpoint)
            peer.task = asyncio.get_running_loop().create_task(self._receive(peer))
        return peer

    async def _receive(self, peer: Peer) -> None:
        while True:
            frames = await peer.sock.recv_multipart()
            try:
                msg: Message = decode_message(frames, self.secret)
            except MalformedMessage as exc:  # fails the request (or call) it answers, if any
                log.warning("refused a reply: %s", exc)
                msg = Error(error=str(exc), request_id=exc.request_id, msg_id=exc.msg_id)
            except ProtocolError as exc:
                log.warning("dropped a reply: %s", exc)
                continue
            if msg.msg_id is not None and msg.msg_id in self._calls:
                fut = self._calls.pop(msg.msg_id)
                if not fut.done():
                    fut.set_result(msg)
                continue
            # A decode step's tokens for several requests come as one "batch" message.
            for item in msg.messages if isinstance(msg, Batch) else (msg,):
                queue = self._queues.get(getattr(item, "request_id", None) or "")
                if queue is not None:
                    queue.put_nowait(item)

    async def _send(self, endpoint: str, msg: Message) -> None:
        """Send one signed message; never waits. A peer that stopped reading (frozen) and
        whose queue is full fails the send: :class:`BackendError` for the Conductor,
        :class:`WorkerLost` for a worker (the request is placed again)."""
        try:
            await self._peer(endpoint).sock.send_multipart(
                encode_message(msg, self.secret), flags=zmq.NOBLOCK
            )
        except zmq.Again:
            if endpoint == self._conductor_endpoint:
                raise BackendError("the Conductor is not taking messages") from None
            raise WorkerLost(f"worker {endpoint} is not taking messages") from None

    async def _send_abort(self, endpoint: str, request_id: str) -> None:
        """Tell a worker to drop a request; dropped when it is not reading (frozen: the
        request's KV hand-off and tokens expire there on their own)."""
        with contextlib.suppress(WorkerLost):
            await self._send(endpoint, Abort(request_id=request_id))

    async def _call(self, endpoint: str, msg: Message, timeout_s: float) -> Message:
        msg_id = next(self._ids)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._calls[msg_id] = fut
        try:
            await self._send(endpoint, dataclasses.replace(msg, msg_id=msg_id))
            reply = await asyncio.wait_for(fut, timeout_s)
            if endpoint == self._conductor_endpoint:
                self._conductor_seen_s = time.monotonic()
            return reply
        except TimeoutError:
            raise BackendError(f"no answer from {endpoint} within {timeout_s:g}s") from None
        finally:
            self._calls.pop(msg_id, None)

    async def _ping(self, timeout_s: float) -> ConductorPong:
        """The Conductor's pong (BackendError when it does not answer, or not with one)."""
        pong = await self._call(self._conductor_endpoint, Ping(), timeout_s)
        if not isinstance(pong, ConductorPong):
            raise BackendError(f"the Conductor answered a ping with {pong}")
        return pong

    async def close(self) -> None:
        """Cancel receive tasks and close sockets."""
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        for peer in self._peers.values():
            if peer.task is not None:
                peer.task.cancel()
            peer.sock.close(0)
        self._peers.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def _tell_conductor(self, msg: Message) -> None:
        """Fire and forget; dropped (with a warning) when the Conductor is not reading."""
        try:
            await self._send(self._conductor_endpoint, msg)
        except BackendError as exc:
            log.warning("%s message not sent: %s", msg.wire_name, exc)
