"""The decode role: receives a request's KV streams (one per prefill worker, or one per
stage of a CPP group), imports the KV on the handoff and decodes in the continuous batch.
See :mod:`halfmoon.serve.worker.prefill` for the whole handoff."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.request import SamplingParams
from halfmoon.costmodel.decode_guard import REJECT, WAIT
from halfmoon.engine.connector import HandoffState, LayerSlice, RequestFailure
from halfmoon.serve.control.messages import Error, Expect, Handoff, HeldBlocks
from halfmoon.serve.worker.decode_guard import DecodeGuard, Held
from halfmoon.serve.worker.kvstream import PEER_TIMEOUT_S, num_blocks
from halfmoon.serve.worker.pipeline_job import kv_session
from halfmoon.serve.worker.process import IDLE_WAIT_S, Handler, Worker
from halfmoon.serve.worker.tokens import (
    HANDOFF_TIMEOUT_S,
    HANDOFF_TTFT_FACTOR,
    StreamClient,
    TokenStreaming,
)
from halfmoon.transfer import StreamLayout, StreamReceiver, TransferEngine, TransferError
from halfmoon.transfer.inbox import Inbox

log = logging.getLogger(__name__)

#: The decode role's inbox region: arriving KV streams land in ranges of it (in shared
#: memory unless the transport is tcp, so co-located prefill workers copy straight in).
INBOX = "kv-inbox"
#: With --kv-compression: where the payloads are decoded to (private memory, reused).
RAW_INBOX = "kv-raw-inbox"
#: A range of an abandoned stream goes back to the inbox only this long after: its sender
#: may still place one more layer before it learns of the cancellation.
INBOX_QUARANTINE_S = 2 * PEER_TIMEOUT_S
#: How long a handed-off request waits for its other streams (a CPP group's stages) to end.
STREAM_AFTER_HANDOFF_S = 10.0


@dataclass
class _Landing:
    """A request's range of an inbox, or (the inbox full) a region of its own: ``region``
    either way, ``offset`` / ``size`` in it."""

    region: str
    offset: int
    size: int
    inbox: Inbox | None

    @property
    def in_inbox(self) -> bool:
        """Whether the range belongs to an inbox (else the region is the request's)."""
        return self.inbox is not None

    def view(self, transfer: TransferEngine) -> memoryview:
        """The landing bytes."""
        return transfer.regions.get(self.region).view[self.offset : self.offset + self.size]


@dataclass
class _Expected:
    identity: bytes
    params: SamplingParams
    num_prompt_tokens: int
    #: Where the streams land: the KV in the export layout or, compressed, the payloads.
    landing: _Landing
    receivers: list[Any]
    #: With --kv-compression: where the payloads are decoded to (the export layout).
    raw: _Landing | None = None
    prefill_instance: str = ""
    cache_salt: str | None = None
    since_s: float = field(default_factory=time.monotonic)
    timeout_s: float = HANDOFF_TIMEOUT_S
    #: The handoff, once it came, and when; the request joins when its streams ended.
    handoff: Handoff | None = None
    handoff_s: float = 0.0


class DecodeRole(TokenStreaming):
    """Decode only: receives KV streams, continues requests, streams tokens.

    Streams land in the worker's inbox (:data:`INBOX`, ``inbox_bytes``; first fit, one
    range per request), a shared-memory region unless the transport is tcp: a prefill
    worker on the same host then copies each layer straight into it (the ``shm``
    transport; ``auto`` picks it) instead of sending it through a socket. A request that
    does not fit gets a region of its own (reached over the socket).

    ``guard`` (``--decode-guard``; None: off) decides at the handoff whether the request
    joins the batch, is refused or waits (:mod:`halfmoon.serve.worker.decode_guard`); a
    waiting request keeps its landed KV until it joins."""

    def __init__(
        self, worker: Worker, transfer: TransferEngine, inbox_bytes: int = 0,
        guard: DecodeGuard | None = None,
    ) -> None:  # fmt: skip
        super().__init__(worker)
        self.transfer = transfer
        self.guard = guard or DecodeGuard.off()
        # (read through the role: the worker sets its real guard after the profile loads)
        worker.metrics.add_guard(lambda: self.guard.stats())
        self.expected: dict[str, _Expected] = {}
        layout = worker.engine.layout
        self.bytes_per_block = layout.bytes_per_block
        self.num_layers = layout.num_layers
        codec = worker.kv_codec
        self.codec = None if codec is None or codec.name == "none" else codec
        #: Seconds the transfer threads spent decompressing KV (--kv-compression).
        self.kv_decode_s = 0.0
        self.inbox: Inbox | None = None
        self.raw_inbox: Inbox | None = None
        if inbox_bytes > 0:
            shared = transfer.transport in ("auto", "shm")
            try:
                region = transfer.register_region(INBOX, inbox_bytes, shared=shared)
            except HalfmoonError as exc:  # e.g. a small /dev/shm (containers: 64 MiB)
                log.warning("KV inbox not in shared memory (%s): co-located prefill "
                            "workers will send KV over the socket", exc)  # fmt: skip
                region = transfer.register_region(INBOX, inbox_bytes, shared=False)
            self.inbox = Inbox(region.size_bytes)
            if self.codec is not None:  # fresh buffers per request were page-faulted in
                raw = transfer.register_region(RAW_INBOX, inbox_bytes, shared=False)
                self.raw_inbox = Inbox(raw.size_bytes)
        #: (free at, inbox, offset): ranges of abandoned streams, in quarantine.
        self._quarantine: list[tuple[float, Inbox, int]] = []
        #: Requests whose streams landed in the inbox / in a region of their own.
        self.num_inbox_landings = 0
        self.num_private_landings = 0

    def handlers(self) -> dict[str, Handler]:
        return {"expect": self._on_expect, "handoff": self._on_handoff}

    def _land(self, name: str, size: int, inbox: Inbox | None, inbox_region: str) -> _Landing:
        """``size`` bytes in ``inbox`` when it has room, else a region ``name`` of its own."""
        start = inbox.alloc(size) if inbox is not None else None
        if start is not None:
            return _Landing(inbox_region, start, size, inbox)
        self.transfer.register_region(name, size)
        return _Landing(name, 0, size, None)

    def _release(self, landing: _Landing | None, abandoned: bool) -> None:
        """Give a range back; an abandoned stream's only after :data:`INBOX_QUARANTINE_S`
        (``tick`` frees it: a late layer may still land in it)."""
        if landing is None:
            return
        if landing.inbox is None:
            self.transfer.unregister_region(landing.region)
        elif abandoned:
            free_at = time.monotonic() + INBOX_QUARANTINE_S
            self._quarantine.append((free_at, landing.inbox, landing.offset))
        else:
            landing.inbox.free(landing.offset)

    def _on_expect(self, identity: bytes, msg: Expect) -> None:
        rid, num_prompt, num_stages = msg.request_id, msg.num_prompt_tokens, msg.num_stages
        n = num_blocks(num_prompt, self.worker.engine.config.block_size)
        slices = LayerSlice.split(self.num_layers, num_stages)  # one KV stream per stage
        half = self.bytes_per_block // (2 * self.num_layers)
        raw = None
        if self.codec is None:
            landing = self._land(f"kv-{rid}", n * self.bytes_per_block, self.inbox, INBOX)
        else:
            # One payload per stream layer, each in a slot of the largest size it may
            # have, decoded into ``raw`` (the export layout) as it lands.
            slot = self.codec.max_encoded_bytes(n * half)
            landing = self._land(f"kv-{rid}", 2 * self.num_layers * slot, self.inbox, INBOX)
        if landing.in_inbox:
            self.num_inbox_landings += 1
        else:
            self.num_private_landings += 1
        receivers = []
        try:
            if self.codec is not None:
                raw_name = f"kv-raw-{rid}"
                raw = self._land(raw_name, n * self.bytes_per_block, self.raw_inbox, RAW_INBOX)
            for s, layers in enumerate(slices):
                session = kv_session(rid, s, num_stages)
                if self.codec is None:
                    base = landing.offset + 2 * layers.first * n * half
                    layout = StreamLayout.contiguous(2 * layers.size, n, half, base_offset=base)
                    receiver = self.transfer.expect_stream(session, landing.region, layout)
                else:
                    base = landing.offset + 2 * layers.first * slot
                    layout = StreamLayout.contiguous(2 * layers.size, 1, slot, base_offset=base)
                    decode = functools.partial(
                        self._decode_layer, raw, landing.region, 2 * layers.first, n * half
                    )
                    receiver = self.transfer.expect_stream(session, landing.region, layout, decode)
                receivers.append(receiver)
        except Exception:
            for receiver in receivers:
                receiver.cancel()
            self._release(landing, bool(receivers))
            self._release(raw, bool(receivers))
            raise
        self.expected[rid] = _Expected(
            identity,
            msg.params.to_params(),
            num_prompt,
            landing,
            receivers,
            raw,
            msg.prefill_instance,
            msg.cache_salt,
            timeout_s=HANDOFF_TIMEOUT_S + HANDOFF_TTFT_FACTOR * msg.est_ttft_s,
        )

    def _decode_layer(
        self, raw: _Landing, wire_region: str, first: int, raw_bytes: int,
        receiver: StreamReceiver, layer: int,
    ) -> None:  # fmt: skip
        """Decode stream layer ``first + layer`` (on the transfer thread, as it lands)."""
        assert self.codec is not None
        index = first + layer
        slot = receiver.layout.block_bytes
        start = receiver.layout.offsets[layer]
        try:
            payload = self.transfer.regions.get(wire_region).view
            payload = payload[start : start + receiver.lengths(layer)[0]]
            out = raw.view(self.transfer)
            started = time.perf_counter()
            self.codec.decode(payload, out[index * raw_bytes : (index + 1) * raw_bytes])
            self.kv_decode_s += time.perf_counter() - started
        except HalfmoonError as exc:  # a bad payload, or the request went away (aborted)
            receiver.fail(TransferError(f"stream layer {index} ({slot}-byte slot): {exc}"))

    def _on_handoff(self, identity: bytes, msg: Handoff) -> None:
        rid = msg.request_id
        e = self.expected.get(rid)
        if e is None:
            return  # aborted meanwhile
        e.handoff, e.handoff_s = msg, time.monotonic()
        self._after_streams(rid, e)

    def _after_streams(self, rid: str, e: _Expected) -> None:
        """A handed-off request whose streams all ended joins the batch (or is held, or
        refused, by the guard). A CPP group's other stages may still be streaming when
        the last one hands off: then the request waits for them in ``expected`` (tick()
        looks again; the loop does not wait), and fails if a stream failed or is not
        done ``STREAM_AFTER_HANDOFF_S`` after the handoff."""
        error = next((r.error for r in e.receivers if r.error is not None), None)
        if error is None and not all(r.done for r in e.receivers):
            if time.monotonic() - e.handoff_s <= STREAM_AFTER_HANDOFF_S:
                return
            error = f"KV stream not done {STREAM_AFTER_HANDOFF_S:g}s after the handoff"
        del self.expected[rid]
        if error is not None:  # the stream failed: the client must hear of it
            self._fail(rid, e, str(error), abandoned=True)
            return
        msg = e.handoff
        assert msg is not None
        context_tokens = len(msg.token_ids)  # prompt + the first token, once it joins
        verdict, step_s = self.guard.check(context_tokens)
        if verdict == REJECT:
            self._fail(rid, e, self.guard.refusal(self.worker.me.instance_id, step_s))
        elif verdict == WAIT:
            deadline_s = time.monotonic() + e.timeout_s
            self.guard.hold(Held(rid, context_tokens, deadline_s, (e, msg)))
        else:
            self._join(rid, e, msg)

    def _fail(self, rid: str, e: _Expected, error: str, abandoned: bool = False) -> None:
        """The request ends here: its client hears ``error``, the Conductor that it
        finished (its booking released); its landing goes back."""
        self._release(e.landing, abandoned)
        self._release(e.raw, abandoned)
        self.end_failed(e.identity, rid, error)

    def _join(self, rid: str, e: _Expected, msg: Handoff) -> None:
        """Import the landed KV: the request joins the engine's batch."""
        try:
            state = HandoffState(
                request_id=rid, token_ids=tuple(msg.token_ids),
                num_prompt_tokens=msg.num_prompt_tokens,
                num_computed_tokens=msg.num_computed_tokens, seed=msg.seed,
                cache_salt=e.cache_salt,
            )  # fmt: skip
            kv = (e.landing if e.raw is None else e.raw).view(self.transfer)
            # The bytes are copied into the pool before this returns.
            self.worker.engine.import_request(state, e.params, kv)
        except Exception as exc:  # no room: the client must hear of it
            self._fail(rid, e, str(exc))
            return
        self.worker.metrics.observe_kv_received(self._wire_bytes(e))
        self.worker.metrics.request_joined(rid)
        self._release(e.landing, abandoned=False)
        self._release(e.raw, abandoned=False)
        self.clients[rid] = StreamClient(e.identity, [], index=1)
        self.guard.joined(rid, len(msg.token_ids))
        self.worker.conductor.event("decode_started", request_id=rid)

    def _wire_bytes(self, e: _Expected) -> int:
        """Bytes a request's streams brought: its whole landing, or with --kv-compression
        the payloads' lengths (each shorter than its slot)."""
        if self.codec is None:
            return e.landing.size
        return sum(sum(r.lengths(layer)) for r in e.receivers
                   for layer in range(r.layout.num_layers))  # fmt: skip

    def on_outputs(self, outputs: list[Any]) -> None:
        for out in outputs:
            client = self.clients.get(out.request_id)
            if client is None:
                continue
            self.send_tokens(out.request_id, client, out, out.finish_reason, batch=True)
            self.guard.advanced(out.request_id, len(out.new_token_ids))
            if out.finished:
                del self.clients[out.request_id]
                self.worker.metrics.request_finished(out.request_id, len(out.token_ids))
                self.guard.left(out.request_id)
                self.worker.conductor.event("request_finished", request_id=out.request_id,
                                            num_output_tokens=len(out.token_ids))  # fmt: skip
        self.flush_tokens()

    def on_failure(self, failure: RequestFailure) -> None:
        """A request failed in the engine (a step it was part of failed): its client
        hears the error (retryable: the gateway places it again with the tokens it had)."""
        rid = failure.request_id
        self.worker.metrics.request_dropped(rid)
        self.guard.left(rid)
        client = self.clients.pop(rid, None)
        if client is None:
            return
        log.warning("request %s: %s", rid, failure.error)
        self.end_failed(client.identity, rid, failure.error, retryable=failure.retryable)

    def on_abort(self, request_id: str) -> None:
        self.worker.metrics.request_dropped(request_id)
        e = self.expected.pop(request_id, None)
        if e is not None:
            for receiver in e.receivers:
                receiver.cancel()
            self._release(e.landing, abandoned=True)
            self._release(e.raw, abandoned=True)
        held = self.guard.left(request_id)
        if held is not None:  # its KV had landed: nothing more can arrive
            landed, _ = held.payload
            self._release(landed.landing, abandoned=False)
            self._release(landed.raw, abandoned=False)
        self.clients.pop(request_id, None)
        if self.worker.engine.abort_request(request_id) or e is not None or held is not None:
            self.worker.conductor.event("request_finished", request_id=request_id)

    def has_work(self) -> bool:
        """Whether a handed-off request waits for the end of a stream (a KV stream still
        on its way before its handoff needs no loop turns: the handoff wakes the loop)."""
        return any(e.handoff is not None for e in self.expected.values())

    def num_pending(self) -> int:
        """Requests whose KV is still on its way, or held back by the guard."""
        return len(self.expected) + len(self.guard.held)

    def tick(self) -> None:
        """Join held requests that now fit, fail those held too long; expire expectations
        whose handoff never came (the prefill side died); give quarantined inbox ranges
        back."""
        while (held := self.guard.ready()) is not None:
            self._join(held.request_id, *held.payload)
        for held in self.guard.expired():
            self._fail(held.request_id, held.payload[0],
                       self.guard.expiry(self.worker.me.instance_id, held))  # fmt: skip
        now = time.monotonic()
        while self._quarantine and self._quarantine[0][0] <= now:
            _, inbox, offset = self._quarantine.pop(0)
            inbox.free(offset)
        for rid, e in list(self.expected.items()):
            if e.handoff is not None:
                self._after_streams(rid, e)
        waiting = [e for e in self.expected.values() if e.handoff is not None]
        if waiting and not self.worker.engine.has_unfinished_requests():
            # Nothing to decode: wake the moment the stream ends, not a poll later.
            receiver = next((r for r in waiting[0].receivers if not r.done), None)
            if receiver is not None:
                with contextlib.suppress(TransferError):  # _after_streams reports it next tick
                    receiver.wait(IDLE_WAIT_S)
        for rid in [r for r, e in self.expected.items()
                    if e.handoff is None and now - e.since_s > e.timeout_s]:  # fmt: skip
            e = self.expected[rid]
            self.worker.send(e.identity, Error(
                request_id=rid, error=f"no KV handoff within {e.timeout_s:.0f}s",
                retryable=True, suspect=e.prefill_instance,
            ))  # fmt: skip
            self.on_abort(rid)

    def stats(self) -> dict[str, Any]:
        """Requests waiting for their KV; where streams landed; time spent decompressing;
        the TBT guard's refusals and waits."""
        return {
            "num_expected": len(self.expected), "kv_decode_s": round(self.kv_decode_s, 6),
            "kv_inbox_landings": self.num_inbox_landings,
            "kv_private_landings": self.num_private_landings,
            "kv_inbox_used_bytes": self.inbox.used_bytes if self.inbox is not None else 0,
            **self.guard.stats(),
        }  # fmt: skip

    def snapshot(self) -> list[HeldBlocks]:
        """A decode worker caches nothing the Conductor indexes."""
        return []

    def close(self) -> None:
        self.transfer.close()
