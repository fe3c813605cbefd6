"""The bodies of the Ray actors: one per process of a deployment.

Each actor runs the same entry point ``halfmoon serve`` runs on one machine, on the node
Ray placed it on, and advertises that node's address (as Ray registered it) instead of
127.0.0.1:

- :class:`ConductorHost`: ``halfmoon conductor`` as a child, restarted in place on the
  same port when it crashes (workers and the gateway keep its endpoint);
- :class:`WorkerHost`: ``halfmoon worker`` as a child; when the child dies unexpectedly the
  actor's process exits too, so Ray restarts the actor (``max_restarts``) and the new
  child registers as a new incarnation — the Conductor's failover does the rest;
- :class:`GatewayHost`: the OpenAI gateway in the actor's own process (a thread with its
  own event loop), with the ``/admin`` routes that call the controller. Ray does not
  restart it (``max_restarts=0``): the controller does, on the same node, host and port.

Every actor is detached: it outlives the controller that created it, so a restarted
controller finds the deployment still serving and adopts it (``Controller.recover``).

Children are started from a thread that lives as long as they do: ``PR_SET_PDEATHSIG``
fires when the *thread* that forked dies, and it must fire only when the actor does.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import warnings
from typing import Any

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.heap import settle_gc
from halfmoon.core.profiling import parse_profiler_config
from halfmoon.deploy.options import NAMESPACE, GatewaySpec
from halfmoon.engine.config import resolve_dtype
from halfmoon.serve.launch.launcher import prepare_model
from halfmoon.serve.launch.processes import ProcessGroup
from halfmoon.serve.runtime import free_port, load_secret
from halfmoon.serve.worker.main import with_model

log = logging.getLogger("deploy")


def node_address() -> str:
    """This node's address as Ray registered it (``ray start --node-ip-address``)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            return str(node["NodeManagerAddress"])
    return ray.util.get_node_ip_address()


class ConductorHost:
    """Runs ``halfmoon conductor`` on this node and restarts it in place."""

    def __init__(self, conductor_json: str, log_level: str) -> None:
        self.host = node_address()
        self.port = free_port(self.host)
        self._group = ProcessGroup(load_secret().decode())
        self._argv = ("conductor", "--host", self.host, "--port", str(self.port),
                      "--log-level", log_level, "--config-json", conductor_json)  # fmt: skip
        self._stop = threading.Event()
        self._started = threading.Event()
        threading.Thread(target=self._supervise, name="conductor", daemon=True).start()
        self._started.wait(30)

    def _supervise(self) -> None:
        self._group.spawn("conductor", *self._argv)
        self._started.set()
        while not self._stop.wait(0.5):
            for name in self._group.supervise():
                log.warning("restarted %s", name)

    def endpoint(self) -> str:
        """``tcp://NODE:PORT`` of the Conductor."""
        return f"tcp://{self.host}:{self.port}"

    def pid(self) -> int:
        """The Conductor process's pid."""
        return self._group.children[0].proc.pid

    def stop(self) -> None:
        """SIGTERM the Conductor (SIGKILL after a few seconds)."""
        self._stop.set()
        self._group.stop(5.0)


