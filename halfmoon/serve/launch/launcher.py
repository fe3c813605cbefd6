"""``halfmoon serve``: start a whole cluster on this machine and serve the OpenAI API.

Starts the Conductor and every worker as its own OS process (each command line names its
role), waits until all have registered, then runs the gateway in this process. A child
that crashes is restarted with exponential backoff (workers register again; the gateway
re-places their in-flight requests). Ctrl-C or SIGTERM stops everything; children also die with the launcher (PR_SET_PDEATHSIG), so no
orphan survives even a SIGKILL of the launcher.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from halfmoon.conductor.options import add_conductor_options, conductor_config_from_args
from halfmoon.core.errors import HalfmoonError
from halfmoon.serve.gateway.tenancy import API_KEY_ENV, api_keys
from halfmoon.serve.runtime import (
    SECRET_ENV,
    die_with_parent,
    free_port,
    new_secret,
    settle_gc,
    setup_logging,
    warn_if_public,
)
from halfmoon.serve.worker.main import (
    REFUSED_EXIT_CODE,
    EngineOptions,
    add_engine_options,
    engine_config,
)

log = logging.getLogger("serve")


@dataclass
class Child:
    """One supervised child process and its restart bookkeeping."""

    name: str
    argv: tuple[str, ...]
    proc: subprocess.Popen
    started_s: float = field(default_factory=time.monotonic)
    num_restarts: int = 0
    restart_at_s: float | None = None


class ProcessGroup:
    """The child processes of one cluster, restarted with backoff when they crash."""

    #: Restart delays double from this up to ``MAX_BACKOFF_S``; a child that stayed up
    #: for ``STABLE_S`` starts over at the first delay.
    FIRST_BACKOFF_S = 0.5
    MAX_BACKOFF_S = 30.0
    STABLE_S = 60.0

    def __init__(self, secret: str) -> None:
        self.env = {**os.environ, SECRET_ENV: secret}
        self.children: list[Child] = []

    @property
    def procs(self) -> list[tuple[str, subprocess.Popen]]:
        """(name, process) of every child."""
        return [(c.name, c.proc) for c in self.children]

    def _popen(self, argv: tuple[str, ...]) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "halfmoon.cli", *argv]
        return subprocess.Popen(cmd, env=self.env, preexec_fn=die_with_parent)  # noqa: PLW1509

    def spawn(self, name: str, *argv: str) -> subprocess.Popen:
        """Start ``halfmoon ARGV...`` as a child."""
        child = Child(name, tuple(argv), self._popen(tuple(argv)))
        self.children.append(child)
        return child.proc

    def check_alive(self) -> None:
        """Raise if any child has exited (used while the cluster starts)."""
        for name, proc in self.procs:
            if proc.poll() is not None:
                raise HalfmoonError(f"{name} exited with code {proc.returncode}")

    def supervise(self, now_s: float | None = None) -> list[str]:
        """Restart children that died, each after its backoff; returns who restarted."""
        now_s = time.monotonic() if now_s is None else now_s
        restarted = []
        for child in self.children:
            if child.proc.poll() is None:
                if now_s - child.started_s > self.STABLE_S:
                    child.num_restarts = 0
                continue
            if child.proc.returncode == REFUSED_EXIT_CODE:
                if child.restart_at_s != float("inf"):  # said once; never restarted
                    child.restart_at_s = float("inf")
                    log.error("%s was refused by the Conductor (see its log): not restarted",
                              child.name)  # fmt: skip
                continue
            if child.restart_at_s is None:
                delay = min(self.MAX_BACKOFF_S, self.FIRST_BACKOFF_S * 2**child.num_restarts)
                child.restart_at_s = now_s + delay
                log.warning("%s exited with code %s; restarting in %.1fs",
                            child.name, child.proc.returncode, delay)  # fmt: skip
            elif now_s >= child.restart_at_s:
                child.proc = self._popen(child.argv)
                child.started_s, child.restart_at_s = now_s, None
                child.num_restarts += 1
                restarted.append(child.name)
        return restarted

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every child, then SIGKILL the ones still running after ``timeout_s``."""
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout_s
        for _, proc in self.procs:
            try:
                proc.wait(max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def prepare_model(model: str, seed: int) -> Path:
    """The model directory ``model`` names (:func:`halfmoon.engine.catalog.resolve_model`):
    a directory as it is; a named model, a .gguf file or a preset imported or written once
    into the cache, printing progress while that runs."""
    from halfmoon.engine.catalog import resolve_model

    return resolve_model(model, seed, progress=lambda msg: print(f"halfmoon: {msg}", flush=True))


def engine_json(args: argparse.Namespace, model: str) -> str:
    """The workers' engine options as one document (``--config-json``), serving ``model``."""
    return EngineOptions.from_args(argparse.Namespace(**{**vars(args), "model": model})).to_json()


def engine_defaults(args: argparse.Namespace) -> None:
    """Fill in the options whose default depends on ``--engine`` (idempotent)."""
    if getattr(args, "coupled_router", "") is None:
        # vLLM servers serve a chat model: every prompt shares the template's first
        # blocks, on which "cache-aware" would pile everything (docs/conductor.md).
        vllm = getattr(args, "engine", "halfmoon") == "vllm"
        args.coupled_router = "kvcache-centric" if vllm else "cache-aware"


def conductor_json(args: argparse.Namespace) -> str:
    """The Conductor's config as one document (``--config-json``); the workers' block size
    is the cluster's."""
    engine_defaults(args)
    return conductor_config_from_args(args, args.block_size).to_json()


def start_cluster(
    args: argparse.Namespace, group: ProcessGroup, model_dir: Path
) -> tuple[str, int]:
    """Spawn the Conductor and the workers; returns (conductor endpoint, worker count)."""
    conductor_port = free_port(args.internal_host)
    endpoint = f"tcp://{args.internal_host}:{conductor_port}"
    group.spawn("conductor", "conductor", "--host", args.internal_host,
                "--port", str(conductor_port), "--log-level", args.log_level,
                "--config-json", conductor_json(args))  # fmt: skip
    if args.mode == "coupled":
        roles = [("coupled", args.instances)]
    else:
        roles = [("prefill", args.prefill), ("decode", args.decode)]
    worker_doc = engine_json(args, str(model_dir))
    attach = list(getattr(args, "attach", None) or ())
    count = 0
    for role, n in roles:
        for i in range(n):
            extra = ("--vllm-url", attach[i]) if attach else ()
            group.spawn(f"{role}-{i}", "worker", "--role", role, "--index", str(i),
                        "--host", args.internal_host, "--port", str(free_port(args.internal_host)),
                        "--conductor", endpoint, "--log-level", args.log_level,
                        "--transport", getattr(args, "transport", "auto"),
                        "--config-json", worker_doc,
                        *extra)  # fmt: skip
            count += 1
    return endpoint, count


async def _serve_gateway(args: argparse.Namespace, group: ProcessGroup, model_dir: Path,
                         conductor: str, num_workers: int) -> None:  # fmt: skip
    from halfmoon.engine.tokenizer import Tokenizer

    _QuietServer = _make_quiet_server()  # noqa: N806
    from halfmoon.serve.gateway.app import GatewayConfig, create_app
    from halfmoon.serve.gateway.cluster_client import ClusterBackend
    from halfmoon.serve.gateway.http_limits import ConnectionLimits, server_config

    tokenizer = Tokenizer.from_dir(model_dir)
    backend = ClusterBackend(conductor, group.env[SECRET_ENV].encode(), args.block_size,
                             args.mode, expected_instances=num_workers)  # fmt: skip
    await _wait_ready(backend, group, args.startup_timeout, num_workers)
    max_len = args.max_model_len or _max_model_len(model_dir)
    config = GatewayConfig(
        args.served_model_name or model_dir.name.split("-seed")[0],
        max_len,
        api_keys=api_keys(args.api_key, os.environ.get(API_KEY_ENV)),
        max_concurrent_requests=args.max_concurrent_requests,
        cache_salt_from_api_key=args.cache_salt_from_api_key,
        public=tuple(args.public or ()),
    )
    app = create_app(backend, tokenizer, config)
    server = _QuietServer(server_config(app, args.host, args.port, ConnectionLimits()))
    print(f"halfmoon: serving {config.model_name!r} at http://{args.host}:{args.port}/v1 "
          f"({args.mode}, {num_workers} workers)", flush=True)  # fmt: skip
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, lambda: setattr(server, "should_exit", True))
    supervisor = loop.create_task(_supervise(group))
    settle_gc()
    try:
        await server.serve()
    finally:
        supervisor.cancel()
        await backend.close()


