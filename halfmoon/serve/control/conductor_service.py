"""The Conductor as a process: a ZeroMQ ROUTER socket in front of :class:`Conductor`.

Workers register themselves and stream events; the gateway asks for placements. Every
message is signed and typed (:mod:`halfmoon.serve.control.messages`): one whose signature
fails is dropped and counted, never answered; a signed one that does not fit its schema
is refused with an ``error`` when its sender waits for an answer (it has a ``msg_id``),
and logged either way. What it answers:

- ``register`` -> ``registered``, or ``refused`` with the ``error`` naming what disagrees
  with the cluster: its block size is the Conductor's config's (``block_size_tokens``),
  its model and dtype the first registered worker's (:meth:`ConductorService.refusal`)
- ``events``: a batch of block, lifecycle and load events (no reply)
- ``schedule`` (with the cluster's block size, else an ``error``) -> ``decision``: the
  placement with every endpoint the gateway and workers need, or a rejection with its
  ``reject_code`` (a RejectCode) and ``reject_reason`` text
- ``heartbeat``: no reply; ``register_again`` when the instance is unknown (e.g. after
  this process restarted: the worker then registers with a snapshot of the blocks it
  holds, which rebuilds the index), ``drain`` when it is draining
- ``metrics_query`` -> ``metrics_text``: its Prometheus metrics
  (:mod:`halfmoon.serve.control.conductor_metrics`)
- ``ping`` -> ``pong`` with the registered instances (and the draining ones) and the
  block-store counters their last load reports carried (``store_stats``)
- ``status_query`` -> ``cluster_status``: instances, Conductor state and latest decisions
  for the live cluster page (:mod:`halfmoon.serve.control.status`)
- ``workload_query`` -> ``workload_window``: the requests placed in the last seconds and
  what a simulation of the cluster needs, for live re-planning
  (:mod:`halfmoon.serve.control.workload`)
- ``drain`` -> ``draining``; the instance leaves placement but stays alive and known (its
  requests finish); its heartbeats are answered ``drain``, so the worker exits once it
  has no unfinished request (scale-down, :mod:`halfmoon.deploy`)
- ``release``, ``instance_failed``: no reply

An instance silent for ``heartbeat_timeout_s`` is dropped from placement until it
registers again. Replies echo the request's ``msg_id`` so asynchronous clients can match
them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import zmq

from halfmoon.conductor import (
    BlockEvicted,
    BlockStored,
    Conductor,
    Decision,
    DecodeStarted,
    FirstToken,
    LoadReport,
    PrefillFinished,
    PrefillStarted,
    RequestFinished,
)
from halfmoon.core.errors import HalfmoonError
from halfmoon.core.request import Request
from halfmoon.costmodel import CostProfile, ProfileCostModel
from halfmoon.costmodel.base import CostModel
from halfmoon.serve.control.conductor_metrics import ConductorMetrics, InstanceFigures
from halfmoon.serve.control.messages import (
    AdapterRecord,
    AdaptersOk,
    AdapterUpdate,
    BlockEvent,
    ClusterIdentity,
    ConductorPong,
    Drain,
    Draining,
    Endpoints,
    Error,
    Event,
    Events,
    FirstTokenSeen,
    Heartbeat,
    InstanceFailed,
    LifecycleEvent,
    LoadEvent,
    MalformedMessage,
    Member,
    Message,
    MetricsQuery,
    MetricsText,
    Ping,
    PlacementDecision,
    Refused,
    Register,
    RegisterAgain,
    Registered,
    Release,
    Replication,
    Schedule,
    StatusQuery,
    UpdateWeights,
    WeightsOk,
    WeightsRecord,
    WorkloadQuery,
    decode_message,
    encode_message,
)
from halfmoon.serve.control.protocol import ProtocolError, hashes_to_wire
from halfmoon.serve.control.status import cluster_status
from halfmoon.serve.control.workload import ArrivalLog, workload_window
from halfmoon.serve.runtime import RateLimitedLog, bind_router

log = logging.getLogger(__name__)
ROLES = ("prefill", "decode", "coupled")
_LIFECYCLE = {
    "prefill_started": PrefillStarted,
    "prefill_finished": PrefillFinished,
    "decode_started": DecodeStarted,
    "request_finished": RequestFinished,
}


@dataclass(frozen=True)
class InstanceEndpoints:
    """Where to reach one worker."""

    instance_id: str
    role: str
    command_endpoint: str
    transfer_endpoint: str
    incarnation: str = ""


def conductor_events(instance_id: str, entries: list[Event]) -> list[Any]:
    """Turn a worker's event batch into Conductor events."""
    out: list[Any] = []
    for entry in entries:
        if isinstance(entry, BlockEvent):
            cls = BlockStored if entry.kind == "stored" else BlockEvicted
            out += [cls(block_hash=h, tier=entry.tier, instance_id=instance_id)
                    for h in entry.block_hashes]  # fmt: skip
        elif isinstance(entry, LifecycleEvent):
            lifecycle = _LIFECYCLE[entry.kind]
            if lifecycle is PrefillFinished:
                out.append(PrefillFinished(instance_id, entry.request_id, entry.cached_tokens))
            else:
                out.append(lifecycle(instance_id=instance_id, request_id=entry.request_id))
        else:
            out.append(LoadReport(
                instance_id=instance_id, num_running=entry.num_running,
                context_tokens=entry.context_tokens, kv_used_tokens=entry.kv_used_tokens,
                kv_capacity_tokens=entry.kv_capacity_tokens,
                queued_prefill_tokens=entry.queued_prefill_tokens,
                spec_rows_per_seq=entry.spec_rows_per_seq,
                spec_tokens_per_step=entry.spec_tokens_per_step,
            ))  # fmt: skip
    return out