class WorkerHost:
    """Runs one ``halfmoon worker`` on this node; its unexpected death ends the actor."""

    def __init__(self, role: str, index: int, conductor: str, model: str, seed: int,
                 engine_json: str, log_level: str) -> None:  # fmt: skip
        import ray

        self.name = f"{role}-{index}"
        self.role = role
        self.node = node_address()
        self.port = free_port(self.node)
        context = ray.get_runtime_context()
        self.node_id = context.get_node_id()
        with warnings.catch_warnings():  # Ray's property uses a deprecated API of its own
            warnings.simplefilter("ignore")
            self.restarted = bool(context.was_current_actor_reconstructed)
        model_dir = prepare_model(model, seed)
        self._argv = ("worker", "--role", role, "--index", str(index), "--host", self.node,
                      "--port", str(self.port), "--conductor", conductor, "--log-level",
                      log_level, "--config-json", with_model(engine_json, model_dir))  # fmt: skip
        self._group = ProcessGroup(load_secret().decode())
        self._expect_exit = threading.Event()
        self.exit_code: int | None = None
        started = threading.Event()
        threading.Thread(target=self._run, args=(started,), name=self.name, daemon=True).start()
        started.wait(30)

    def _run(self, started: threading.Event) -> None:
        proc = self._group.spawn(self.name, *self._argv)
        started.set()
        code = proc.wait()
        self.exit_code = code
        if not self._expect_exit.is_set():
            log.error("%s exited with code %s: ending its actor so that Ray restarts it",
                      self.name, code)  # fmt: skip
            os._exit(1)  # noqa: SLF001 - the actor's process must die for Ray to restart it

    def info(self) -> dict[str, Any]:
        """Where this worker runs and whether it has exited."""
        return {"name": self.name, "role": self.role, "node": self.node, "node_id": self.node_id,
                "command": f"tcp://{self.node}:{self.port}", "pid": self.pid(),
                "restarted": self.restarted, "exit_code": self.exit_code}  # fmt: skip

    def pid(self) -> int:
        """The worker process's pid."""
        return self._group.children[0].proc.pid

    def expect_exit(self) -> None:
        """The worker is draining: its exit is the plan, not a crash."""
        self._expect_exit.set()

    def exited(self) -> bool:
        """Whether the worker process has exited."""
        return self.exit_code is not None

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM the worker (SIGKILL after ``timeout_s``)."""
        self._expect_exit.set()
        self._group.stop(timeout_s)


class GatewayHost:
    """The OpenAI gateway, served from a thread of this actor on ``host:port``."""

    def __init__(self, spec: GatewaySpec, conductor: str, controller_name: str,
                 num_workers: int, num_pools: int) -> None:  # fmt: skip
        import ray

        self.spec = spec
        self.host = spec.host or node_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.url = f"{'https' if spec.tls is not None else 'http'}://{self.host}:{spec.port}"
        self._args = (conductor, controller_name, num_workers, num_pools)
        self._ready = threading.Event()
        self._error: str | None = None
        self._server: Any = None
        self._thread = threading.Thread(target=self._run, name="gateway", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            asyncio.run(self._serve(*self._args))
        except Exception as exc:  # reported to the controller by wait_ready()
            self._error = f"{type(exc).__name__}: {exc}"
            log.exception("gateway failed")
        finally:
            self._ready.set()

    async def _serve(self, conductor: str, controller_name: str,
                     num_workers: int, num_pools: int) -> None:  # fmt: skip
        import uvicorn

        from halfmoon.deploy.admin import admin_router
        from halfmoon.engine.tokenizer import Tokenizer
        from halfmoon.serve.gateway.app import GatewayConfig, create_app
        from halfmoon.serve.gateway.cluster_client import ClusterBackend
        from halfmoon.serve.gateway.generation import (
            end_token_ids,
            generation_defaults,
            startup_line,
        )
        from halfmoon.serve.gateway.http_limits import ConnectionLimits, server_config
        from halfmoon.serve.gateway.limits import served_context
        from halfmoon.serve.gateway.tenancy import API_KEY_ENV, api_keys

        spec = self.spec
        model_dir = prepare_model(spec.model, spec.seed)
        backend = ClusterBackend(conductor, load_secret(), spec.block_size, spec.mode,
                                 expected_instances=num_workers)  # fmt: skip
        await _wait_healthy(backend, spec.startup_timeout_s)
        # From now on the pools change size at run time: healthy means each pool has one.
        backend.expected_instances = num_pools
        limit = served_context(model_dir, spec.max_model_len, spec.kv_cache_mb,
                               spec.block_size, resolve_dtype(spec.dtype, model_dir))  # fmt: skip
        config = GatewayConfig(
            spec.served_model_name or model_dir.name.split("-seed")[0],
            limit.max_model_len,
            max_tokens_limit=spec.max_tokens_limit,
            api_keys=api_keys(spec.api_key, os.environ.get(API_KEY_ENV)),
            max_concurrent_requests=spec.max_concurrent_requests,
            cache_salt_from_api_key=spec.cache_salt_from_api_key,
            public=spec.public,
            access_log=spec.access_log,
            request_id_headers=spec.request_id_headers,
            dev_endpoints=spec.dev_endpoints,
            sampling_defaults=generation_defaults(
                model_dir, spec.generation_config, dict(spec.override_generation_config)
            ),
            responses_store_bytes=spec.responses_store_bytes,
            end_token_ids=end_token_ids(model_dir),
            scheduling_policy=spec.scheduling_policy,
            lora_modules=spec.lora_modules,
            allow_runtime_lora=spec.allow_runtime_lora,
            profiler=parse_profiler_config(spec.profiler_config),
            **dict(spec.api_options),
            cors=spec.cors,
        )
        log.info("context limit %d tokens (prompt + output), set by %s",
                 limit.max_model_len, limit.source)  # fmt: skip
        log.info("%s", startup_line(config.sampling_defaults, spec.generation_config,
                                    bool(spec.override_generation_config)))  # fmt: skip
        controller = _ControllerClient(controller_name)
        app = create_app(backend, Tokenizer.from_dir(model_dir, spec.chat_template), config,
                         [admin_router(controller.scale, controller.status)])  # fmt: skip
        self._server = uvicorn.Server(
            server_config(
                app,
                self.host,
                spec.port,
                ConnectionLimits(),
                spec.tls,
                **dict(spec.http_options),
            )  # fmt: skip
        )
        replanning = None
        if spec.replan is not None:  # each worker on CPUs of its own: host_cores None
            from halfmoon.deploy.replan import PoolMover
            from halfmoon.serve.launch.replan import LiveReplanner, replan_base

            base = replan_base(model_dir, spec.max_num_seqs, spec.decode_guard, None)
            replanner = LiveReplanner(backend, PoolMover(controller.scale, backend),
                                      spec.replan, base)  # fmt: skip
            gateway = app.state.gateway  # its /metrics and cluster page show the rounds
            replanner.metrics, gateway.replan_rounds = gateway.metrics, replanner.rounds
            replanning = asyncio.get_running_loop().create_task(replanner.run())
        settle_gc()
        serving = asyncio.get_running_loop().create_task(self._server.serve())
        while not self._server.started and not serving.done():
            await asyncio.sleep(0.05)
        self._ready.set()
        try:
            await serving
        finally:
            if replanning is not None:
                replanning.cancel()
            await backend.close()

    def wait_ready(self, timeout_s: float) -> str:
        """The gateway's URL once it serves (raises if it failed or timed out)."""
        if not self._ready.wait(timeout_s):
            raise HalfmoonError(f"gateway not ready after {timeout_s:g}s")
        if self._error is not None:
            raise HalfmoonError(f"gateway failed: {self._error}")
        return self.url

    def info(self) -> dict[str, Any]:
        """Where the gateway serves, and whether its serving thread still runs (it ends
        when the gateway failed to start or its server stopped)."""
        return {"url": self.url, "host": self.host, "node_id": self.node_id,
                "pid": os.getpid(), "serving": self._thread.is_alive()}  # fmt: skip

    def stop(self) -> None:
        """Stop serving (requests in flight are cut)."""
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(10)


