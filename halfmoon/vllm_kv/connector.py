"""``HalfmoonConnector``: halfmoon's store and transfer engine as vLLM's v1 KV connector.

vLLM builds two of these per server (docs/vllm.md, "KV connector"): a *scheduler* half in
the engine core, which decides from a request's ``kv_transfer_params`` (see
:mod:`halfmoon.serve.vllm.pd`) what to load and what to send and tells the workers in
:class:`HalfmoonMetadata` each step, and a *worker* half next to the KV tensors, which owns
this instance's data plane: a :class:`~halfmoon.transfer.TransferEngine` (listening on the
configured ``host:port``), a DRAM :class:`~halfmoon.store.TieredStore` that peers pull
prefix blocks from, and an inbox region that decode-bound KV streams land in.

- **Prefill (sender)**: for a request with ``do_remote_decode``, the step that finishes
  its prompt sends layer ``l`` of all its blocks as soon as vLLM leaves layer ``l``
  (``save_kv_layer`` queues it; a sender thread streams it while layer ``l + 1``
  computes), then saves the prompt's full blocks to the store. ``request_finished``
  keeps the blocks (``True``) until the worker reports the send done, and returns the
  decode request's ``kv_transfer_params``.
- **Decode (receiver)**: a request with ``do_remote_prefill`` asks for all its prompt
  tokens beyond vLLM's own hit, loaded asynchronously: a loader thread waits for the
  session in the inbox and copies it into the request's blocks; vLLM recomputes only the
  last prompt token.
- **Remote prefix**: a request whose params name a ``source`` and ``cached_tokens`` pulls
  those blocks from the source's store by halfmoon's content hashes (so vLLM instances and
  halfmoon share one hash namespace) instead of computing them.

Failures never hang or corrupt: a stream or pull that fails is reported through
``get_block_ids_with_load_errors`` and vLLM recomputes those blocks (the connector is
started with ``kv_load_failure_policy = "recompute"``); a failed send frees the blocks.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from halfmoon.core.buffers import uninitialized
from halfmoon.core.hashing import chain_root, hash_blocks
from halfmoon.serve.runtime import load_secret
from halfmoon.serve.vllm.pd import KEY, ConnectorSettings
from halfmoon.store import StoreConfig, TieredStore
from halfmoon.store.meta import BlockMeta
from halfmoon.transfer import RemoteError, StreamLayout, StreamReceiver, TransferEngine
from halfmoon.transfer.inbox import Inbox
from halfmoon.vllm_kv.layout import (
    PagedLayout,
    check_config,
    read_block,
    write_block,
    write_blocks,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
INBOX = "inbox"
#: An inbox session nobody claimed for this long is dropped (its decode request never came).
UNCLAIMED_TTL_S = 120.0
#: How long a decode load waits for its stream to have been opened: the prefill opens it
#: while it computes, before its response, so a stream still missing was refused or lost.
ARRIVAL_WAIT_S = 5.0


@dataclass
class LoadJob:
    """Fill ``block_ids`` of request ``req_id``: from stream ``session`` (its blocks from
    ``first`` on) or from the store at ``source`` (``hashes``, one per block)."""

    req_id: str
    block_ids: list[int]
    session: str = ""
    first: int = 0
    source: str = ""
    hashes: list[int] = field(default_factory=list)


@dataclass
class SendJob:
    """Stream ``block_ids`` (the whole prompt) of ``req_id`` to ``decode`` as ``session``,
    then save the full blocks (``hashes``) to the store."""

    req_id: str
    session: str
    decode: str
    block_ids: list[int]
    num_tokens: int
    hashes: list[int]


@dataclass
class HalfmoonMetadata(KVConnectorMetadata):
    """One step's plan, scheduler -> workers."""

    loads: list[LoadJob] = field(default_factory=list)
    sends: list[SendJob] = field(default_factory=list)


@dataclass
class _Sender:
    session: str
    decode: str
    prompt: list[int]
    hashes: list[int]
    block_ids: list[int] = field(default_factory=list)
    started: bool = False


