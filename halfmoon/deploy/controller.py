"""The deployment's controller: a detached, named Ray actor that owns every other actor.

``halfmoon serve --ray`` creates it (named ``--deployment-name``, namespace ``halfmoon``)
and asks it to :meth:`Controller.start`; ``halfmoon cluster scale|status|stop`` and the
gateway's ``/admin`` routes find it by name. It is the one place that knows the pools::

    driver / CLI / gateway /admin ──► Controller ──► ConductorHost  (halfmoon conductor)
                                          │   ├────► WorkerHost × N (halfmoon worker)
                                          │   └────► GatewayHost    (OpenAI API)
                                          └── drain ──► Conductor service ("drain")

Scaling down drains: the worker's actor is told its exit is expected, the Conductor
stops placing on it and tells it (through its heartbeat) to exit once idle; a thread here
waits for that exit (at most ``drain_timeout_s``), then ends the actor.

Surviving its own death and the gateway's:

- every actor it starts is detached, so none shares its fate; Ray restarts the controller
  itself (``max_restarts=-1``), and the new one rebuilds its view in :meth:`recover` from
  its persisted record (:mod:`halfmoon.deploy.record`: pools, next indexes, bundles, the
  Conductor's endpoint, where the gateway serves) checked against the live named actors:
  a recorded worker that is gone is dropped, a live one not recorded is adopted, drains
  in progress are resumed. Nothing that runs is stopped or started again.
- a thread here checks the gateway every second and restarts it when its actor died
  (``ray.kill``, a SIGKILL, its node) or it stopped serving, pinned to the node and host
  it had and on the same port, so the URL ``serve`` printed stays valid. Ray's own
  ``max_restarts`` is not used for the gateway: ``ray.kill`` (``no_restart=True`` by
  default) bypasses it, Ray would run the constructor again on any feasible node (another
  host, another URL, with the default ``--host``), and a gateway whose server failed
  while its process lives would never be noticed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace
from typing import Any

from halfmoon.core.errors import HalfmoonError
from halfmoon.deploy.actors import ConductorHost, GatewayHost, WorkerHost
from halfmoon.deploy.options import NAMESPACE, DeploySpec
from halfmoon.deploy.plan import DRAINING, Pools, WorkerRecord
from halfmoon.deploy.record import (
    actor_was_restarted,
    deployment_actors,
    load_record,
    named_actor,
    named_placement_group,
    node_alive,
    remove_leftovers,
    save_record,
)
from halfmoon.serve.control.messages import (
    ConductorPong,
    Drain,
    Draining,
    Error,
    Message,
    Ping,
    decode_message,
    encode_message,
)
from halfmoon.serve.runtime import SECRET_ENV, load_secret

log = logging.getLogger("deploy")

#: How often the controller checks the gateway, and how long an unanswered check may last
#: before the gateway counts as hung (a dead actor is restarted at once).
GATEWAY_CHECK_S = 1.0
GATEWAY_HUNG_S = 30.0


def call_conductor(endpoint: str, secret: bytes, msg: Message, timeout_s: float = 5.0
                   ) -> Message:  # fmt: skip
    """One signed request to the Conductor service and its reply."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart(encode_message(replace(msg, msg_id=1), secret))
        if not sock.poll(int(timeout_s * 1000)):
            raise HalfmoonError(f"the Conductor at {endpoint} did not answer in {timeout_s:g}s")
        return decode_message(sock.recv_multipart(), secret)
    finally:
        sock.close(0)


