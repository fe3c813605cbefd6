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
import time
from pathlib import Path
from typing import Any

from halfmoon.conductor.options import add_conductor_options, conductor_config_from_args
from halfmoon.core.adapters import (
    RUNTIME_LORA_ENV,
    lora_pairs,
    parse_lora_modules,
    runtime_lora_allowed,
)
from halfmoon.core.errors import HalfmoonError
from halfmoon.core.flags import dev_mode
from halfmoon.core.heap import settle_gc
from halfmoon.core.profiling import parse_profiler_config
from halfmoon.engine.config import resolve_dtype
from halfmoon.serve.gateway.config import served_names
from halfmoon.serve.gateway.exposure import CorsPolicy, TlsOptions, add_exposure_options
from halfmoon.serve.gateway.reasoning import PARSERS as REASONING_PARSERS
from halfmoon.serve.gateway.tenancy import API_KEY_ENV, api_keys
from halfmoon.serve.gateway.tools import PARSERS
from halfmoon.serve.launch.processes import ProcessGroup
from halfmoon.serve.launch.vllm_flags import (
    add_vllm_flags,
    check_vllm_flags,
    default_template_kwargs,
)
from halfmoon.serve.runtime import (
    SECRET_ENV,
    free_port,
    new_secret,
    reserve_port,
    setup_logging,
    warn_if_public,
)
from halfmoon.serve.worker.main import (
    WIRE_CHECKSUMS,
    EngineOptions,
    add_engine_options,
    engine_config,
)

log = logging.getLogger("serve")


def api_options(args: argparse.Namespace) -> dict[str, Any]:
    """The GatewayConfig fields of how the API reads and answers requests, from serve's
    flags (the launcher's gateway and ``--ray``'s alike): the tool-call and reasoning
    parsers, the model's further names, vLLM's server-wide request defaults, the docs
    pages and the default chat-template variables."""
    return {
        "tool_call_parser": getattr(args, "tool_call_parser", None),
        "reasoning_parser": getattr(args, "reasoning_parser", None),
        "model_aliases": served_names(args.served_model_name)[1:],
        "tokens_as_ids": getattr(args, "return_tokens_as_token_ids", False),
        "force_include_usage": getattr(args, "enable_force_include_usage", False),
        "docs": not getattr(args, "disable_fastapi_docs", False),
        "default_template_kwargs": default_template_kwargs(args),
    }


