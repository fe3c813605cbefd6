"""The ``--ray`` options of ``halfmoon serve`` and what they ask of Ray (no Ray import).

A worker actor asks for ``--cpus-per-worker`` CPUs, ``--gpus-per-worker`` GPUs and, when
its pool has one, a custom resource (``--prefill-resource prefill`` asks for one unit of
``prefill``; ``prefill:0.5`` for half a unit). Declaring ``--resources '{"prefill": 4}'``
on the nodes that should hold prefill workers pins the pool there.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from halfmoon.core.adapters import lora_pairs, parse_lora_modules, runtime_lora_allowed
from halfmoon.core.errors import HalfmoonError
from halfmoon.core.flags import dev_mode
from halfmoon.core.profiling import parse_profiler_config
from halfmoon.serve.gateway.config import served_names
from halfmoon.serve.gateway.exposure import CorsPolicy, TlsOptions
from halfmoon.serve.gateway.tenancy import api_keys
from halfmoon.serve.launch.launcher import api_options, http_options
from halfmoon.serve.launch.replan import replan_config_from_args
from halfmoon.sim.replan import ReplanConfig

POOL_ROLES = ("prefill", "decode", "coupled")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
NAMESPACE = "halfmoon"


@dataclass(frozen=True)
class ResourceRequest:
    """What one actor asks Ray for."""

    num_cpus: float = 0.0
    num_gpus: float = 0.0
    custom: tuple[tuple[str, float], ...] = ()

    def as_bundle(self) -> dict[str, float]:
        """The request as a placement-group bundle."""
        bundle = {"CPU": self.num_cpus, "GPU": self.num_gpus, **dict(self.custom)}
        return {k: v for k, v in bundle.items() if v > 0}

    def as_options(self) -> dict[str, Any]:
        """The request as keyword arguments of ``ActorClass.options``."""
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus,
                "resources": dict(self.custom)}  # fmt: skip


@dataclass(frozen=True)
class DeployConfig:
    """How ``halfmoon serve --ray`` places the processes of one deployment."""

    address: str = "auto"
    name: str = "halfmoon"
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    #: (role, custom resource, amount) for the pools pinned to node groups.
    pool_resources: tuple[tuple[str, str, float], ...] = ()
    control_resource: tuple[str, float] | None = None
    max_worker_restarts: int = 3
    placement_strategy: str | None = None
    drain_timeout_s: float = 600.0
    detach: bool = False

    def __post_init__(self) -> None:
        if self.cpus_per_worker < 0 or self.gpus_per_worker < 0:
            raise HalfmoonError("--cpus-per-worker and --gpus-per-worker must be >= 0")
        if self.max_worker_restarts < -1:
            raise HalfmoonError("--max-worker-restarts must be >= 0, or -1 for no limit")
        if self.placement_strategy not in (None, *PLACEMENT_STRATEGIES):
            raise HalfmoonError(f"unknown placement strategy {self.placement_strategy!r}")
        if self.drain_timeout_s <= 0:
            raise HalfmoonError("--drain-timeout must be > 0")
        if not self.name or "/" in self.name:
            raise HalfmoonError(f"bad deployment name {self.name!r}")

    def worker_request(self, role: str) -> ResourceRequest:
        """What one worker of ``role`` asks Ray for."""
        if role not in POOL_ROLES:
            raise HalfmoonError(f"unknown worker role {role!r}")
        custom = tuple((res, amount) for r, res, amount in self.pool_resources if r == role)
        return ResourceRequest(self.cpus_per_worker, self.gpus_per_worker, custom)

    def control_request(self) -> ResourceRequest:
        """What the Conductor and the gateway actors ask for (no CPU reserved: they are
        light; the control resource pins them to a node, e.g. the one with a public IP)."""
        custom = (self.control_resource,) if self.control_resource else ()
        return ResourceRequest(0.0, 0.0, custom)

    def actor_name(self, process: str) -> str:
        """Ray name of one process's actor, e.g. ``halfmoon:decode-1``."""
        return f"{self.name}:{process}"


def parse_resource(text: str) -> tuple[str, float]:
    """``NAME`` or ``NAME:AMOUNT`` -> (name, amount); one unit by default."""
    name, _, amount = text.partition(":")
    if not name or name in ("CPU", "GPU", "memory"):
        raise HalfmoonError(f"bad custom resource {text!r}: expected NAME or NAME:AMOUNT")
    try:
        value = float(amount) if amount else 1.0
    except ValueError:
        raise HalfmoonError(f"bad custom resource amount in {text!r}") from None
    if value <= 0:
        raise HalfmoonError(f"custom resource amount must be > 0 in {text!r}")
    return name, value


