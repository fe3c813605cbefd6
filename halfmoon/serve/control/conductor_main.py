"""``halfmoon conductor``: run the Conductor service as its own process."""

from __future__ import annotations

import argparse
import random
from typing import Any

from halfmoon.conductor import Conductor, ConductorConfig
from halfmoon.conductor.options import add_conductor_options, conductor_config_from_args
from halfmoon.core.clock import WallClock
from halfmoon.core.errors import HalfmoonError
from halfmoon.core.heap import settle_gc
from halfmoon.costmodel import CostProfile, ProfileCostModel, ThroughputCostModel
from halfmoon.costmodel.base import CostModel
from halfmoon.serve.control.conductor_service import ConductorService
from halfmoon.serve.runtime import (
    load_secret,
    read_config_document,
    setup_logging,
    stop_event_on_signals,
    warn_if_public,
)


def conductor_config(args: argparse.Namespace) -> ConductorConfig:
    """The ConductorConfig of ``--config-json`` (what ``halfmoon serve`` passes: the whole
    config as one document), else the one the flags describe."""
    if args.config_json:
        try:
            return ConductorConfig.from_json(read_config_document(args.config_json))
        except (ValueError, TypeError) as exc:
            raise HalfmoonError(f"--config-json: {exc}") from None
    return conductor_config_from_args(args, args.block_size)


def load_cost_model(path: str | None, kv_bytes_per_token: int) -> CostModel:
    """The measured profile at ``path``, or a conservative CPU default without one."""
    if path:
        profile = CostProfile.load(path)
        return ProfileCostModel(profile, kv_bytes_per_token, 1e9, 1_000_000)
    return ThroughputCostModel(2000.0, kv_bytes_per_token, 1e9, 0.02, 1e-7, 1_000_000)


def run_conductor(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT."""
    log = setup_logging("conductor", args.log_level)
    warn_if_public(args.host, log)
    config = conductor_config(args)
    cost_model = load_cost_model(args.profile, args.kv_bytes_per_token)
    conductor = Conductor(config, cost_model, WallClock(), random.Random(0))
    service = ConductorService(conductor, load_secret(), f"tcp://{args.host}:{args.port}")
    log.info("conductor listening on %s (policy %s, %d-token blocks)", service.endpoint,
             config.policy, config.block_size_tokens)  # fmt: skip
    stop = stop_event_on_signals()
    settle_gc()
    try:
        service.serve_forever(stop=stop.is_set)
    finally:
        service.close()
    return 0


def register(subparsers: Any) -> None:
    """Add ``halfmoon conductor``."""
    p = subparsers.add_parser(
        "conductor",
        help="run the Conductor service (global scheduler) as a process",
        description="Run the Conductor service. The shared secret comes from $HALFMOON_SECRET.",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--profile", help="measured cost profile JSON (halfmoon.costmodel)")
    p.add_argument("--kv-bytes-per-token", type=int, default=16384)
    p.add_argument("--log-level", default="INFO")
    p.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="tokens per KV block: the cluster's (workers with another are refused)",
    )
    p.add_argument(
        "--config-json", default=None, metavar="JSON|PATH",
        help="the whole ConductorConfig as one JSON document (or a file holding it), as "
        "`halfmoon serve` passes it; replaces --block-size and the scheduling options",
    )  # fmt: skip
    add_conductor_options(p, "live")
    p.set_defaults(func=run_conductor)