def http_options(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`server_config`'s keyword arguments from vLLM's flags: uvicorn's log level
    and the root path a proxy serves the API under."""
    return {"log_level": getattr(args, "uvicorn_log_level", "warning"),
            "root_path": getattr(args, "root_path", None) or ""}  # fmt: skip


def prepare_model(model: str, seed: int) -> Path:
    """The model directory ``model`` names (:func:`halfmoon.engine.catalog.resolve_model`):
    a directory as it is; a named model, a .gguf file or a preset imported or written once
    into the cache, saying so while that runs (a bar over the tensors on a terminal)."""
    from halfmoon.engine.catalog import resolve_model
    from halfmoon.serve.launch.startup import tensor_progress

    log.info("model %s", model)
    with tensor_progress(log) as tick:
        model_dir = resolve_model(model, seed, progress=log.info, tensor_progress=tick)
    log.info("model directory %s", model_dir)
    return model_dir


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


def worker_argv(
    args: argparse.Namespace, role: str, index: int, conductor: str, worker_doc: str
) -> tuple[str, ...]:
    """``halfmoon`` arguments of worker ``role-index`` (a fresh port for its commands)."""
    return ("worker", "--role", role, "--index", str(index),
            "--host", args.internal_host, "--port", str(free_port(args.internal_host)),
            "--conductor", conductor, "--log-level", args.log_level,
            "--transport", getattr(args, "transport", "auto"),
            "--wire-checksum", getattr(args, "wire_checksum", "xxh3"),
            "--config-json", worker_doc)  # fmt: skip


def start_cluster(
    args: argparse.Namespace, group: ProcessGroup, model_dir: Path
) -> tuple[str, int]:
    """Spawn the Conductor and the workers; returns (conductor endpoint, worker count)."""
    from halfmoon.serve.launch.startup import waiting_line

    if getattr(args, "port", 0):
        reserve_port(args.port)  # the gateway binds it last: not for an internal process
    conductor_port = free_port(args.internal_host)
    endpoint = f"tcp://{args.internal_host}:{conductor_port}"
    log.info("starting the Conductor on %s", endpoint)
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
            group.spawn(f"{role}-{i}", *worker_argv(args, role, i, endpoint, worker_doc), *extra)
            count += 1
    log.info("started %s", ", ".join(f"{c.name} (pid {c.proc.pid})" for c in group.children))
    log.info("%s", waiting_line(count))
    return endpoint, count


async def _serve_gateway(
    args: argparse.Namespace, group: ProcessGroup, model_dir: Path, conductor: str,
    num_workers: int, exposure: tuple[CorsPolicy | None, TlsOptions | None] = (None, None),
) -> None:  # fmt: skip
    from halfmoon.engine.tokenizer import Tokenizer, load_chat_template

    _QuietServer = _make_quiet_server()  # noqa: N806
    from halfmoon.serve.gateway.app import GatewayConfig, create_app
    from halfmoon.serve.gateway.cluster_client import ClusterBackend
    from halfmoon.serve.gateway.generation import defaults_from_args, end_token_ids, startup_line
    from halfmoon.serve.gateway.http_limits import ConnectionLimits, server_config
    from halfmoon.serve.gateway.limits import served_context
    from halfmoon.serve.launch.startup import announce_when_listening, has_page, ready_line

    given = getattr(args, "chat_template", None)
    template = load_chat_template(given) if given else None
    tokenizer = Tokenizer.from_dir(model_dir, template)
    vllm = getattr(args, "engine", "halfmoon") == "vllm"  # (its own pool: max_model_len fits)
    limit = served_context(model_dir, args.max_model_len, None if vllm else args.kv_cache_mb,
                           args.block_size, args.dtype)  # fmt: skip
    backend = ClusterBackend(conductor, group.env[SECRET_ENV].encode(), args.block_size,
                             args.mode, expected_instances=num_workers)  # fmt: skip
    await _wait_ready(backend, group, args.startup_timeout, num_workers)
    config = GatewayConfig(
        (served_names(args.served_model_name) or (model_dir.name.split("-seed")[0],))[0],
        limit.max_model_len,
        max_tokens_limit=getattr(args, "max_tokens_limit", None),
        api_keys=api_keys(args.api_key, os.environ.get(API_KEY_ENV)),
        max_concurrent_requests=args.max_concurrent_requests,
        cache_salt_from_api_key=args.cache_salt_from_api_key,
        public=tuple(args.public or ()),
        access_log=not getattr(args, "disable_access_log", False),
        request_id_headers=getattr(args, "enable_request_id_headers", False),
        dev_endpoints=dev_mode(os.environ),
        sampling_defaults=defaults_from_args(args, model_dir),
        **api_options(args),
        responses_store_bytes=int(getattr(args, "responses_store_mb", 256) * 2**20),
        end_token_ids=end_token_ids(model_dir),
        scheduling_policy=getattr(args, "scheduling_policy", "fcfs"),
        lora_modules=lora_pairs(parse_lora_modules(getattr(args, "lora_modules", None) or ())),
        allow_runtime_lora=runtime_lora_allowed(
            getattr(args, "allow_runtime_lora_updating", False), os.environ
        ),
        profiler=parse_profiler_config(getattr(args, "profiler_config", None)),
        cors=exposure[0],
    )
    app = create_app(backend, tokenizer, config, process_states=group.states)
    tls = exposure[1]
    server = _QuietServer(server_config(app, args.host, args.port, ConnectionLimits(), tls,
                                        **http_options(args)))  # fmt: skip
    log.info(
        "context limit %d tokens (prompt + output), set by %s; max_tokens up to %d",
        limit.max_model_len, limit.source, config.max_tokens_limit,
    )  # fmt: skip
    log.info("%s", startup_line(config.sampling_defaults, args.generation_config,
                                bool(args.override_generation_config)))  # fmt: skip
    loop = asyncio.get_running_loop()
    supervisor = loop.create_task(_supervise(group, backend))

    def stop_serving() -> None:
        # No restarts once asked to stop: a child that got the signal too (a process
        # group's) would otherwise be started again while the gateway drains, and then
        # killed half-started (a vLLM worker then leaves its server's directory behind).
        supervisor.cancel()
        server.should_exit = True

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop_serving)
    replanner = _replanner(args, group, backend, model_dir, conductor)
    replanning = None
    if replanner is not None:
        gateway = app.state.gateway  # its /metrics and cluster page show the rounds
        replanner.metrics, gateway.replan_rounds = gateway.metrics, replanner.rounds
        replanning = loop.create_task(replanner.run())
    page = has_page(app)
    announce = loop.create_task(announce_when_listening(  # the URL, once it answers
        server, args.host, args.port,
        lambda url: ready_line(config.model_name, url, args.mode, num_workers, page), log,
        scheme="https" if tls is not None else "http",
    ))  # fmt: skip
    settle_gc()
    try:
        await server.serve()
    finally:
        supervisor.cancel()
        announce.cancel()
        if replanning is not None:
            replanning.cancel()
        await backend.close()


def _replanner(args: argparse.Namespace, group: ProcessGroup, backend: Any, model_dir: Path,
               conductor: str) -> Any:  # fmt: skip
    """The live re-planner of ``--replan`` (None without it)."""
    from halfmoon.serve.launch.replan import (
        LiveReplanner,
        LocalMover,
        replan_base,
        replan_config_from_args,
    )

    config = replan_config_from_args(args)
    if config is None:
        return None
    worker_doc = engine_json(args, str(model_dir))
    mover = LocalMover(group, backend,
                       lambda role, index: worker_argv(args, role, index, conductor, worker_doc),
                       start_timeout_s=args.startup_timeout)  # fmt: skip
    # Every worker of a local cluster shares this machine's cores.
    base = replan_base(model_dir, args.max_num_seqs, args.decode_guard,
                       float(os.cpu_count() or 1))  # fmt: skip
    log.info("re-planning every %gs over the last %gs of requests (margin %g)",
             config.interval_s, config.window_s, config.margin)  # fmt: skip
    return LiveReplanner(backend, mover, config, base)


async def _wait_ready(
    backend: Any, group: ProcessGroup, timeout_s: float, num_workers: int
) -> None:
    """Wait until every worker has registered, saying how many have when that changes and
    every few seconds (loading the model, building kernels and measuring its cost profile
    take a while the first time: halfmoon.serve.launch.startup)."""
    from halfmoon.serve.launch.startup import WaitReport

    start = time.monotonic()
    wait = WaitReport()
    while True:
        group.check_alive()
        try:
            await backend.health()
            break
        except HalfmoonError as exc:
            waited_s = time.monotonic() - start
            if waited_s > timeout_s:
                raise HalfmoonError(f"cluster not ready after {timeout_s:g}s: {exc}") from None
            report = str(exc) if "registered" in str(exc) else "waiting for the Conductor"
            line = wait.line(report, waited_s)
            if line:
                log.info("%s", line)
            await asyncio.sleep(0.2)
    log.info("cluster ready in %.1fs", time.monotonic() - start)


async def _supervise(group: ProcessGroup, backend: Any, interval_s: float = 0.5) -> None:
    """Restart crashed children for as long as the gateway serves. A worker seen dead is
    reported at once (``backend.instance_exited``): it leaves placement and its requests
    are placed again within ``interval_s``, not after the Conductor's 3 s heartbeat
    timeout."""
    while True:
        await asyncio.sleep(interval_s)
        exited: list[str] = []
        for name in group.supervise(on_exit=exited.append):
            log.info("restarted %s", name)
        for name in exited:
            if name != "conductor":
                await backend.instance_exited(name)


def _make_quiet_server() -> type:
    import uvicorn

    class QuietServer(uvicorn.Server):
        """uvicorn without its own signal capture: the launcher handles SIGINT/SIGTERM so
        that it can stop its children before exiting (uvicorn would re-raise the signal)."""

        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[override]
            yield

    return QuietServer


def check_shape(args: argparse.Namespace) -> None:
    """Refuse contradictory pool and pipeline options before anything starts (and fill in
    the defaults that depend on others)."""
    check_vllm_flags(args)
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
        from halfmoon.serve.vllm.server import vllm_block_size

        vllm_block_size(args.block_size, getattr(args, "vllm_args", ""))  # one halfmoon maps
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
    from halfmoon.serve.launch.replan import replan_config_from_args

    replan_config_from_args(args)  # --replan's options too
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
    if (getattr(args, "max_tokens_limit", None) or 1) < 1:
        raise HalfmoonError("--max-tokens-limit must be >= 1")
    if getattr(args, "responses_store_mb", 0) < 0:
        raise HalfmoonError("--responses-store-mb must be >= 0 (0 keeps no responses)")
    if getattr(args, "override_generation_config", None):
        from halfmoon.serve.gateway.generation import parse_override

        parse_override(args.override_generation_config)  # a bad value fails here, by name
    if getattr(args, "chat_template", None):
        from halfmoon.engine.tokenizer import load_chat_template

        load_chat_template(args.chat_template)  # a missing file fails here, by its name
    roles = ("prefill", "decode") if args.mode == "disaggregated" else ("coupled",)
    # (--dtype auto is resolved once the model is prepared; checked here as its 2 bytes)
    dtype = resolve_dtype(args.dtype, None)
    for role in roles:  # the workers' engine options, checked before any process starts
        try:
            engine_config(argparse.Namespace(**{**vars(args), "role": role, "dtype": dtype}))
        except HalfmoonError as exc:
            raise HalfmoonError(f"{role} workers: {exc}") from None


def run_serve(args: argparse.Namespace) -> int:
    """Start the cluster and serve until interrupted."""
    check_shape(args)
    # Bad CORS or TLS flags: an error before anything starts.
    exposure = (CorsPolicy.from_args(args), TlsOptions.from_args(args))
    args.host = args.host or "127.0.0.1"
    if args.startup_timeout is None:
        # A first start on a busy 2-core machine compiles kernels and measures the cost
        # profile for minutes (later starts take both from the cache in seconds).
        args.startup_timeout = 900.0 if args.engine == "vllm" else 600.0
    log = setup_logging("serve", args.log_level)
    warn_if_public(args.host, log)
    model_dir = prepare_model(args.model, args.seed)
    args.dtype = resolve_dtype(args.dtype, model_dir)  # --dtype auto: the model's, as vLLM
    if args.engine == "vllm" and args.max_model_len is None:
        from halfmoon.serve.vllm.server import fitting_max_model_len

        # vLLM needs one whole context in its pool; the gateway must know the same limit.
        args.max_model_len = fitting_max_model_len(
            model_dir, args.kv_cache_mb, args.block_size, args.dtype, args.vllm_args
        )
    group = ProcessGroup(os.environ.get(SECRET_ENV) or new_secret())
    try:
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is the normal way to stop
            conductor, num_workers = start_cluster(args, group, model_dir)
            asyncio.run(_serve_gateway(args, group, model_dir, conductor, num_workers, exposure))
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
    p.add_argument(
        "--wire-checksum", default="xxh3", choices=WIRE_CHECKSUMS,
        help="KV sent inline over tcp: xxh3 (default: every payload checksummed and "
        "verified) or none (TCP's own checks only; ~10%% less CPU per byte)",
    )  # fmt: skip
    p.add_argument(
        "--served-model-name", nargs="+", default=None, metavar="NAME",
        help="the model's name in the API (default: the model directory's); more names are "
        "aliases a request's 'model' may give too, as vLLM's (metrics and responses of "
        "SGLang's routes use the first)",
    )  # fmt: skip
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
        help="seconds to wait for every worker (default 600; 900 with --engine vllm)",
    )  # fmt: skip
    p.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA "
        f"adapters loaded into every worker while the cluster serves (as vLLM's {RUNTIME_LORA_ENV}"
        "=True, which is honoured too); with --engine vllm through each server's own endpoints",
    )
    p.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=512,
        help="requests in flight beyond this get HTTP 429",
    )
    p.add_argument(
        "--max-tokens-limit", type=int, default=None,
        help="most output tokens one request may ask for (default: the served context, "
        "i.e. the smallest of the model's context, one worker's KV pool and --max-model-len)",
    )  # fmt: skip
    p.add_argument(
        "--generation-config", default="auto", choices=["auto", "vllm"],
        help="sampling defaults for options a request leaves out: 'auto' takes the model's "
        "generation_config.json (temperature, top_p, top_k, min_p, penalties, max_new_tokens), "
        "'vllm' the API's own (temperature 1)",
    )  # fmt: skip
    p.add_argument(
        "--override-generation-config", default=None, metavar="JSON",
        help='sampling defaults on top of --generation-config, e.g. \'{"temperature": 0.5}\'',
    )  # fmt: skip
    p.add_argument(
        "--tool-call-parser", default=None, choices=PARSERS,
        help="read the model's own tool calls out of its text, so that chat requests with "
        "tools may leave tool_choice at 'auto' (hermes: <tool_call>{...}</tool_call> blocks, "
        "as Qwen2.5/3 and Hermes templates ask for; llama3_json: an answer of "
        '{"name", "parameters"} objects, as Llama 3.x writes them; pythonic: an answer '
        'that is a Python list of calls, [f(a=1)], as Llama 3.2 and 4 write them; '
        "mistral: [TOOL_CALLS] and a JSON array, or name[ARGS]{...} per call, as Mistral's "
        "instruct models write them; qwen3_coder: <function=NAME><parameter=KEY>value"
        "</parameter></function> blocks, as Qwen3-Coder writes them); without it such "
        "requests get a 400",
    )  # fmt: skip
    p.add_argument(
        "--reasoning-parser", default=None, choices=REASONING_PARSERS,
        help="tell a thinking model's reasoning from its answer: chat answers carry the "
        "<think>...</think> text as the message's 'reasoning' (Responses: a reasoning item; "
        "Anthropic: a thinking block), the rest as content (deepseek_r1: reasoning until "
        "</think>; qwen3: reasoning only where the prompt or the output opened <think>)",
    )  # fmt: skip
    p.add_argument(
        "--responses-store-mb", type=float, default=256, metavar="MB",
        help="memory for Responses API answers kept for previous_response_id and GET "
        "/v1/responses/{id} (least recently used out first; lost on restart); 0 keeps none",
    )  # fmt: skip
    p.add_argument(
        "--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
        help="the chat template (a Jinja file, or the template text itself), instead of the "
        "model's chat_template.jinja or tokenizer_config.json's",
    )  # fmt: skip
    p.add_argument(
        "--disable-access-log", action="store_true",
        help="no log line per request (method, path, status, tokens, TTFT, total time)",
    )  # fmt: skip
    p.add_argument(
        "--enable-request-id-headers", action="store_true",
        help="every response carries an X-Request-Id header: the client's (which, or a "
        "completion's request_id field, names the response either way), else the "
        "response's id",
    )  # fmt: skip
    p.add_argument("--log-level", default="INFO")
    add_exposure_options(p)
    add_engine_options(p)
    add_vllm_flags(p)
    add_conductor_options(p, "live")
    from halfmoon.serve.launch.replan import add_replan_options

    add_replan_options(p)
    p.set_defaults(func=run_serve, coupled_router=None)  # check_shape: by --engine