def add_ray_options(parser: argparse.ArgumentParser) -> None:
    """``--ray`` and the placement options of ``halfmoon serve``."""
    g = parser.add_argument_group("Ray deployment (docs/deployment.md)")
    g.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                   help="place every process as a Ray actor on the cluster at ADDRESS "
                   "(host:port, or auto / no value for the cluster this node belongs to)")  # fmt: skip
    g.add_argument("--deployment-name", default="halfmoon",
                   help="name of the deployment's controller actor (halfmoon cluster --name)")  # fmt: skip
    g.add_argument("--cpus-per-worker", type=float, default=1.0, help="CPUs each worker reserves")
    g.add_argument("--gpus-per-worker", type=float, default=0.0, help="GPUs each worker reserves")
    for role in POOL_ROLES:
        g.add_argument(f"--{role}-resource", default=None, metavar="NAME[:AMOUNT]",
                       help=f"custom resource each {role} worker asks for (pins the pool)")  # fmt: skip
    g.add_argument("--control-resource", default=None, metavar="NAME[:AMOUNT]",
                   help="custom resource the Conductor and gateway ask for")  # fmt: skip
    g.add_argument("--max-worker-restarts", type=int, default=3,
                   help="times Ray restarts a dead worker actor (-1: no limit)")  # fmt: skip
    g.add_argument("--placement-strategy", default=None, choices=PLACEMENT_STRATEGIES,
                   help="reserve the initial workers in one placement group with this strategy")  # fmt: skip
    g.add_argument("--drain-timeout", type=float, default=600.0,
                   help="seconds a removed worker may take to finish its requests")  # fmt: skip
    g.add_argument("--detach", action="store_true",
                   help="return once serving; stop with `halfmoon cluster stop`")  # fmt: skip


def deploy_config(args: argparse.Namespace) -> DeployConfig:
    """The DeployConfig the options describe (raises HalfmoonError on bad input)."""
    pools = []
    for role in POOL_ROLES:
        text = getattr(args, f"{role}_resource", None)
        if text:
            pools.append((role, *parse_resource(text)))
    control = parse_resource(args.control_resource) if args.control_resource else None
    return DeployConfig(
        address=args.ray, name=args.deployment_name, cpus_per_worker=args.cpus_per_worker,
        gpus_per_worker=args.gpus_per_worker, pool_resources=tuple(pools),
        control_resource=control, max_worker_restarts=args.max_worker_restarts,
        placement_strategy=args.placement_strategy, drain_timeout_s=args.drain_timeout,
        detach=args.detach,
    )  # fmt: skip


@dataclass(frozen=True)
class GatewaySpec:
    """What the gateway actor serves (the model directory is prepared on its node)."""

    model: str
    seed: int
    mode: str
    block_size: int
    host: str | None
    port: int
    #: ``--api-key`` values (one per tenant); none: ``$HALFMOON_API_KEY`` on the node.
    api_key: tuple[str, ...] | str | None
    served_model_name: str | None
    max_model_len: int | None
    max_concurrent_requests: int
    startup_timeout_s: float
    cache_salt_from_api_key: bool = False
    #: ``--public`` paths: readable without an API key (GatewayConfig.public).
    public: tuple[str, ...] = ()
    #: ``--chat-template``'s text (read where the command runs), None: the model's own.
    chat_template: str | None = None
    max_tokens_limit: int | None = None
    access_log: bool = True
    #: ``--enable-request-id-headers`` (GatewayConfig.request_id_headers).
    request_id_headers: bool = False
    #: ``VLLM_SERVER_DEV_MODE=1`` where the deployment was made (GatewayConfig.dev_endpoints).
    dev_endpoints: bool = False
    #: The workers' pool and dtype: the served context must fit one worker's KV pool.
    kv_cache_mb: float | None = None
    dtype: str = "float32"
    #: ``--allowed-origins`` ... (CORS) and ``--ssl-*`` (HTTPS; the files must be on the
    #: gateway's node); None: neither (halfmoon.serve.gateway.exposure).
    cors: CorsPolicy | None = None
    tls: TlsOptions | None = None
    #: ``--replan``: the gateway re-plans the P:D split (None: the pools keep their
    #: sizes unless scaled); with the workers' batch limit and decode guard, which the
    #: simulated instances need.
    replan: ReplanConfig | None = None
    max_num_seqs: int = 64
    decode_guard: str = "reject"
    #: ``--generation-config`` and ``--override-generation-config``'s fields (parsed where
    #: the command runs; the model's own file is read on the gateway's node).
    generation_config: str = "auto"
    override_generation_config: tuple[tuple[str, float | int], ...] = ()
    #: ``--responses-store-mb`` in bytes (GatewayConfig.responses_store_bytes).
    responses_store_bytes: int = 256 * 2**20
    #: The engines' ``--scheduling-policy`` (GatewayConfig.scheduling_policy).
    scheduling_policy: str = "fcfs"
    #: The engines' ``--lora-modules`` as ``(name, path)`` (GatewayConfig.lora_modules).
    lora_modules: tuple[tuple[str, str], ...] = ()
    #: ``--allow-runtime-lora-updating`` (or vLLM's switch where the deployment was made):
    #: GatewayConfig.allow_runtime_lora. An adapter's path must be readable on every node.
    allow_runtime_lora: bool = False
    #: ``--profiler-config`` (checked, its directory absolute) as JSON, or None: each
    #: worker writes its traces there on its own node (GatewayConfig.profiler).
    profiler_config: str | None = None
    #: How the API reads and answers requests: GatewayConfig fields
    #: (:func:`~halfmoon.serve.launch.launcher.api_options`), as ``(name, value)`` pairs.
    api_options: tuple[tuple[str, Any], ...] = ()
    #: The HTTP server's options (:func:`~halfmoon.serve.launch.launcher.http_options`).
    http_options: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class DeploySpec:
    """Everything the controller needs to start (and grow) one deployment."""

    config: DeployConfig
    mode: str
    #: Initial pool sizes, e.g. {"prefill": 1, "decode": 2}.
    sizes: tuple[tuple[str, int], ...]
    model: str
    seed: int
    #: The workers' engine options as one JSON document (``halfmoon worker --config-json``);
    #: each node replaces its ``model`` with the directory it prepared.
    engine_json: str
    #: The ConductorConfig as one JSON document (``halfmoon conductor --config-json``).
    conductor_json: str
    gateway: GatewaySpec
    log_level: str = "INFO"

    @property
    def num_workers(self) -> int:
        """Workers started at first."""
        return sum(n for _, n in self.sizes)