async def _wait_ready(
    backend: Any, group: ProcessGroup, timeout_s: float, num_workers: int
) -> None:
    """Wait until every worker has registered, printing how many have (loading the model
    and measuring its cost profile takes a while on a real model)."""
    start = time.monotonic()
    print(f"halfmoon: starting the Conductor and {num_workers} workers (loading the model)",
          flush=True)  # fmt: skip
    last_report = ""
    while True:
        group.check_alive()
        try:
            await backend.health()
            break
        except HalfmoonError as exc:
            waited_s = time.monotonic() - start
            if waited_s > timeout_s:
                raise HalfmoonError(f"cluster not ready after {timeout_s:g}s: {exc}") from None
            report = str(exc)
            if report != last_report and "registered" in report:
                print(f"halfmoon: {report} ({waited_s:.0f}s)", flush=True)
                last_report = report
            await asyncio.sleep(0.2)
    print(f"halfmoon: cluster ready in {time.monotonic() - start:.1f}s", flush=True)


async def _supervise(group: ProcessGroup, interval_s: float = 0.5) -> None:
    """Restart crashed children for as long as the gateway serves."""
    while True:
        await asyncio.sleep(interval_s)
        for name in group.supervise():
            log.info("restarted %s", name)


def _make_quiet_server() -> type:
    import uvicorn

    class QuietServer(uvicorn.Server):
        """uvicorn without its own signal capture: the launcher handles SIGINT/SIGTERM so
        that it can stop its children before exiting (uvicorn would re-raise the signal)."""

        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[override]
            yield

    return QuietServer


