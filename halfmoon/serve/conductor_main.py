"""``halfmoon conductor``: run the Conductor service as its own process."""

from __future__ import annotations

import argparse
import random
from typing import Any

from halfmoon.conductor import EARLY_REJECT_MODES, POLICIES, Conductor, ConductorConfig
from halfmoon.conductor.policies import COUPLED_ROUTERS
from halfmoon.core.clock import WallClock
from halfmoon.core.config import TBT_METRICS, SLOConfig
from halfmoon.costmodel import CostProfile, ProfileCostModel, ThroughputCostModel
from halfmoon.costmodel.base import CostModel
from halfmoon.serve.conductor_service import ConductorService
from halfmoon.serve.runtime import (
    load_secret,
    settle_gc,
    setup_logging,
    stop_event_on_signals,
    warn_if_public,
)


def add_conductor_options(parser: argparse.ArgumentParser) -> None:
    """Scheduling options shared by ``halfmoon conductor`` and ``halfmoon serve``."""
    parser.add_argument("--policy", default="kvcache-centric", choices=list(POLICIES))
    parser.add_argument("--coupled-router", default="cache-aware", choices=COUPLED_ROUTERS)
    parser.add_argument("--ttft-slo", type=float, default=30.0, help="TTFT SLO, seconds")
    parser.add_argument("--tbt-slo", type=float, default=1.0, help="TBT SLO, seconds")
    parser.add_argument("--tbt-metric", default="top10mean", choices=TBT_METRICS)
    parser.add_argument("--early-reject", default="snapshot", choices=EARLY_REJECT_MODES)
    parser.add_argument(
        "--cpp-stages", type=int, default=1,
        help="chunked pipeline parallelism: prefill workers form groups of K consecutive "
        "ones that run long prompts as a K-stage pipeline (1: off)",
    )  # fmt: skip
    parser.add_argument("--cpp-chunk-tokens", type=int, default=1024, help="CPP chunk size, tokens")
    parser.add_argument(
        "--cpp-min-tokens", type=int, default=512,
        help="prompts shorter than this never use a CPP group; longer ones do when the "
        "Conductor estimates a lower TTFT",
    )  # fmt: skip
    parser.add_argument(
        "--cpp-hidden-bytes-per-token", type=int, default=None,
        help="hidden-state bytes per token between CPP stages (default: what the workers "
        "report when they register)",
    )  # fmt: skip


def conductor_config(args: argparse.Namespace) -> ConductorConfig:
    """The ConductorConfig the options describe."""
    return ConductorConfig(
        policy=args.policy,
        block_size_tokens=args.block_size,
        slo=SLOConfig(args.ttft_slo, args.tbt_slo, args.tbt_metric),
        early_reject=args.early_reject,
        coupled_router=args.coupled_router,
        cpp_stages=args.cpp_stages,
        cpp_chunk_tokens=args.cpp_chunk_tokens,
        cpp_min_tokens=args.cpp_min_tokens,
        cpp_hidden_bytes_per_token=getattr(args, "cpp_hidden_bytes_per_token", None),
    )


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
    cost_model = load_cost_model(args.profile, args.kv_bytes_per_token)
    conductor = Conductor(conductor_config(args), cost_model, WallClock(), random.Random(0))
    service = ConductorService(conductor, load_secret(), f"tcp://{args.host}:{args.port}")
    log.info("conductor listening on %s (policy %s)", service.endpoint, args.policy)
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
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    add_conductor_options(p)
    p.set_defaults(func=run_conductor)