def store_hashes(
    prompt: list[int], cache_salt: str | None, block_size: int, hash_block_size: int
) -> list[int]:
    """halfmoon's content hash of each full vLLM block of ``prompt``: the chain hash of its
    last halfmoon block (so it covers every token before it, under the request's salt)."""
    chain = hash_blocks(prompt, hash_block_size, parent=chain_root(cache_salt))
    ratio = block_size // hash_block_size
    return [chain.hashes[(k + 1) * ratio - 1] for k in range(len(prompt) // block_size)]


class HalfmoonConnector(KVConnectorBase_V1):
    """halfmoon's KV connector for vLLM (see the module docstring)."""

    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.settings = ConnectorSettings.from_extra(extra)
        self.block_size = int(vllm_config.cache_config.block_size)
        check_config(vllm_config, kv_cache_config, self.settings.hash_block_size)
        self._scheduler = _SchedulerSide(self) if role == KVConnectorRole.SCHEDULER else None
        self._worker = _WorkerSide(self) if role == KVConnectorRole.WORKER else None

    # -- scheduler side --------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build(scheduler_output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.finished(request)

    # -- worker side -----------------------------------------------------------------------------
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:  # before the forward: a step's timings start here
            self._worker.step_started = time.monotonic()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_loads(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous and complete before their request is scheduled."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        assert self._worker is not None
        self._worker.layer_done(self._metadata(), layer_name)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.step_done(self._metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return self._worker.finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    def _metadata(self) -> HalfmoonMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HalfmoonMetadata)
        return meta


class _SchedulerSide:
    """Decides loads and sends from each request's ``kv_transfer_params``."""

    def __init__(self, owner: HalfmoonConnector) -> None:
        self.settings = owner.settings
        self.block_size = owner.block_size
        self._targets: dict[str, int] = {}  # tokens a request has once its load is in
        self._loads: list[LoadJob] = []
        self._loaded: dict[str, int] = {}
        self._senders: dict[str, _Sender] = {}

    def matched(self, request: Any, num_computed: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        entry = params.get(KEY) or {}
        prompt = request.prompt_token_ids or []
        target = 0
        if params.get("do_remote_prefill") and entry.get("session"):
            target = len(prompt)
        elif entry.get("source") and entry.get("source") != self.settings.endpoint:
            cached = min(int(entry.get("cached_tokens", 0)), len(prompt) - 1)
            target = max(cached, 0) // self.block_size * self.block_size
        if target - num_computed <= 0:
            return 0, False
        self._targets[request.request_id] = target
        return target - num_computed, True

    def allocated(self, request: Any, blocks: Any, num_external: int) -> None:
        rid = request.request_id
        params = request.kv_transfer_params or {}
        entry = params.get(KEY) or {}
        prompt = list(request.prompt_token_ids or [])
        if params.get("do_remote_decode") and entry.get("decode") and rid not in self._senders:
            hashes = store_hashes(
                prompt, request.cache_salt, self.block_size, self.settings.hash_block_size
            )
            self._senders[rid] = _Sender(
                str(entry["session"]), str(entry["decode"]), prompt, hashes
            )
        target = self._targets.pop(rid, 0)
        if num_external <= 0 or target <= 0:
            return
        ids = list(blocks.get_block_ids()[0])
        first, last = (
            (target - num_external) // self.block_size,
            math.ceil(target / self.block_size),
        )
        if params.get("do_remote_prefill"):
            self._loads.append(
                LoadJob(rid, ids[first:last], session=str(entry["session"]), first=first)
            )
            params["do_remote_prefill"] = False  # one transfer per request
        else:
            hashes = store_hashes(
                prompt[:target], request.cache_salt, self.block_size, self.settings.hash_block_size
            )
            self._loads.append(
                LoadJob(
                    rid, ids[first:last], source=str(entry["source"]), hashes=hashes[first:last]
                )
            )
        self._loaded[rid] = num_external

    def build(self, so: Any) -> HalfmoonMetadata:
        meta = HalfmoonMetadata(loads=self._loads)
        self._loads = []
        for new in so.scheduled_new_reqs:
            s = self._senders.get(new.req_id)
            if s is not None:
                s.block_ids = list(new.block_ids[0])
                self._maybe_send(
                    meta,
                    new.req_id,
                    s,
                    new.num_computed_tokens + so.num_scheduled_tokens[new.req_id],
                )
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            s = self._senders.get(rid)
            if s is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                s.block_ids = (
                    list(new_ids[0])
                    if rid in cached.resumed_req_ids
                    else s.block_ids + list(new_ids[0])
                )
            self._maybe_send(
                meta, rid, s, cached.num_computed_tokens[i] + so.num_scheduled_tokens[rid]
            )
        return meta

    def _maybe_send(
        self, meta: HalfmoonMetadata, rid: str, s: _Sender, computed_after: int
    ) -> None:
        """Send once the step computes the prompt's last token."""
        if s.started or computed_after < len(s.prompt):
            return
        s.started = True
        n = math.ceil(len(s.prompt) / self.block_size)
        meta.sends.append(
            SendJob(rid, s.session, s.decode, s.block_ids[:n], len(s.prompt), s.hashes)
        )

    def finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._targets.pop(rid, None)
        loaded = self._loaded.pop(rid, 0)
        s = self._senders.pop(rid, None)
        if s is None or not s.started:
            return False, None
        entry = {
            "session": s.session,
            "num_tokens": len(s.prompt),
            "streamed": True,
            "loaded_tokens": loaded,
        }
        # The blocks stay until the worker reports the send (and the store save) done.
        return True, {"do_remote_prefill": True, "do_remote_decode": False, KEY: entry}


@dataclass
class _Arrival:
    receiver: StreamReceiver
    start: int
    since: float = field(default_factory=time.monotonic)


class _WorkerSide:
    """Owns the data plane; moves bytes on two threads (sends, loads)."""

    def __init__(self, owner: HalfmoonConnector) -> None:
        self.settings = owner.settings
        self.block_size = owner.block_size
        self.layout: PagedLayout | None = None
        self.tensors: list[torch.Tensor] = []
        self.index: dict[str, int] = {}
        self.engine: TransferEngine | None = None
        self.store: TieredStore | None = None
        self.inbox: Inbox | None = None
        self._num_pool_blocks = owner._kv_cache_config.num_blocks if owner._kv_cache_config else 0
        self._arrivals: dict[str, _Arrival] = {}
        self._cond = threading.Condition()
        self._sends: queue.Queue[tuple[str, Any] | None] = queue.Queue()
        self._loads: queue.Queue[LoadJob | None] = queue.Queue()
        self._queued_layers: dict[str, int] = {}  # req -> layers queued this step
        self._pending_sends: set[str] = set()
        self._sent: set[str] = set()
        self._finished_reqs: set[str] = set()
        self._received: set[str] = set()
        self._load_errors: set[int] = set()
        self.step_started = time.monotonic()
        self._threads: list[threading.Thread] = []

    # -- set-up ----------------------------------------------------------------------------------
    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._num_pool_blocks or next(iter(kv_caches.values())).shape[0]
        layout = PagedLayout.of(kv_caches, num_blocks, self.block_size)
        self.layout = layout
        self.tensors = [kv_caches[name] for name in layout.layer_names]
        self.index = {name: i for i, name in enumerate(layout.layer_names)}
        s = self.settings
        self.store = TieredStore(StoreConfig(
            block_bytes=layout.block_bytes, dram_capacity_bytes=int(s.store_mb * 2**20),
            shared_dram=True,
        ))  # fmt: skip
        self.engine = TransferEngine(
            load_secret(), host=s.host, port=s.port, transport=s.transport, store=self.store,
            timeout_s=s.timeout_s, checksum=s.checksum,
        )  # fmt: skip
        self.engine.start()
        region = self.engine.register_region(INBOX, int(s.inbox_mb * 2**20), shared=True)
        self.inbox = Inbox(region.size_bytes)
        self.engine.accept_streams(self._place, self._accepted)
        for target, name in (
            (self._send_loop, "halfmoon-kv-send"),
            (self._load_loop, "halfmoon-kv-load"),
        ):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info(
            "halfmoon connector at %s: %d layers, %d-byte blocks, layout %s",
            self.engine.endpoint,
            layout.num_layers,
            layout.block_bytes,
            layout.fingerprint,
        )

    def _session(self, session: str) -> str:
        assert self.layout is not None
        return f"{self.layout.fingerprint}/{session}"

    def _place(
        self, wire_session: str, num_layers: int, num_blocks: int, block_bytes: int
    ) -> tuple[str, StreamLayout]:
        """Where an arriving stream lands in the inbox (refusing another layout)."""
        assert self.layout is not None and self.inbox is not None
        fingerprint = wire_session.split("/", 1)[0]
        mine = self.layout
        if fingerprint != mine.fingerprint or (num_layers, block_bytes) != (
            mine.num_layers,
            mine.layer_block_bytes,
        ):
            raise RemoteError(
                f"KV layout {fingerprint} ({num_layers} layers x {block_bytes} B) differs from this "
                f"instance's {mine.fingerprint} ({mine.num_layers} layers x {mine.layer_block_bytes} B)"
            )
        self._expire_unclaimed()
        size = num_layers * num_blocks * block_bytes
        start = self.inbox.alloc(size)
        if start is None:
            raise RemoteError(
                f"inbox full: no room for {size} bytes ({self.inbox.used_bytes} in use)"
            )
        return INBOX, StreamLayout.contiguous(
            num_layers, num_blocks, block_bytes, base_offset=start
        )

    def _accepted(self, receiver: StreamReceiver) -> None:
        start = receiver.layout.offsets[0]
        with self._cond:
            self._arrivals[receiver.session_id] = _Arrival(receiver, start)
            self._cond.notify_all()

    def _expire_unclaimed(self) -> None:
        assert self.inbox is not None
        now = time.monotonic()
        with self._cond:
            stale = [k for k, a in self._arrivals.items() if now - a.since > UNCLAIMED_TTL_S]
            for key in stale:
                arrival = self._arrivals.pop(key)
                arrival.receiver.cancel()
                self.inbox.free(arrival.start)

    # -- per step (model-runner thread) ---------------------------------------------------------
    def start_loads(self, meta: HalfmoonMetadata) -> None:
        for job in meta.loads:
            self._loads.put(job)

    def layer_done(self, meta: HalfmoonMetadata, layer_name: str) -> None:
        """vLLM left ``layer_name``: queue its blocks of every request sending this step."""
        layer = self.index.get(layer_name)
        if layer is None:
            return
        for job in meta.sends:
            self._queue_layers(job, layer + 1)

    def _queue_layers(self, job: SendJob, upto: int) -> None:
        done = self._queued_layers.get(job.req_id)
        if done is None:
            done = 0
            self._pending_sends.add(job.req_id)
            self._sends.put(("open", job))
        for layer in range(done, upto):
            self._sends.put(("layer", (job, layer, time.monotonic())))
        self._queued_layers[job.req_id] = max(done, upto)

    def step_done(self, meta: HalfmoonMetadata) -> None:
        """After the forward: queue any layer ``save_kv_layer`` did not see, then close."""
        assert self.layout is not None
        for job in meta.sends:
            self._queue_layers(job, self.layout.num_layers)
            self._sends.put(("end", (job, self.step_started, time.monotonic())))
            self._queued_layers.pop(job.req_id, None)

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._cond:
            self._finished_reqs |= finished_req_ids & (self._pending_sends | self._sent)
            sending = self._sent & self._finished_reqs
            self._sent -= sending
            self._finished_reqs -= sending
            received, self._received = self._received, set()
        return sending or None, received or None

    def take_load_errors(self) -> set[int]:
        with self._cond:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # -- the sender thread ----------------------------------------------------------------------
    def _send_loop(self) -> None:
        streams: dict[str, Any] = {}
        timing: dict[str, dict[str, float]] = {}
        while (item := self._sends.get()) is not None:
            kind, payload = item
            job = payload if kind == "open" else payload[0]
            try:
                if kind == "open":
                    streams[job.req_id] = self._open(job)
                    timing[job.req_id] = {"busy_s": 0.0}
                elif kind == "layer":
                    _, layer, queued = payload
                    tx = streams.get(job.req_id)
                    if tx is not None:
                        started = time.monotonic()
                        self._send_layer(tx, job, layer)
                        timing[job.req_id]["busy_s"] += time.monotonic() - started
                        timing[job.req_id]["last_queued"] = queued
                else:
                    _, step_started, step_done = payload
                    self._end(
                        job,
                        streams.pop(job.req_id, None),
                        timing.pop(job.req_id, {}),
                        step_started,
                        step_done,
                    )
            except Exception as exc:  # the stream failed: decode will recompute; free the blocks
                log.warning("KV send of %s (session %s) failed: %s", job.req_id, job.session, exc)
                tx = streams.pop(job.req_id, None)
                if tx is not None:
                    tx.cancel()
                if kind == "end":
                    self._send_finished(job.req_id)

    def _open(self, job: SendJob) -> Any:
        assert self.engine is not None and self.layout is not None
        client = self.engine.connect(job.decode)
        return client.open_stream(
            self._session(job.session), self.layout.num_layers, len(job.block_ids),
            self.layout.layer_block_bytes, wait_s=0.0,
        )  # fmt: skip

    def _send_layer(self, tx: Any, job: SendJob, layer: int) -> None:
        assert self.layout is not None
        tensor = self.tensors[layer]
        tx.send_layer(layer, [read_block(tensor, self.layout, b) for b in job.block_ids])

    def _end(
        self, job: SendJob, tx: Any, timing: dict[str, float], step_started: float, step_done: float
    ) -> None:
        streamed = 0
        if tx is not None:
            tx.finish()
            streamed = tx.num_layers * tx.num_blocks * tx.block_bytes
        finished = time.monotonic()
        saved = self._save(job)
        self._send_finished(job.req_id)
        if self.settings.stats_path:
            record = {
                "session": job.session, "num_tokens": job.num_tokens, "num_blocks": len(job.block_ids),
                "bytes_streamed": streamed, "blocks_saved": saved,
                "compute_s": step_done - step_started, "send_busy_s": timing.get("busy_s", 0.0),
                "exposed_s": max(0.0, finished - step_done), "stream_ok": tx is not None,
            }  # fmt: skip
            with open(self.settings.stats_path, "a") as out:
                out.write(json.dumps(record) + "\n")

    def _save(self, job: SendJob) -> int:
        """Put the prompt's full blocks (all layers) into the store; returns how many were new."""
        assert self.store is not None and self.layout is not None
        saved = 0
        parent = 0
        for k, block_hash in enumerate(job.hashes):
            if not self.store.contains(block_hash):
                payload = bytearray(self.layout.block_bytes)
                size = self.layout.layer_block_bytes
                for layer, tensor in enumerate(self.tensors):
                    payload[layer * size : (layer + 1) * size] = read_block(
                        tensor, self.layout, job.block_ids[k]
                    )
                meta = BlockMeta(self.block_size, parent, self.layout.store_version)
                self.store.put(block_hash, payload, meta, position=k)
                saved += 1
            parent = block_hash
        return saved

    def _send_finished(self, req_id: str) -> None:
        with self._cond:
            self._pending_sends.discard(req_id)
            self._sent.add(req_id)

    # -- the loader thread ----------------------------------------------------------------------
    def _load_loop(self) -> None:
        while (job := self._loads.get()) is not None:
            try:
                ok = self._load_stream(job) if job.session else self._load_store(job)
            except Exception as exc:
                log.warning("KV load of %s failed: %s", job.req_id, exc)
                ok = 0
            with self._cond:
                self._load_errors.update(job.block_ids[ok:])
                self._received.add(job.req_id)

    def _load_stream(self, job: LoadJob) -> int:
        assert self.engine is not None and self.layout is not None and self.inbox is not None
        key = self._session(job.session)
        opened_by = time.monotonic() + min(ARRIVAL_WAIT_S, self.settings.timeout_s)
        with self._cond:
            while key not in self._arrivals:
                if not self._cond.wait(max(0.0, opened_by - time.monotonic())):
                    raise TimeoutError(f"no KV stream {job.session!r} was opened")
            arrival = self._arrivals.pop(key)
        deadline = time.monotonic() + self.settings.timeout_s
        try:
            arrival.receiver.wait(max(0.1, deadline - time.monotonic()))
            layout = arrival.receiver.layout
            if job.first + len(job.block_ids) > layout.num_blocks:
                raise ValueError(
                    f"stream {job.session!r} has {layout.num_blocks} blocks, {job.first + len(job.block_ids)} needed"
                )
            view = self.engine.regions.get(INBOX).view
            span = len(job.block_ids) * layout.block_bytes
            for layer, tensor in enumerate(self.tensors):  # a layer's blocks lie back to back
                start = layout.offsets[layer * layout.num_blocks + job.first]
                write_blocks(tensor, self.layout, job.block_ids, view[start : start + span])
            return len(job.block_ids)
        finally:
            self.inbox.free(arrival.start)

    def _load_store(self, job: LoadJob) -> int:
        assert self.engine is not None and self.layout is not None
        buffers = [uninitialized(self.layout.block_bytes) for _ in job.hashes]
        metas = self.engine.connect(job.source).pull(job.hashes, buffers)
        loaded = 0
        for meta in metas:
            if meta is None or meta.layout_version != self.layout.store_version:
                break  # a prefix: stop at the first block the source lacks
            loaded += 1
        size = self.layout.layer_block_bytes
        for i in range(loaded):
            data = memoryview(buffers[i])
            for layer, tensor in enumerate(self.tensors):
                write_block(
                    tensor, self.layout, job.block_ids[i], data[layer * size : (layer + 1) * size]
                )
        if loaded < len(job.hashes):
            log.info(
                "pulled %d of %d prefix blocks of %s from %s",
                loaded,
                len(job.hashes),
                job.req_id,
                job.source,
            )
        return loaded

    def close(self) -> None:
        self._sends.put(None)
        self._loads.put(None)
        for thread in self._threads:
            thread.join(timeout=5)
        if self.engine is not None:
            self.engine.close()
        if self.store is not None:
            self.store.close()
