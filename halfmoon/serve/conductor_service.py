"""The Conductor as a process: a ZeroMQ ROUTER socket in front of :class:`Conductor`.

Workers register themselves and stream events; the gateway asks for placements. Every
message is signed (:mod:`halfmoon.serve.protocol`); a message that fails to verify is
dropped and counted, never answered. Messages (``type``):

- ``register``: instance_id, role (prefill | decode | coupled), command_endpoint,
  transfer_endpoint, kv_capacity_tokens, and what the worker computes with: block_size,
  model (identity), dtype -> ``registered``, or ``refused`` with the ``error`` naming
  what disagrees with the cluster: its block size is the Conductor's config's
  (``block_size_tokens``), its model and dtype the first registered worker's
  (:meth:`ConductorService.refusal`)
- ``events``: a batch of lifecycle / block events (no reply)
- ``schedule``: request_id, input_length, output_length, block_size (the cluster's, else
  an ``error``), hashes (packed) -> ``decision`` (the placement with every endpoint the
  gateway and workers need, or a rejection with its ``reject_code``, a RejectCode, and
  its ``reject_reason`` text)
- ``heartbeat``: instance_id (no reply; ``register_again`` when the instance is unknown,
  e.g. after this process restarted — the worker then registers with a snapshot of the
  blocks it holds, which rebuilds the index)
- ``ping`` -> ``pong`` with the registered instances (and the draining ones) and the
  block-store counters their last load reports carried (``store_stats``, for ``/metrics``)
- ``drain``: instance_id -> ``draining``; the instance leaves placement but stays alive
  and known (its requests finish); its heartbeats are answered ``drain``, so the worker
  exits once it has no unfinished request (scale-down, :mod:`halfmoon.deploy`)
An instance silent for ``heartbeat_timeout_s`` is dropped from placement until it
registers again.
Replies echo the request's ``msg_id`` so asynchronous clients can match them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import zmq

from halfmoon.conductor import (
    BlockEvicted,
    BlockStored,
    Conductor,
    Decision,
    DecodeStarted,
    LoadReport,
    PrefillFinished,
    PrefillStarted,
    RequestFinished,
)
from halfmoon.core.errors import HalfmoonError
from halfmoon.core.request import Request
from halfmoon.costmodel import CostProfile, ProfileCostModel
from halfmoon.costmodel.base import CostModel
from halfmoon.serve.protocol import ProtocolError, decode, encode, hashes_from_wire, hashes_to_wire
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


def events_from_wire(instance_id: str, items: list[dict[str, Any]]) -> list[Any]:
    """Turn a worker's event batch into Conductor events."""
    out: list[Any] = []
    for item in items:
        kind = item.get("kind")
        if kind in ("stored", "evicted"):
            cls = BlockStored if kind == "stored" else BlockEvicted
            tier = str(item.get("tier", "dram"))
            out += [cls(instance_id, h, tier) for h in hashes_from_wire(item["hashes"])]
        elif kind in _LIFECYCLE:
            out.append(_LIFECYCLE[kind](instance_id, str(item["request_id"])))
        elif kind == "load":
            fields = {
                k: int(item.get(k, 0))
                for k in (
                    "num_running",
                    "context_tokens",
                    "kv_used_tokens",
                    "kv_capacity_tokens",
                    "queued_prefill_tokens",
                )
            }
            out.append(LoadReport(instance_id, **fields))
        else:
            raise ProtocolError(f"unknown event kind {kind!r}")
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
        #: Block-store counters per instance from its last load report (prefill workers).
        self.store_stats: dict[str, dict[str, int]] = {}
        #: What every worker must compute with: block size (from the Conductor's config),
        #: model identity and dtype (None until the first worker declaring them registers).
        self.cluster: dict[str, Any] = {
            "block_size": conductor.config.block_size_tokens, "model": None, "dtype": None,
        }  # fmt: skip
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
            self.draining.discard(iid)
            self.conductor.remove_instance(iid)
        return dead

    def handle_one(self) -> None:
        """Receive and handle one message (blocking)."""
        frames = self._sock.recv_multipart(copy=True)
        identity, rest = frames[0], frames[1:]
        try:
            message = decode(rest, self.secret)
        except ProtocolError as exc:
            self.num_auth_failures += 1
            self._rejections.warning("dropped a control message: %s", exc)
            return
        try:
            reply = self._dispatch(message)
        except (HalfmoonError, KeyError, TypeError, ValueError) as exc:
            reply = {"type": "error", "error": f"{type(exc).__name__}: {exc}"}
        if reply is not None:
            reply["msg_id"] = message.get("msg_id")
            self._sock.send_multipart([identity, *encode(reply, self.secret)])

    def _integrity(self) -> str:
        """``ok``, or what :meth:`Conductor.check_integrity` found wrong."""
        try:
            self.conductor.check_integrity()
        except AssertionError as exc:
            return f"broken: {exc}"
        return "ok"

    def _dispatch(self, message: dict[str, Any]) -> dict[str, Any] | None:
        kind = message["type"]
        iid = message.get("instance_id")
        if kind in ("events", "heartbeat") and iid is not None:
            if str(iid) not in self.instances:
                # Unknown (restarted Conductor, or expired while stalled): ask it to register.
                return {"type": "register_again"} if kind == "heartbeat" else None
            self._last_seen_s[str(iid)] = time.monotonic()
            if kind == "heartbeat":
                return {"type": "drain"} if str(iid) in self.draining else None
        if kind == "events":
            for event in events_from_wire(str(message["instance_id"]), message["events"]):
                self.conductor.handle(event)
            self._note_store_stats(str(message["instance_id"]), message["events"])
            return None
        if kind == "instance_failed":
            self._instance_failed(str(message["instance_id"]), str(message.get("incarnation", "")))
            return None
        if kind == "schedule":
            return self._schedule(message)
        if kind == "release":
            self.conductor.release(str(message["request_id"]))
            return None
        if kind == "register":
            return self._register(message)
        if kind == "drain":
            return self._drain(str(message["instance_id"]))
        if kind == "ping":
            return {
                "type": "pong",
                "instances": {i: e.role for i, e in self.instances.items()},
                "endpoints": {i: e.command_endpoint for i, e in self.instances.items()},
                "incarnations": {i: e.incarnation for i, e in self.instances.items()},
                # What a gateway may place on by itself while this service is away.
                "members": {
                    i: {**self._endpoints(i), "role": e.role}
                    for i, e in self.instances.items()
                    if i not in self.draining
                },
                "draining": sorted(self.draining),
                "integrity": self._integrity(),
                "num_placements": self.conductor.num_placements,
                "store_stats": {i: s for i, s in self.store_stats.items() if i in self.instances},
                "cluster": dict(self.cluster),
            }
        raise ProtocolError(f"unknown message type {kind!r}")

    def _note_store_stats(self, iid: str, items: list[dict[str, Any]]) -> None:
        """Keep the store counters of ``iid``'s latest load report that carries them."""
        for item in items:
            store = item.get("store") if item.get("kind") == "load" else None
            if isinstance(store, dict):
                self.store_stats[iid] = {str(k): int(v) for k, v in store.items()}

    def _instance_failed(self, iid: str, incarnation: str) -> None:
        """A gateway could not use ``iid``: drop it from placement now rather than after
        the heartbeat timeout. A live worker's next heartbeat gets ``register_again``."""
        e = self.instances.get(iid)
        if e is None or (incarnation and e.incarnation != incarnation):
            return  # already gone, or already replaced by a new process
        log.warning("%s reported failed: removed from placement", iid)
        self._last_seen_s.pop(iid, None)
        del self.instances[iid]
        self.draining.discard(iid)
        self.conductor.remove_instance(iid)

    def _drain(self, iid: str) -> dict[str, Any]:
        """Stop placing on ``iid`` but keep it known: the requests it holds finish (the
        gateway still sees its incarnation), and its heartbeats tell it to exit when idle."""
        if iid not in self.instances:
            raise HalfmoonError(f"unknown instance {iid!r}")
        if iid not in self.draining:
            log.info("%s draining: removed from placement", iid)
            self.draining.add(iid)
            self.conductor.remove_instance(iid)
        return {"type": "draining", "instance_id": iid}

    def _register(self, message: dict[str, Any]) -> dict[str, Any]:
        role = message["role"]
        if role not in ROLES:
            raise ProtocolError(f"unknown role {role!r}")
        iid = str(message["instance_id"])
        refusal = self.refusal(message)
        if refusal is not None:
            log.error("refused %s %s: %s", role, iid, refusal)
            return {"type": "refused", "instance_id": iid, "error": refusal}
        for key in ("model", "dtype"):  # the first worker to declare them sets the cluster's
            if self.cluster[key] is None and message.get(key) is not None:
                self.cluster[key] = str(message[key])
        capacity = int(message.get("kv_capacity_tokens") or 0) or None
        cost_model = self._cost_model(message, capacity)
        incarnation = str(message.get("incarnation", ""))
        old = self.instances.get(iid)
        if old is not None and old.incarnation != incarnation:
            # The worker restarted: what the old process held or ran is gone. (Forgotten
            # before the new process is added, which removing would undo.)
            log.warning("%s restarted: forgetting its previous state", iid)
            self.conductor.remove_instance(iid)
            self.store_stats.pop(iid, None)
            self.draining.discard(iid)
        if message.get("draining"):
            self.draining.add(iid)  # a draining worker re-registering: keep it out
        elif role == "prefill":
            self.conductor.add_prefill_instance(iid, cost_model)
        elif role == "decode":
            self.conductor.add_decode_instance(iid, cost_model, kv_capacity_tokens=capacity)
        else:
            self.conductor.add_coupled_instance(iid, cost_model, kv_capacity_tokens=capacity)
        self.instances[iid] = InstanceEndpoints(
            iid,
            role,
            str(message["command_endpoint"]),
            str(message["transfer_endpoint"]),
            incarnation,
        )
        self._last_seen_s[iid] = time.monotonic()
        for item in message.get("blocks", []):  # what it already holds (re-registration)
            for h in hashes_from_wire(item["hashes"]):
                self.conductor.handle(BlockStored(iid, h, str(item.get("tier", "dram"))))
        log.info("registered %s %s at %s", role, iid, message["command_endpoint"])
        return {"type": "registered", "instance_id": iid}

    def refusal(self, message: dict[str, Any]) -> str | None:
        """Why a registering worker cannot join (None: it agrees with the cluster). A worker
        with another block size would hash prompts its own way (no prefix hit, KV handed
        over in the wrong shape); another model or dtype would compute other KV."""
        problems = []
        for key, what in (("block_size", "block size"), ("model", "model"), ("dtype", "dtype")):
            got, want = message.get(key), self.cluster[key]
            if got is not None and want is not None and str(got) != str(want):
                problems.append(f"{what} {got!r} (the cluster's is {want!r})")
        if not problems:
            return None
        return f"{message.get('instance_id')} disagrees with the cluster: " + "; ".join(problems)

    def _cost_model(self, message: dict[str, Any], capacity: int | None) -> CostModel | None:
        """The worker's measured profile as a cost model (None: the Conductor's default)."""
        data = message.get("profile")
        kv_bytes = int(message.get("kv_bytes_per_token") or 0)
        if not data or kv_bytes <= 0:
            return None
        profile = CostProfile.from_dict(data, source=f"profile of {message['instance_id']}")
        hidden_bytes = int(message.get("hidden_bytes_per_token") or 0) or None
        return ProfileCostModel(
            profile, kv_bytes, self.link_bytes_per_s, capacity or 1,
            hidden_bytes_per_token=hidden_bytes,
        )  # fmt: skip

    def _schedule(self, message: dict[str, Any]) -> dict[str, Any]:
        block_size = int(message["block_size"])
        if block_size != self.cluster["block_size"]:
            raise HalfmoonError(
                f"request hashed with {block_size}-token blocks; the cluster uses "
                f"{self.cluster['block_size']} (--block-size of the gateway and the Conductor)"
            )
        request = Request(
            str(message["request_id"]),
            self.conductor.clock.now(),
            int(message["input_length"]),
            int(message["output_length"]),
            tuple(hashes_from_wire(message["hashes"])),
            block_size,
        )
        start = time.perf_counter()
        if message.get("coupled"):
            decision = self.conductor.route_coupled(request)
        else:
            decision = self.conductor.schedule(request)
        elapsed_s = time.perf_counter() - start
        log.debug("%s", decision.explain())
        reply = self.decision_to_wire(decision)
        reply["decision_s"] = elapsed_s
        return reply

    def decision_to_wire(self, decision: Decision) -> dict[str, Any]:
        """The decision with the endpoints of every instance it names."""
        reply: dict[str, Any] = {
            "type": "decision",
            "accepted": decision.accepted,
            "reject_reason": decision.reject_reason,
            "reject_code": decision.reject_code,
            "why": decision.why,
        }
        if not decision.accepted or decision.prefill is None or decision.decode is None:
            return reply
        chosen = decision.prefill
        reply.update(
            prefill=self._endpoints(chosen.instance_id),
            decode=self._endpoints(decision.decode.instance_id),
            cache_source=self._endpoints(chosen.cache_source),
            cached_tokens=chosen.cached_tokens,
            est_ttft_s=chosen.ttft_s,
            replications=[
                {
                    "source": self._endpoints(p.source),
                    "target": self._endpoints(p.target),
                    "hashes": hashes_to_wire(p.block_hashes),
                    "reason": p.reason,
                }
                for p in decision.replications
            ],
        )
        if chosen.group:  # a CPP group: the stages in pipeline order
            reply["group"] = [self._endpoints(m) for m in chosen.group]
            reply["cpp_chunk_tokens"] = self.conductor.config.cpp_chunk_tokens
        return reply

    def _endpoints(self, instance_id: str) -> dict[str, str]:
        e = self.instances.get(instance_id)
        if e is None:
            return {"instance_id": instance_id, "command": "", "transfer": "", "incarnation": ""}
        return {
            "instance_id": instance_id,
            "command": e.command_endpoint,
            "transfer": e.transfer_endpoint,
            "incarnation": e.incarnation,
        }