async def _wait_healthy(backend: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await backend.health()
            return
        except HalfmoonError as exc:
            if time.monotonic() > deadline:
                raise HalfmoonError(f"cluster not ready after {timeout_s:g}s: {exc}") from None
            await asyncio.sleep(0.3)


class _ControllerClient:
    """The controller actor, called from the gateway's event loop.

    While the controller is being restarted, a call is tried again for up to
    ``wait_s`` (both calls are safe to repeat: a scale names absolute sizes)."""

    def __init__(self, name: str, wait_s: float = 30.0) -> None:
        self.name = name
        self.wait_s = wait_s

    async def _call(self, method: str, *args: Any) -> dict[str, Any]:
        import ray

        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                handle = ray.get_actor(self.name, namespace=NAMESPACE)
                reply = await asyncio.wrap_future(getattr(handle, method).remote(*args).future())
                break
            except ValueError:  # no actor by that name: gone for good, not restarting
                raise HalfmoonError("the deployment's controller is gone") from None
            except ray.exceptions.RayActorError as exc:
                if time.monotonic() > deadline:
                    raise HalfmoonError(f"the deployment's controller is unavailable "
                                        f"({type(exc).__name__}); try again") from None  # fmt: skip
                await asyncio.sleep(0.5)
        if "error" in reply:
            raise HalfmoonError(reply["error"])
        return reply

    async def scale(self, targets: dict[str, int]) -> dict[str, Any]:
        """Ask the controller to resize pools."""
        return await self._call("scale", targets)

    async def status(self) -> dict[str, Any]:
        """The controller's view of the deployment."""
        return await self._call("status")