class Controller:
    """Starts, scales, reports on and stops one deployment (runs as a Ray actor)."""

    def __init__(self, spec: DeploySpec) -> None:
        self.spec = spec
        self.pools = Pools(spec.mode)
        self._lock = threading.RLock()
        self._workers: dict[str, Any] = {}
        self._conductor: Any = None
        self._gateway: Any = None
        #: {"host", "node_id"} the gateway serves on: a restarted one goes back there.
        self._gateway_at: dict[str, str] = {}
        self._pg: Any = None
        self.conductor_endpoint = ""
        self.gateway_url = ""
        self.gateway_restarts = 0
        self._env = {"env_vars": {SECRET_ENV: os.environ[SECRET_ENV]}}
        self._stopping = threading.Event()
        self._watching = False
        self.restarted = actor_was_restarted()
        if self.restarted:  # Ray restarted this actor: the deployment runs on without it
            self.recover()

    # -- start ---------------------------------------------------------------------------------
    def start(self) -> dict[str, Any]:
        """Reserve, place and start every process; returns the gateway's URL."""
        import ray

        spec, cfg = self.spec, self.spec.config
        timeout_s = spec.gateway.startup_timeout_s
        with self._lock:
            self._reserve(timeout_s)
            self._conductor = ray.remote(ConductorHost).options(
                name=cfg.actor_name("conductor"), **self._control_options(),
            ).remote(spec.conductor_json, spec.log_level)  # fmt: skip
            self.conductor_endpoint = ray.get(self._conductor.endpoint.remote(), timeout=timeout_s)
            records = [self.pools.add(role) for role, n in spec.sizes for _ in range(n)]
            self._save()  # before the actors: a restarted controller never reissues a name
            for record in records:
                self._start_worker(record)
            self._gateway = self._new_gateway(spec.gateway, spec.num_workers, None)
        self._await_gateway(self._gateway, timeout_s)
        self._watch_gateway()
        return {"gateway": self.gateway_url, "conductor": self.conductor_endpoint,
                "num_workers": spec.num_workers}  # fmt: skip

    def _control_options(self) -> dict[str, Any]:
        """Ray options of the Conductor's and the gateway's actors."""
        request = self.spec.config.control_request().as_options()
        return {**request, "runtime_env": self._env, "max_concurrency": 4,
                "lifetime": "detached", "namespace": NAMESPACE}  # fmt: skip

    def _reserve(self, timeout_s: float) -> None:
        """A placement group for the initial workers, when a strategy was asked for."""
        cfg = self.spec.config
        if cfg.placement_strategy is None:
            return
        from ray.util.placement_group import placement_group

        bundles, owners = [], []
        for role, n in self.spec.sizes:
            bundles += [cfg.worker_request(role).as_bundle() or {"CPU": 0.001}] * n
            owners += [role] * n
        self._pg = placement_group(bundles, strategy=cfg.placement_strategy,
                                   name=cfg.actor_name("workers"), lifetime="detached")  # fmt: skip
        import ray

        try:
            ray.get(self._pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise HalfmoonError(
                f"the cluster cannot reserve {len(bundles)} worker bundles "
                f"({cfg.placement_strategy}) within {timeout_s:g}s; see `ray status`"
            ) from None
        for role in dict(self.spec.sizes):
            self.pools.give_bundles(role, [i for i, r in enumerate(owners) if r == role])

    def _start_worker(self, record: WorkerRecord) -> None:
        import ray

        spec, cfg = self.spec, self.spec.config
        options = {**cfg.worker_request(record.role).as_options(), "runtime_env": self._env}
        if record.bundle is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=record.bundle)  # fmt: skip
        self._workers[record.name] = ray.remote(WorkerHost).options(
            name=cfg.actor_name(record.name), max_restarts=cfg.max_worker_restarts,
            max_concurrency=4, lifetime="detached", namespace=NAMESPACE, **options,
        ).remote(record.role, record.index, self.conductor_endpoint, spec.model, spec.seed,
                 spec.engine_json, spec.log_level)  # fmt: skip
        log.info("started %s", record.name)

    # -- the gateway ---------------------------------------------------------------------------
    def _new_gateway(self, gateway: Any, num_workers: int, node_id: str | None) -> Any:
        """Create the gateway actor (on ``node_id`` when given); it starts serving alone."""
        import ray

        options = self._control_options()
        if node_id is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        return ray.remote(GatewayHost).options(
            name=self.spec.config.actor_name("gateway"), max_restarts=0, **options,
        ).remote(gateway, self.conductor_endpoint, self.spec.config.name, num_workers,
                 len(self.spec.sizes))  # fmt: skip

    def _await_gateway(self, handle: Any, timeout_s: float) -> None:
        """Wait until ``handle`` serves; remember where, for restarts (raises if it failed)."""
        import ray

        ray.get(handle.wait_ready.remote(timeout_s), timeout=timeout_s + 30)
        info = ray.get(handle.info.remote(), timeout=30)
        with self._lock:
            self.gateway_url = info["url"]
            self._gateway_at = {"host": info["host"], "node_id": info["node_id"]}
            self._save()

    def _watch_gateway(self) -> None:
        """Start the thread that restarts the gateway (once)."""
        if not self._watching:
            self._watching = True
            threading.Thread(target=self._watch, name="gateway-watch", daemon=True).start()

    def _watch(self) -> None:
        import ray

        failing_since: float | None = None
        backoff_s = GATEWAY_CHECK_S
        while not self._stopping.wait(backoff_s):
            handle, reason = self._gateway, ""
            try:
                info = ray.get(handle.info.remote(), timeout=10) if handle is not None else {}
                if not info.get("serving"):
                    reason = "is not serving"
                elif not self._gateway_at:  # adopted before it was ever ready
                    with self._lock:
                        self.gateway_url = info["url"]
                        self._gateway_at = {"host": info["host"], "node_id": info["node_id"]}
            except ray.exceptions.ActorDiedError:
                reason = "died"
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since < GATEWAY_HUNG_S:
                    continue
                reason = f"has not answered for {GATEWAY_HUNG_S:g}s ({type(exc).__name__})"
            failing_since = None
            if not reason:
                backoff_s = GATEWAY_CHECK_S
                continue
            try:
                self._restart_gateway(handle, reason)
                backoff_s = GATEWAY_CHECK_S
            except Exception as exc:  # e.g. its port still taken: try again, less often
                backoff_s = min(backoff_s * 2, 30.0)
                log.warning("gateway restart failed (%s); next try in %gs", exc, backoff_s)

    def _restart_gateway(self, handle: Any, reason: str) -> None:
        """Replace the gateway on the node, host and port it had (elsewhere if that node
        is gone: then its URL changes, and ``status`` says the new one)."""
        import ray

        log.warning("the gateway %s: restarting it at %s", reason, self.gateway_url or "?")
        if handle is not None:
            ray.kill(handle, no_restart=True)  # frees its name (and port) if it still lives
        gateway, node_id = self.spec.gateway, self._gateway_at.get("node_id")
        if node_id is not None and node_alive(node_id):
            gateway = replace(gateway, host=self._gateway_at["host"])
        else:
            node_id = None
            log.warning("the gateway's node is gone: it starts elsewhere, at another URL")
        with self._lock:
            if self._stopping.is_set():
                return
            self._gateway = self._new_gateway(gateway, len(self.spec.sizes), node_id)
            self.gateway_restarts += 1
        self._await_gateway(self._gateway, self.spec.gateway.startup_timeout_s)
        log.warning("the gateway serves again at %s", self.gateway_url)

    # -- scale ---------------------------------------------------------------------------------
    def scale(self, targets: dict[str, int]) -> dict[str, Any]:
        """Resize pools to ``targets`` ({role: size}); new workers start joining, removed
        ones drain in the background. Returns the plan or ``{"error": ...}``."""
        try:
            with self._lock:
                plan = self.pools.plan({str(k): int(v) for k, v in targets.items()})
                added = [self.pools.add(role) for role in plan.add]
                self._save()
                try:
                    for record in added:
                        self._start_worker(record)
                    for name in plan.drain:
                        self._drain(name)
                finally:
                    self._save()
                return {"added": [r.name for r in added], "draining": list(plan.drain),
                        "sizes": self.pools.counts()}  # fmt: skip
        except (HalfmoonError, ValueError) as exc:
            return {"error": str(exc)}

    def _drain(self, name: str) -> None:
        import ray

        self.pools.mark_draining(name)
        actor = self._workers[name]
        ray.get(actor.expect_exit.remote(), timeout=30)
        reply = call_conductor(self.conductor_endpoint, load_secret(), Drain(instance_id=name))
        if not isinstance(reply, Draining):  # not registered yet: nothing placed on it
            why = reply.error if isinstance(reply, Error) else reply.wire_name
            log.info("%s unknown to the Conductor (%s): stopping it", name, why)
            ray.get(actor.stop.remote(), timeout=30)
        threading.Thread(target=self._finish_drain, args=(name,), daemon=True).start()

    def _finish_drain(self, name: str) -> None:
        """Wait for a draining worker to exit (or the drain timeout), then end it."""
        import ray

        actor = self._workers[name]
        deadline = time.monotonic() + self.spec.config.drain_timeout_s
        while time.monotonic() < deadline:
            try:
                if ray.get(actor.exited.remote(), timeout=10):
                    break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                break  # the actor died while draining: nothing left to wait for
            time.sleep(0.25)
        else:
            log.warning("%s still busy after %gs: stopping it", name,
                        self.spec.config.drain_timeout_s)  # fmt: skip
        ray.kill(actor, no_restart=True)
        with self._lock:
            self._workers.pop(name, None)
            self.pools.remove(name)
            self._save()
        log.info("%s drained and removed", name)

    # -- persistence and recovery --------------------------------------------------------------
    def _save(self) -> None:
        """Persist what a restarted controller cannot learn from the live actors."""
        with self._lock:
            if self._stopping.is_set():
                return
            save_record(self.spec.config.name, {
                "pools": self.pools.to_dict(), "conductor": self.conductor_endpoint,
                "gateway_url": self.gateway_url, "gateway_at": self._gateway_at,
                "gateway_restarts": self.gateway_restarts,
            })  # fmt: skip

    def recover(self) -> None:
        """Rebuild the view of a running deployment (after Ray restarted this actor): the
        persisted record says what was started, the live named actors what still runs.
        Stops and starts nothing; resumes drains and the gateway's watch."""
        import ray

        cfg = self.spec.config
        record = load_record(cfg.name) or {}
        with self._lock:
            if "pools" in record:
                self.pools = Pools.from_dict(record["pools"])
            self.conductor_endpoint = record.get("conductor", "")
            self.gateway_url = record.get("gateway_url", "")
            self._gateway_at = record.get("gateway_at", {})
            self.gateway_restarts = int(record.get("gateway_restarts", 0))
            self._conductor = named_actor(cfg.actor_name("conductor"))
            if self._conductor is not None and not self.conductor_endpoint:
                self.conductor_endpoint = ray.get(self._conductor.endpoint.remote(), timeout=30)
            self._gateway = named_actor(cfg.actor_name("gateway"))
            if cfg.placement_strategy is not None:
                self._pg = named_placement_group(cfg.actor_name("workers"))
            self._adopt_workers()
            draining = [w.name for w in self.pools.workers.values() if w.state == DRAINING]
            self._save()
        log.warning("controller restarted: adopted %d workers (%s), gateway %s", len(self._workers),
                    ", ".join(sorted(self._workers)), self.gateway_url or "not started")  # fmt: skip
        for name in draining:
            threading.Thread(target=self._resume_drain, args=(name,), daemon=True).start()
        if self._gateway is not None or self._gateway_at:
            self._watch_gateway()

    def _adopt_workers(self) -> None:
        """Handles of the recorded workers still alive; drop the gone, adopt the unrecorded."""
        prefix = f"{self.spec.config.name}:"
        for name in list(self.pools.workers):
            handle = named_actor(prefix + name)
            if handle is None:
                log.warning("%s is gone: dropped from its pool", name)
                self.pools.remove(name)
            else:
                self._workers[name] = handle
        for full in deployment_actors(prefix):
            role, _, index = full.removeprefix(prefix).rpartition("-")
            name = f"{role}-{index}"
            if role in self.pools.roles and index.isdigit() and name not in self.pools.workers:
                handle = named_actor(full)
                if handle is not None:
                    log.warning("%s runs but was not recorded: adopted", name)
                    self.pools.adopt(role, int(index))
                    self._workers[name] = handle

    def _resume_drain(self, name: str) -> None:
        """Drain ``name`` again (each step is idempotent); wait for its exit at least."""
        import ray

        try:
            with self._lock:
                self._drain(name)
        except (HalfmoonError, ray.exceptions.RayError) as exc:
            log.warning("resuming the drain of %s: %s", name, exc)
            self._finish_drain(name)

    # -- report / stop -------------------------------------------------------------------------
    def ping(self) -> bool:
        """Liveness for the driver."""
        return True

    def status(self) -> dict[str, Any]:
        """Pools, each worker's node / pid / state, and the Conductor's view."""
        import ray

        with self._lock:
            records = list(self.pools.workers.values())
            handles = {name: self._workers.get(name) for name in self.pools.workers}
        workers = []
        for record in records:
            entry = {"name": record.name, "role": record.role, "state": record.state}
            try:
                entry.update(ray.get(handles[record.name].info.remote(), timeout=5))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                entry["error"] = type(exc).__name__  # dead, or being restarted
            workers.append(entry)
        try:
            pong = call_conductor(self.conductor_endpoint, load_secret(), Ping())
        except HalfmoonError:
            pong = None
        if not isinstance(pong, ConductorPong):
            pong = ConductorPong()  # the Conductor is away: nobody is registered
        return {"name": self.spec.config.name, "mode": self.spec.mode,
                "gateway": self.gateway_url, "conductor": self.conductor_endpoint,
                "sizes": self.pools.counts(), "workers": workers,
                "registered": pong.instances, "draining": pong.draining,
                "gateway_restarts": self.gateway_restarts,
                "controller_restarted": self.restarted}  # fmt: skip

    def stop(self) -> None:
        """Stop the gateway, every worker and the Conductor, free the reservation and
        forget the record."""
        import ray

        self._stopping.set()
        with self._lock:
            handles = [self._gateway, *self._workers.values(), self._conductor]
            stops = [h.stop.remote() for h in handles if h is not None]
            try:
                ray.get(stops, timeout=20)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                log.warning("stopping: %s", type(exc).__name__)
            for handle in handles:
                if handle is not None:
                    ray.kill(handle, no_restart=True)
            self._workers.clear()
            remove_leftovers(self.spec.config.name)
            self._pg = None


def controller_options(name: str) -> dict[str, Any]:
    """Ray options of a deployment's controller actor (detached, named, threaded, and
    restarted by Ray whenever it dies unless killed with ``no_restart``)."""
    return {"name": name, "namespace": NAMESPACE, "lifetime": "detached",
            "max_concurrency": 16, "num_cpus": 0, "max_restarts": -1}  # fmt: skip