class ConductorService:
    """Serves one :class:`Conductor` on ``endpoint`` (e.g. ``tcp://127.0.0.1:5555``)."""

    def __init__(self, conductor: Conductor, secret: bytes, endpoint: str) -> None:
        self.conductor = conductor
        self.secret = secret
        self.instances: dict[str, InstanceEndpoints] = {}
        self._last_seen_s: dict[str, float] = {}
        #: Instances excluded from placement until they exit (scale-down).
        self.draining: set[str] = set()
        #: An instance silent for this long is dropped from placement (workers beat ~4/s).
        self.heartbeat_timeout_s = 3.0
        #: Bandwidth assumed between workers for remote prefixes (loopback TCP is ~1 GB/s+).
        self.link_bytes_per_s = 1e9
        self.num_auth_failures = 0
        #: LoRA adapters loaded while the cluster serves, by name (``adapter_update``).
        self.adapters: dict[str, AdapterRecord] = {}
        #: Adapters unloaded through this Conductor: a worker registering again before
        #: its unload arrives must not bring one back.
        self.unloaded_adapters: set[str] = set()
        #: Weights installed while the cluster serves (``update_weights``; None: those it
        #: started with): what a worker registering from now on installs first.
        self.weights: WeightsRecord | None = None
        #: Block-store counters per instance from its last load report (prefill workers).
        self.store_stats: dict[str, dict[str, int]] = {}
        #: Each instance's last load report (for the cluster page and ``/metrics``).
        self.last_load: dict[str, LoadEvent] = {}
        #: The latest placement decisions, newest last: (wall time, decision, seconds the
        #: Conductor took). Kept as objects; turned into maps only when someone asks.
        self.recent_decisions: deque[tuple[float, Decision, float]] = deque(maxlen=100)
        #: What every worker must compute with: block size (from the Conductor's config),
        #: model identity and dtype (None until the first worker declaring them registers).
        self.cluster = ClusterIdentity(block_size=conductor.config.block_size_tokens)
        #: Each registered instance's registration (its profile, KV pool: re-planning).
        self.registrations: dict[str, Register] = {}
        #: The disaggregated requests placed recently (``workload_query``: re-planning).
        self.arrivals = ArrivalLog()
        #: Its Prometheus metrics (``metrics_query``).
        self.metrics = ConductorMetrics(self._instance_figures)
        self._sock = bind_router(endpoint)
        self._rejections = RateLimitedLog(log)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def close(self) -> None:
        """Close the socket."""
        self._sock.close(0)

    def serve_forever(self, poll_ms: int = 100, stop: Any = None) -> None:
        """Handle messages until ``stop()`` returns true (or forever)."""
        while stop is None or not stop():
            if self._sock.poll(poll_ms):
                self.handle_one()
            self.expire_silent_instances()

    def seen_s_ago(self, iid: str) -> float:
        """Seconds since registered instance ``iid`` was last heard from."""
        return time.monotonic() - self._last_seen_s.get(iid, time.monotonic())

    def expire_silent_instances(self) -> list[str]:
        """Drop instances not heard from within ``heartbeat_timeout_s`` from placement
        (their blocks leave the index); they come back by registering again."""
        now = time.monotonic()
        dead = [
            iid for iid, seen in self._last_seen_s.items()
            if now - seen > self.heartbeat_timeout_s
        ]  # fmt: skip
        for iid in dead:
            log.warning(
                "%s silent for %.1fs: removed from placement", iid, now - self._last_seen_s[iid]
            )
            del self._last_seen_s[iid]
            self.instances.pop(iid, None)
            self.registrations.pop(iid, None)
            self.draining.discard(iid)
            self.conductor.remove_instance(iid)
        return dead

    def handle_one(self) -> None:
        """Receive and handle one message (blocking)."""
        frames = self._sock.recv_multipart(copy=True)
        identity, rest = frames[0], frames[1:]
        try:
            message = decode_message(rest, self.secret)
        except MalformedMessage as exc:  # signed, so a peer's bug: tell it if it waits
            self._rejections.warning("refused a control message: %s", exc)
            if exc.msg_id is not None:
                self._reply(identity, Error(error=str(exc)), exc.msg_id)
            return
        except ProtocolError as exc:
            self.num_auth_failures += 1
            self._rejections.warning("dropped a control message: %s", exc)
            return
        try:
            reply = self._dispatch(message)
        except (HalfmoonError, KeyError, TypeError, ValueError) as exc:
            if message.msg_id is None:  # nobody waits for an answer
                self._rejections.warning("%s failed: %s", message.wire_name, exc)
                return
            reply = Error(error=f"{type(exc).__name__}: {exc}")
        if reply is not None:
            self._reply(identity, reply, message.msg_id)

    def _reply(self, identity: bytes, reply: Message, msg_id: int | None) -> None:
        reply = dataclasses.replace(reply, msg_id=msg_id)
        self._sock.send_multipart([identity, *encode_message(reply, self.secret)])

    def _instance_figures(self) -> InstanceFigures:
        """Registered instances, the draining ones, index blocks and the cache-balancing
        state (for ``/metrics``)."""
        return InstanceFigures(
            roles={i: e.role for i, e in self.instances.items()},
            draining=frozenset(self.draining),
            index_blocks={i: self.conductor.index.num_held(i) for i in self.instances},
            balancing=dict(self.conductor.balancing),
            prefill_scale={i: c["scale"] for i, c in self.conductor.prefill_calibration.items()},
            ttft_lateness_s=self.conductor.ttft_lateness_s,
        )

    def integrity(self) -> str:
        """``ok``, or what :meth:`Conductor.check_integrity` found wrong."""
        try:
            self.conductor.check_integrity()
        except AssertionError as exc:
            return f"broken: {exc}"
        return "ok"

    def _dispatch(self, message: Message) -> Message | None:
        if isinstance(message, (Events, Heartbeat)):
            iid = message.instance_id
            if iid not in self.instances:
                # Unknown (restarted Conductor, or expired while stalled): ask it to register.
                return RegisterAgain() if isinstance(message, Heartbeat) else None
            self._last_seen_s[iid] = time.monotonic()
            if isinstance(message, Heartbeat):
                return Drain(instance_id=iid) if iid in self.draining else None
            for event in conductor_events(iid, message.events):
                self.conductor.handle(event)
            self._note_store_stats(iid, message.events)
            for entry in message.events:  # what finished requests generated, for replays
                if isinstance(entry, LifecycleEvent) and entry.num_output_tokens is not None:
                    self.arrivals.finished(entry.request_id, entry.num_output_tokens)
            return None
        if isinstance(message, InstanceFailed):
            self._instance_failed(message.instance_id, message.incarnation)
            return None
        if isinstance(message, Schedule):
            return self._schedule(message)
        if isinstance(message, Release):
            self.conductor.release(message.request_id)
            return None
        if isinstance(message, FirstTokenSeen):
            self.conductor.handle(FirstToken("", message.request_id))
            return None
        if isinstance(message, Register):
            return self._register(message)
        if isinstance(message, Drain):
            return self._drain(message.instance_id)
        if isinstance(message, MetricsQuery):
            return MetricsText(instance_id="conductor", role="conductor",
                               text=self.metrics.render())  # fmt: skip
        if isinstance(message, Ping):
            return self._pong()
        if isinstance(message, StatusQuery):
            return cluster_status(self, message.num_decisions)
        if isinstance(message, WorkloadQuery):
            return workload_window(self, message.window_s)
        if isinstance(message, AdapterUpdate):
            return self._adapter_update(message)
        if isinstance(message, UpdateWeights):
            return self._weights_update(message)
        raise ProtocolError(f"the Conductor does not take {message.wire_name!r} messages")

    def _adapter_update(self, message: AdapterUpdate) -> AdaptersOk:
        """Keep the cluster's list of LoRA adapters loaded while serving (a gateway loaded
        or unloaded one on every worker): what a worker registering from now on is given
        to load, and what every gateway learns from its pings."""
        if message.op == "load":
            self.adapters[message.adapter.name] = message.adapter
            self.unloaded_adapters.discard(message.adapter.name)
        else:
            self.adapters.pop(message.adapter.name, None)
            self.unloaded_adapters.add(message.adapter.name)
        return AdaptersOk(adapters=list(self.adapters.values()))

    def _weights_update(self, message: UpdateWeights) -> WeightsOk:
        """Keep (``record``) or tell (``query``) the weights installed while the cluster
        serves: a gateway installed them on every worker."""
        if message.op == "record":
            self.weights = message.weights
            assert self.weights is not None
            log.info("the cluster serves the weights of %s (version %s)", self.weights.path,
                     self.weights.version)  # fmt: skip
        elif message.op != "query":
            raise ProtocolError(f"the Conductor does not take update_weights {message.op!r}")
        return WeightsOk(weights=self.weights)

    def _pong(self) -> ConductorPong:
        return ConductorPong(
            instances={i: e.role for i, e in self.instances.items()},
            endpoints={i: e.command_endpoint for i, e in self.instances.items()},
            incarnations={i: e.incarnation for i, e in self.instances.items()},
            # What a gateway may place on by itself while this service is away.
            members={
                i: Member(role=e.role, **dataclasses.asdict(self._endpoints(i)))
                for i, e in self.instances.items()
                if i not in self.draining
            },
            draining=sorted(self.draining),
            integrity=self.integrity(),
            num_placements=self.conductor.num_placements,
            store_stats={i: s for i, s in self.store_stats.items() if i in self.instances},
            cluster=self.cluster,
            index_blocks={i: self.conductor.index.num_held(i) for i in self.instances},
            balancing=self.conductor.balancing,
            prefill_calibration=self.conductor.prefill_calibration,
            ttft_lateness_s=self.conductor.ttft_lateness_s,
            adapters=list(self.adapters.values()),
        )

    def _note_store_stats(self, iid: str, entries: list[Event]) -> None:
        """Keep ``iid``'s latest load report, and the store counters of the latest that
        carries them."""
        for entry in entries:
            if isinstance(entry, LoadEvent):
                self.last_load[iid] = entry
                if entry.store is not None:
                    self.store_stats[iid] = dict(entry.store)

    def _instance_failed(self, iid: str, incarnation: str) -> None:
        """A gateway could not use ``iid``: drop it from placement now rather than after
        the heartbeat timeout. A live worker's next heartbeat gets ``register_again``."""
        e = self.instances.get(iid)
        if e is None or (incarnation and e.incarnation != incarnation):
            return  # already gone, or already replaced by a new process
        log.warning("%s reported failed: removed from placement", iid)
        self._last_seen_s.pop(iid, None)
        del self.instances[iid]
        self.registrations.pop(iid, None)
        self.draining.discard(iid)
        self.conductor.remove_instance(iid)

    def _drain(self, iid: str) -> Draining:
        """Stop placing on ``iid`` but keep it known: the requests it holds finish (the
        gateway still sees its incarnation), and its heartbeats tell it to exit when idle."""
        if iid not in self.instances:
            raise HalfmoonError(f"unknown instance {iid!r}")
        if iid not in self.draining:
            log.info("%s draining: removed from placement", iid)
            self.draining.add(iid)
            self.conductor.remove_instance(iid)
        return Draining(instance_id=iid)

    def _register(self, message: Register) -> Registered | Refused:
        role, iid = message.role, message.instance_id
        if role not in ROLES:
            raise ProtocolError(f"unknown role {role!r}")
        refusal = self.refusal(message)
        if refusal is not None:
            log.error("refused %s %s: %s", role, iid, refusal)
            return Refused(instance_id=iid, error=refusal)
        # The first worker to declare them sets the cluster's model, dtype and compression.
        self.cluster = dataclasses.replace(
            self.cluster, model=self.cluster.model or message.model,
            dtype=self.cluster.dtype or message.dtype,
            kv_compression=self.cluster.kv_compression or message.kv_compression,
        )  # fmt: skip
        capacity = message.kv_capacity_tokens or None
        cost_model = self._cost_model(message, capacity)
        incarnation = message.incarnation
        old = self.instances.get(iid)
        if old is not None and old.incarnation != incarnation:
            # The worker restarted: what the old process held or ran is gone. (Forgotten
            # before the new process is added, which removing would undo.)
            log.warning("%s restarted: forgetting its previous state", iid)
            self.conductor.remove_instance(iid)
            self.store_stats.pop(iid, None)
            self.last_load.pop(iid, None)
            self.draining.discard(iid)
        if message.draining:
            self.draining.add(iid)  # a draining worker re-registering: keep it out
        elif role == "prefill":
            self.conductor.add_prefill_instance(iid, cost_model)
        elif role == "decode":
            self.conductor.add_decode_instance(iid, cost_model, kv_capacity_tokens=capacity)
        else:
            self.conductor.add_coupled_instance(iid, cost_model, kv_capacity_tokens=capacity)
        self.instances[iid] = InstanceEndpoints(
            iid, role, message.command_endpoint, message.transfer_endpoint, incarnation
        )
        self.registrations[iid] = dataclasses.replace(message, blocks=[])
        self._last_seen_s[iid] = time.monotonic()
        for held in message.blocks:  # what it already holds (re-registration)
            for h in held.block_hashes:
                self.conductor.handle(BlockStored(block_hash=h, tier=held.tier, instance_id=iid))
        self._adopt_adapters(iid, message.adapters)
        if self.weights is None and message.weights is not None:  # (this Conductor restarted)
            self.weights = message.weights
            log.info("weights installed while serving (%s, version %s) learned from %s",
                     message.weights.path, message.weights.version, iid)  # fmt: skip
        log.info("registered %s %s at %s", role, iid, message.command_endpoint)
        return Registered(instance_id=iid, tbt_slo_s=self.conductor.config.slo.tbt_s,
                          adapters=list(self.adapters.values()), weights=self.weights)  # fmt: skip

    def _adopt_adapters(self, iid: str, records: list[AdapterRecord]) -> None:
        """Take into the cluster's list the adapters a worker registering again loaded
        while serving, those this Conductor neither knows nor unloaded: after a restart
        of the Conductor, the list comes back from the workers (the first to name an
        adapter sets its tag)."""
        for record in records:
            if record.name in self.adapters or record.name in self.unloaded_adapters:
                continue
            self.adapters[record.name] = record
            log.info("LoRA adapter %r (loaded while serving) learned from %s", record.name, iid)

    def refusal(self, message: Register) -> str | None:
        """Why a registering worker cannot join (None: it agrees with the cluster). A worker
        with another block size would hash prompts its own way (no prefix hit, KV handed
        over in the wrong shape); another model or dtype would compute other KV, another KV
        compression would send its KV in a form the receiver does not expect."""
        problems = []
        for key, what in (("block_size", "block size"), ("model", "model"), ("dtype", "dtype"),
                          ("kv_compression", "KV compression")):  # fmt: skip
            got, want = getattr(message, key), getattr(self.cluster, key)
            if got is not None and want is not None and str(got) != str(want):
                problems.append(f"{what} {got!r} (the cluster's is {want!r})")
        if not problems:
            return None
        return f"{message.instance_id} disagrees with the cluster: " + "; ".join(problems)

    def _cost_model(self, message: Register, capacity: int | None) -> CostModel | None:
        """The worker's measured profile as a cost model (None: the Conductor's default)."""
        if not message.profile or message.kv_bytes_per_token <= 0:
            return None
        profile = CostProfile.from_dict(message.profile,
                                        source=f"profile of {message.instance_id}")  # fmt: skip
        return ProfileCostModel(
            profile, message.kv_bytes_per_token, self.link_bytes_per_s, capacity or 1,
            hidden_bytes_per_token=message.hidden_bytes_per_token or None,
        )  # fmt: skip

    def _schedule(self, message: Schedule) -> PlacementDecision:
        block_size = message.block_size
        if block_size != self.cluster.block_size:
            raise HalfmoonError(
                f"request hashed with {block_size}-token blocks; the cluster uses "
                f"{self.cluster.block_size} (--block-size of the gateway and the Conductor)"
            )
        request = Request(
            message.request_id,
            self.conductor.clock.now(),
            message.input_length,
            message.output_length,
            tuple(message.block_hashes),
            block_size,
            admitted=message.admitted,
            priority=message.priority,
            prefill_only=message.prefill_only,
        )
        start = time.perf_counter()
        if message.coupled:
            decision = self.conductor.route_coupled(request)
        elif message.admitted:  # placed again: not a new arrival
            decision = self.conductor.schedule(request)
        else:
            self.arrivals.record(message.input_length, message.output_length, message.hashes,
                                 request_id=message.request_id,
                                 prefill_only=message.prefill_only)  # fmt: skip
            decision = self.conductor.schedule(request)
        elapsed_s = time.perf_counter() - start
        self.recent_decisions.append((time.time(), decision, elapsed_s))
        self.metrics.observe_decision(decision, elapsed_s)
        log.debug("%s", decision.explain())
        return dataclasses.replace(self.decision_message(decision), decision_s=elapsed_s)

    def decision_message(self, decision: Decision) -> PlacementDecision:
        """The decision with the endpoints of every instance it names."""
        refused = PlacementDecision(
            accepted=decision.accepted, reject_reason=decision.reject_reason,
            reject_code=decision.reject_code, why=decision.why,
        )  # fmt: skip
        if not decision.accepted or decision.prefill is None:
            return refused
        chosen = decision.prefill
        decode = decision.decode  # (None: a prefill-only request)
        return dataclasses.replace(
            refused,
            prefill=self._endpoints(chosen.instance_id),
            decode=None if decode is None else self._endpoints(decode.instance_id),
            cache_source=self._endpoints(chosen.cache_source),
            cached_tokens=chosen.cached_tokens,
            est_ttft_s=chosen.ttft_s,
            replications=[
                Replication(
                    source=self._endpoints(p.source),
                    target=self._endpoints(p.target),
                    hashes=hashes_to_wire(p.block_hashes),
                    reason=p.reason,
                )
                for p in decision.replications
            ],
            # A CPP group: the stages in pipeline order.
            group=[self._endpoints(m) for m in chosen.group] if chosen.group else None,
            cpp_chunk_tokens=self.conductor.config.cpp_chunk_tokens if chosen.group else 0,
        )

    def _endpoints(self, instance_id: str) -> Endpoints:
        e = self.instances.get(instance_id)
        if e is None:
            return Endpoints(instance_id=instance_id, command="", transfer="")
        return Endpoints(instance_id=instance_id, command=e.command_endpoint,
                         transfer=e.transfer_endpoint, incarnation=e.incarnation)  # fmt: skip
