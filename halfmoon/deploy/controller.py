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

The controller's own state is not persisted: if its node dies, the deployment goes with it
(its actors share its fate) and ``halfmoon serve --ray`` starts it again.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from halfmoon.core.errors import HalfmoonError
from halfmoon.deploy.actors import ConductorHost, GatewayHost, WorkerHost
from halfmoon.deploy.options import NAMESPACE, DeploySpec
from halfmoon.deploy.plan import Pools, WorkerRecord
from halfmoon.serve.protocol import decode, encode
from halfmoon.serve.runtime import SECRET_ENV, load_secret

log = logging.getLogger("deploy")


def call_conductor(endpoint: str, secret: bytes, msg: dict[str, Any], timeout_s: float = 5.0
                   ) -> dict[str, Any]:  # fmt: skip
    """One signed request to the Conductor service and its reply."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart(encode({**msg, "msg_id": 1}, secret))
        if not sock.poll(int(timeout_s * 1000)):
            raise HalfmoonError(f"the Conductor at {endpoint} did not answer in {timeout_s:g}s")
        return decode(sock.recv_multipart(), secret)
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
        self._pg: Any = None
        self.conductor_endpoint = ""
        self.gateway_url = ""
        self._env = {"env_vars": {SECRET_ENV: os.environ[SECRET_ENV]}}

    # -- start ---------------------------------------------------------------------------------
    def start(self) -> dict[str, Any]:
        """Reserve, place and start every process; returns the gateway's URL."""
        import ray

        spec, cfg = self.spec, self.spec.config
        timeout_s = spec.gateway.startup_timeout_s
        with self._lock:
            self._reserve(timeout_s)
            control = {**cfg.control_request().as_options(), "runtime_env": self._env}
            self._conductor = ray.remote(ConductorHost).options(
                name=cfg.actor_name("conductor"), max_concurrency=4, **control,
            ).remote(spec.conductor_argv, spec.log_level)  # fmt: skip
            self.conductor_endpoint = ray.get(self._conductor.endpoint.remote(), timeout=timeout_s)
            for role, n in spec.sizes:
                for _ in range(n):
                    self._start_worker(self.pools.add(role))
            self._gateway = ray.remote(GatewayHost).options(
                name=cfg.actor_name("gateway"), max_concurrency=4, **control,
            ).remote(spec.gateway, self.conductor_endpoint, cfg.name, spec.num_workers,
                     len(spec.sizes))  # fmt: skip
        ref = self._gateway.wait_ready.remote(timeout_s)
        self.gateway_url = ray.get(ref, timeout=timeout_s + 30)
        return {"gateway": self.gateway_url, "conductor": self.conductor_endpoint,
                "num_workers": spec.num_workers}  # fmt: skip

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
                                   name=cfg.actor_name("workers"))  # fmt: skip
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
            max_concurrency=4, **options,
        ).remote(record.role, record.index, self.conductor_endpoint, spec.model, spec.seed,
                 spec.engine_argv, spec.log_level)  # fmt: skip
        log.info("started %s", record.name)

    # -- scale ---------------------------------------------------------------------------------
    def scale(self, targets: dict[str, int]) -> dict[str, Any]:
        """Resize pools to ``targets`` ({role: size}); new workers start joining, removed
        ones drain in the background. Returns the plan or ``{"error": ...}``."""
        try:
            with self._lock:
                plan = self.pools.plan({str(k): int(v) for k, v in targets.items()})
                added = [self.pools.add(role) for role in plan.add]
                for record in added:
                    self._start_worker(record)
                for name in plan.drain:
                    self._drain(name)
                return {"added": [r.name for r in added], "draining": list(plan.drain),
                        "sizes": self.pools.counts()}  # fmt: skip
        except (HalfmoonError, ValueError) as exc:
            return {"error": str(exc)}

    def _drain(self, name: str) -> None:
        import ray

        self.pools.mark_draining(name)
        actor = self._workers[name]
        ray.get(actor.expect_exit.remote(), timeout=30)
        reply = call_conductor(self.conductor_endpoint, load_secret(),
                               {"type": "drain", "instance_id": name})  # fmt: skip
        if reply.get("type") != "draining":  # not registered yet: nothing placed on it
            log.info("%s unknown to the Conductor (%s): stopping it", name, reply.get("error"))
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
        log.info("%s drained and removed", name)

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
            pong = call_conductor(self.conductor_endpoint, load_secret(), {"type": "ping"})
        except HalfmoonError as exc:
            pong = {"error": str(exc)}
        return {"name": self.spec.config.name, "mode": self.spec.mode,
                "gateway": self.gateway_url, "conductor": self.conductor_endpoint,
                "sizes": self.pools.counts(), "workers": workers,
                "registered": pong.get("instances", {}), "draining": pong.get("draining", [])}  # fmt: skip

    def stop(self) -> None:
        """Stop the gateway, every worker and the Conductor, and free the reservation."""
        import ray

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
            if self._pg is not None:
                ray.util.remove_placement_group(self._pg)
                self._pg = None


def controller_options(name: str) -> dict[str, Any]:
    """Ray options of a deployment's controller actor (detached, named, threaded)."""
    return {"name": name, "namespace": NAMESPACE, "lifetime": "detached",
            "max_concurrency": 16, "num_cpus": 0}  # fmt: skip