def _max_model_len(model_dir: Path) -> int:
    import json

    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("max_position_embeddings", 2048))


def check_shape(args: argparse.Namespace) -> None:
    """Refuse contradictory pool and pipeline options before anything starts (and fill in
    the defaults that depend on others)."""
    engine_defaults(args)
    attach = getattr(args, "attach", None)
    if getattr(args, "engine", "halfmoon") == "vllm":
        if args.mode != "coupled" and attach:
            raise HalfmoonError(
                "--attach serves --mode coupled: disaggregated vLLM workers start their own "
                "servers with halfmoon's KV connector"
            )
        if args.cpp_stages > 1:
            raise HalfmoonError("--cpp-stages runs on halfmoon's engine only, not --engine vllm")
        if not args.prefix_caching:
            from halfmoon.serve.vllm.server import NO_PREFIX_CACHING

            raise HalfmoonError(NO_PREFIX_CACHING)
        if attach:
            from halfmoon.serve.vllm.server import VllmEndpoints

            for spec in attach:
                VllmEndpoints.parse(spec)
            args.instances = len(attach)
    elif attach:
        raise HalfmoonError("--attach names vLLM servers: it needs --engine vllm")
    if args.mode == "coupled" and args.instances < 1:
        raise HalfmoonError("--instances must be >= 1")
    if args.mode == "disaggregated" and (args.prefill < 1 or args.decode < 1):
        raise HalfmoonError("--prefill and --decode must each be >= 1")
    if args.cpp_stages < 1 or args.cpp_chunk_tokens < 1 or args.cpp_min_tokens < 0:
        raise HalfmoonError(
            "--cpp-stages and --cpp-chunk-tokens must be >= 1, --cpp-min-tokens >= 0"
        )
    conductor_json(args)  # every Conductor option, checked before any process starts
    if args.cpp_stages > 1 and (args.mode != "disaggregated" or args.prefill < args.cpp_stages):
        raise HalfmoonError(
            f"--cpp-stages {args.cpp_stages} needs --mode disaggregated and at least "
            f"{args.cpp_stages} prefill workers (--prefill {args.prefill})"
        )
    if getattr(args, "cache_salt_from_api_key", False) and not api_keys(
        getattr(args, "api_key", None), os.environ.get(API_KEY_ENV)
    ):
        raise HalfmoonError(
            "--cache-salt-from-api-key needs API keys: give --api-key once per tenant "
            f"(or ${API_KEY_ENV}, comma-separated)"
        )
    roles = ("prefill", "decode") if args.mode == "disaggregated" else ("coupled",)
    for role in roles:  # the workers' engine options, checked before any process starts
        try:
            engine_config(argparse.Namespace(**{**vars(args), "role": role}))
        except HalfmoonError as exc:
            raise HalfmoonError(f"{role} workers: {exc}") from None