def _chat_template(given: str | None) -> str | None:
    """``--chat-template``'s text, read here (the gateway actor may run on another node)."""
    if not given:
        return None
    from halfmoon.engine.tokenizer import load_chat_template

    return load_chat_template(given)


def _override(text: str | None) -> tuple[tuple[str, float | int], ...]:
    """``--override-generation-config``'s fields, checked here."""
    if not text:
        return ()
    from halfmoon.serve.gateway.generation import parse_override

    return tuple(parse_override(text).items())


def deploy_spec(args: argparse.Namespace, engine_json: str, conductor_json: str) -> DeploySpec:
    """The DeploySpec of ``halfmoon serve --ray ARGS``."""
    if args.mode == "coupled":
        sizes: tuple[tuple[str, int], ...] = (("coupled", args.instances),)
    else:
        sizes = (("prefill", args.prefill), ("decode", args.decode))
    if any(n < 1 for _, n in sizes):
        raise HalfmoonError("every pool needs at least 1 worker")
    if getattr(args, "engine", "halfmoon") != "halfmoon":
        raise HalfmoonError("--ray runs halfmoon's own engine only (drop --engine vllm)")
    profiler = parse_profiler_config(getattr(args, "profiler_config", None))
    gateway = GatewaySpec(
        args.model, args.seed, args.mode, args.block_size, args.host, args.port,
        api_keys(args.api_key), (served_names(args.served_model_name) or (None,))[0],
        args.max_model_len,
        args.max_concurrent_requests, args.startup_timeout or 180.0,
        getattr(args, "cache_salt_from_api_key", False), tuple(getattr(args, "public", None) or ()),
        chat_template=_chat_template(getattr(args, "chat_template", None)),
        max_tokens_limit=getattr(args, "max_tokens_limit", None),
        access_log=not getattr(args, "disable_access_log", False),
        request_id_headers=getattr(args, "enable_request_id_headers", False),
        dev_endpoints=dev_mode(os.environ),
        kv_cache_mb=getattr(args, "kv_cache_mb", None), dtype=getattr(args, "dtype", "float32"),
        cors=CorsPolicy.from_args(args), tls=TlsOptions.from_args(args),
        replan=replan_config_from_args(args), max_num_seqs=getattr(args, "max_num_seqs", 64),
        decode_guard=getattr(args, "decode_guard", "reject"),
        generation_config=getattr(args, "generation_config", "auto"),
        override_generation_config=_override(getattr(args, "override_generation_config", None)),
        responses_store_bytes=int(getattr(args, "responses_store_mb", 256) * 2**20),
        scheduling_policy=getattr(args, "scheduling_policy", "fcfs"),
        lora_modules=lora_pairs(parse_lora_modules(getattr(args, "lora_modules", None) or ())),
        allow_runtime_lora=runtime_lora_allowed(
            getattr(args, "allow_runtime_lora_updating", False), os.environ
        ),
        profiler_config=profiler and profiler.to_json(),
        api_options=tuple(api_options(args).items()),
        http_options=tuple(http_options(args).items()),
    )  # fmt: skip
    return DeploySpec(deploy_config(args), args.mode, sizes, args.model, args.seed,
                      engine_json, conductor_json, gateway, args.log_level)  # fmt: skip