def run_serve(args: argparse.Namespace) -> int:
    """Start the cluster and serve until interrupted."""
    check_shape(args)
    args.host = args.host or "127.0.0.1"
    if args.startup_timeout is None:
        args.startup_timeout = 900.0 if args.engine == "vllm" else 180.0
    log = setup_logging("serve", args.log_level)
    warn_if_public(args.host, log)
    model_dir = prepare_model(args.model, args.seed)
    if args.engine == "vllm" and args.max_model_len is None:
        from halfmoon.serve.vllm.server import fitting_max_model_len

        # vLLM needs one whole context in its pool; the gateway must know the same limit.
        args.max_model_len = fitting_max_model_len(
            model_dir, args.kv_cache_mb, args.block_size, args.dtype
        )
    group = ProcessGroup(os.environ.get(SECRET_ENV) or new_secret())
    try:
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is the normal way to stop
            conductor, num_workers = start_cluster(args, group, model_dir)
            asyncio.run(_serve_gateway(args, group, model_dir, conductor, num_workers))
    finally:
        group.stop()
        log.info("stopped %d processes", len(group.procs))
    return 0


def register(subparsers: Any) -> None:
    """Add ``halfmoon serve``."""
    p = subparsers.add_parser(
        "serve",
        help="start a local cluster and serve the OpenAI-compatible API",
        description="Start the Conductor and the workers as processes and serve "
        "/v1/completions, /v1/chat/completions, /v1/models, /health and /metrics.",
    )
    p.add_argument("--mode", default="disaggregated", choices=("disaggregated", "coupled"))
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (disaggregated)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (disaggregated)")
    p.add_argument("--instances", type=int, default=2, help="coupled workers (coupled)")
    p.add_argument(
        "--host", default=None, help="gateway address (127.0.0.1; with --ray, the gateway's node)"
    )
    p.add_argument("--port", type=int, default=8000, help="gateway port")
    p.add_argument("--internal-host", default="127.0.0.1", help="address of internal channels")
    p.add_argument(
        "--transport", default="auto", choices=("auto", "tcp", "shm"),
        help="KV between workers: auto (default: shared memory between workers on one "
        "host, else tcp), tcp, or shm (co-located workers only)",
    )  # fmt: skip
    p.add_argument("--served-model-name", default=None)
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require this bearer token; repeat for several (or $HALFMOON_API_KEY, "
        "comma-separated)",
    )
    p.add_argument(
        "--cache-salt-from-api-key",
        action="store_true",
        help="give each API key a prefix cache of its own: no tenant's cached_tokens "
        "reveal another's prompts (shared prefixes are then computed once per key)",
    )
    p.add_argument(
        "--public",
        action="append",
        choices=["docs", "metrics"],  # gateway.PUBLIC_PATHS
        default=None,
        help="with --api-key, keep this readable without a key: 'metrics' (/metrics) or "
        "'docs' (/docs, /redoc, /openapi.json); repeat for both (/health is always open)",
    )
    p.add_argument(
        "--attach", action="append", default=None, metavar="URL,EVENTS[,REPLAY[,TOPIC]]",
        help="with --engine vllm: serve through this running vLLM server (HTTP URL, KV-event "
        "PUB endpoint, optional replay endpoint and event topic) instead of starting one; "
        "repeat per server (--instances is then their number)",
    )  # fmt: skip
    p.add_argument(
        "--startup-timeout", type=float, default=None,
        help="seconds to wait for every worker (default 180; 900 with --engine vllm)",
    )  # fmt: skip
    p.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=512,
        help="requests in flight beyond this get HTTP 429",
    )
    p.add_argument("--log-level", default="INFO")
    add_engine_options(p)
    add_conductor_options(p, "live")
    p.set_defaults(func=run_serve, coupled_router=None)  # check_shape: by --engine
