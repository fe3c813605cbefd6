"""``halfmoon simulate``: replay a trace or a synthetic dataset on a simulated cluster."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from halfmoon.conductor.config import PREFIX_FETCH_MODES, ConductorConfig
from halfmoon.conductor.options import add_conductor_options, conductor_config_from_args
from halfmoon.core.config import SLOConfig
from halfmoon.core.errors import HalfmoonError
from halfmoon.core.eviction import POLICY_NAMES
from halfmoon.core.flags import check_choice, check_positive
from halfmoon.core.request import SCHEDULING_POLICIES, Request
from halfmoon.costmodel.base import CostModel
from halfmoon.costmodel.hardware import get_gpu
from halfmoon.costmodel.models import get_model
from halfmoon.costmodel.profile import CostProfile, ProfileCostModel
from halfmoon.costmodel.roofline import build_cost_model
from halfmoon.costmodel.serving import SERVING_TERM_NAMES, ServingTerms
from halfmoon.costmodel.speculation import NO_SPECULATION, SpeculationRates
from halfmoon.metrics.records import records_to_json
from halfmoon.sim.config import DECODE_GUARDS, FIRST_TOKEN_AT, ClusterSpec, SimConfig
from halfmoon.sim.replan import ReplanConfig
from halfmoon.sim.report import format_report
from halfmoon.sim.simulator import SimResult, Simulator
from halfmoon.workload.cli import add_workload_args, with_priority_mix
from halfmoon.workload.datasets import DATASETS, generate_dataset
from halfmoon.workload.tokens import scale_request
from halfmoon.workload.trace import (
    block_tokens_for_scale,
    count_lines,
    iter_trace,
)

_INFINITE = ("inf", "infinite", "none", "unbounded")


def parse_tokens(text: str) -> int | None:
    """A token capacity: an integer >= 0, or ``inf`` for unbounded (None)."""
    if text.strip().lower() in _INFINITE:
        return None
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"capacities take integers >= 0 or 'inf', got {text!r}")
    return value


def make_cost_model(
    model: str,
    gpu: str,
    gpus_per_instance: int,
    profile: str | None = None,
    nic_gbps: float | None = None,
) -> CostModel:
    """The roofline model of one instance, or a measured ``profile`` with the roofline's
    KV size, link and capacity; ``nic_gbps`` overrides the accelerator's network
    bandwidth per GPU (Gbit/s)."""
    spec = get_gpu(gpu)
    if nic_gbps is not None:
        if not (math.isfinite(nic_gbps) and nic_gbps > 0):
            raise HalfmoonError(f"--nic-gbps must be a number > 0, got {nic_gbps}")
        spec = dataclasses.replace(spec, nic_gbps_per_gpu=nic_gbps)
    roofline = build_cost_model(model, spec, gpus_per_instance)
    if profile is None:
        return roofline
    return ProfileCostModel.from_roofline(CostProfile.load(profile), roofline)


def workload_requests(args: argparse.Namespace) -> tuple[Iterable[Request], int | None]:
    """The requests (length-scaled, with ``--priority-mix``'s priorities) and, when cheap
    to know, how many (progress bar)."""
    block_tokens = block_tokens_for_scale(args.length_scale)
    if args.trace is not None:
        if args.rate is not None or args.num_requests is not None:
            raise HalfmoonError("--rate and --num-requests go with --dataset, not --trace")
        total = count_lines(args.trace) if sys.stderr.isatty() else None
        scaled = (scale_request(r, block_tokens) for r in iter_trace(args.trace))
        return with_priority_mix(scaled, args), total
    if args.rate is None or args.num_requests is None:
        raise HalfmoonError("--dataset needs --rate and --num-requests")
    check_choice("dataset", args.dataset, DATASETS)
    requests = generate_dataset(args.dataset, args.rate, args.num_requests, args.seed)
    scaled = [scale_request(r, block_tokens) for r in requests]
    return list(with_priority_mix(scaled, args)), len(requests)


def serving_terms(args: argparse.Namespace, cost_model: CostModel) -> ServingTerms:
    """The serving-path terms: the profile's (if any), each overridden by its flag."""
    base = cost_model.profile.serving if isinstance(cost_model, ProfileCostModel) else None
    given = {name: getattr(args, name, None) for name in SERVING_TERM_NAMES}
    for name, value in given.items():
        if value is not None and not (math.isfinite(value) and value >= 0):
            flag = "--" + name.replace("_", "-")
            raise HalfmoonError(f"{flag} must be a finite number >= 0, got {value}")
    return (base or ServingTerms()).replace(**given)


def speculation_rates(text: str | None) -> SpeculationRates:
    """``--speculation ROWS,TOKENS`` as rates (none when not given); a CLI error names
    the problem."""
    if not text:
        return NO_SPECULATION
    try:
        return SpeculationRates.parse(text)
    except ValueError as exc:
        raise HalfmoonError(f"--speculation: {exc}") from None


def _configs(
    args: argparse.Namespace, serving: ServingTerms | None = None
) -> tuple[SimConfig, ConductorConfig]:
    check_choice("cache policy", args.cache_policy, POLICY_NAMES)
    check_choice("decode guard", args.decode_guard, DECODE_GUARDS)
    spec = get_model(args.model)
    conductor = conductor_config_from_args(
        args, block_tokens_for_scale(args.length_scale), spec.hidden_size * spec.dtype_bytes
    )
    slo = conductor.slo
    sim = SimConfig(
        cluster=ClusterSpec.parse(args.cluster),
        slo=slo,
        num_layers=spec.num_layers,
        prefill_chunk_tokens=args.chunk_tokens,
        cache_capacity_tokens=parse_tokens(args.cache_capacity_tokens),
        cache_policy=args.cache_policy,
        kv_capacity_tokens=args.kv_capacity_tokens,
        decode_tbt_guard=args.decode_guard,
        coupled_prefix_caching=not args.no_coupled_prefix_caching,
        coupled_chunked_prefill=args.coupled_chunked_prefill,
        coupled_token_budget=args.coupled_token_budget,
        time_scale=check_positive("--time-scale", args.time_scale),
        max_requests=args.max_requests,
        serving=serving or ServingTerms(),
        host_cores=args.host_cores,
        first_token_at=args.first_token_at,
        instance_prefix_fetch=args.instance_prefix_fetch,
        scheduling_policy=check_choice(
            "--scheduling-policy", args.scheduling_policy, SCHEDULING_POLICIES
        ),
        speculation=speculation_rates(getattr(args, "speculation", None)),
        speculation_blind=getattr(args, "speculation_blind", False),
    )
    if args.priority_mix and sim.scheduling_policy == "fcfs" and conductor.priority_estimates:
        raise HalfmoonError(
            "--priority-mix under --scheduling-policy fcfs: the instances ignore priorities, "
            "so the Conductor must too (add --priority-estimates off), or use priority"
        )
    return sim, conductor


def _progress(total: int | None) -> tuple[Callable[[], None] | None, Callable[[], None]]:
    """A tqdm bar on stderr when it is a terminal: (per-arrival tick, close)."""
    if not sys.stderr.isatty():
        return None, lambda: None
    from tqdm import tqdm  # only for interactive runs

    bar = tqdm(total=total, desc="simulate", unit="req", file=sys.stderr)
    return bar.update, bar.close


def run_simulate(args: argparse.Namespace) -> int:
    """Build the cluster, replay the workload, print the summary, write JSON / plot."""
    if args.gpus_per_instance < 1:
        raise HalfmoonError(f"--gpus-per-instance must be >= 1, got {args.gpus_per_instance}")
    cost_model = make_cost_model(
        args.model, args.gpu, args.gpus_per_instance, args.profile, args.nic_gbps
    )
    sim_config, conductor_config = _configs(args, serving_terms(args, cost_model))
    requests, total = workload_requests(args)
    if total is not None and args.max_requests is not None:
        total = min(total, args.max_requests)
    replan = None
    if args.replan:
        replan = ReplanConfig(
            interval_s=check_positive("--replan-interval", args.replan_interval),
            window_s=check_positive("--replan-window", args.replan_window),
            cooldown_s=args.replan_interval,
        )
    simulator = Simulator(sim_config, conductor_config, cost_model, seed=args.seed, replan=replan)
    tick, close = _progress(total)
    start = time.perf_counter()
    try:
        result = simulator.run(requests, on_arrival=tick)
    finally:
        close()
    wall_s = time.perf_counter() - start
    print(format_report(result.report))
    for change in result.report["role_changes"]:
        print(f"role change at {change['time_s']:.1f} s: {change['from']} -> {change['to']}")
    print(f"simulated {result.report['num_events']:,} events in {wall_s:.1f} s")
    _write_outputs(args, result)
    return 0


def _write_outputs(args: argparse.Namespace, result: SimResult) -> None:
    if args.json is not None:
        try:
            Path(args.json).write_text(json.dumps(result.report, indent=2) + "\n")
        except OSError as exc:
            raise HalfmoonError(f"cannot write {args.json}: {exc.strerror}") from None
        print(f"report written to {args.json}")
    if args.records is not None:
        try:
            Path(args.records).write_text(json.dumps(records_to_json(result.records)) + "\n")
        except OSError as exc:
            raise HalfmoonError(f"cannot write {args.records}: {exc.strerror}") from None
        print(f"records written to {args.records}")
    if args.plot is not None:
        from halfmoon.metrics.plots import plot_report

        report = result.report
        label = f"{report['cluster']} {report['policy']}"
        slo = SLOConfig(
            report["slo"]["ttft_s"], report["slo"]["tbt_s"], report["slo"]["tbt_metric"]
        )
        plot_report({label: result.records}, slo, args.plot)
        print(f"plot written to {args.plot}")


def add_cost_model_args(parser: argparse.ArgumentParser) -> None:
    """What one instance is (``simulate`` and ``plan``): model, accelerator, network."""
    parser.add_argument("--model", default="llama2-70b", help="model name (costmodel registry)")
    parser.add_argument("--gpu", default="a800", help="accelerator name (costmodel registry)")
    parser.add_argument("--gpus-per-instance", type=int, default=8, help="GPUs per instance")
    parser.add_argument(
        "--nic-gbps", type=float, metavar="G",
        help="network bandwidth per GPU, Gbit/s (default: the accelerator's; e.g. 100 for A800)",
    )  # fmt: skip
    parser.add_argument("--profile", metavar="FILE", help="measured cost profile (JSON)")


def _add_cluster_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", default="8P8D", help="xPyD (e.g. 8P8D) or xM (e.g. 16M)")
    add_cost_model_args(parser)
    parser.add_argument(
        "--cache-capacity-tokens",
        default="3000000",
        help="prefill DRAM cache per instance, tokens (or 'inf')",
    )
    parser.add_argument("--cache-policy", default="lru", help=f"one of {', '.join(POLICY_NAMES)}")
    parser.add_argument(
        "--kv-capacity-tokens",
        type=int,
        help="KV memory per decode/coupled instance (default: cost model)",
    )
    parser.add_argument("--chunk-tokens", type=int, help="prefill chunk size (default: one pass)")
    parser.add_argument(
        "--decode-guard",
        default="reject",
        help=f"decode admission over the TBT SLO: {', '.join(DECODE_GUARDS)}",
    )
    parser.add_argument(
        "--speculation",
        metavar="ROWS,TOKENS",
        help="decode instances speculate (--speculative-config): rows checked and tokens "
        "gained per sequence and step, e.g. a live worker's measured 2.6,1.9 (default: none)",
    )
    parser.add_argument(
        "--speculation-blind",
        action="store_true",
        help="with --speculation: the Conductor and the decode guard estimate steps as if "
        "nothing speculated (a scheduler unaware of it; for comparison)",
    )
    parser.add_argument(
        "--coupled-chunked-prefill",
        action="store_true",
        help="coupled instances mix prompt chunks with decodes (Sarathi)",
    )
    parser.add_argument(
        "--coupled-token-budget", type=int, default=2048, help="tokens per chunked coupled step"
    )
    parser.add_argument(
        "--replan", action="store_true",
        help="re-plan the P:D split as the workload changes: every --replan-interval, "
        "simulate the last --replan-window of arrivals on nearby splits and move up to 4 "
        "instances (drained first) when one wins by 5%% in goodput",
    )  # fmt: skip
    parser.add_argument("--replan-interval", type=float, default=30.0, metavar="S",
                        help="seconds between re-planning rounds (and after a move)")  # fmt: skip
    parser.add_argument("--replan-window", type=float, default=60.0, metavar="S",
                        help="seconds of recent arrivals a round simulates")  # fmt: skip
    parser.add_argument(
        "--scheduling-policy", default="fcfs", metavar="|".join(SCHEDULING_POLICIES),
        help="how prefill and coupled instances order their queues: fcfs, or priority (vLLM's: by "
        "each request's priority, lower first; see --priority-mix: under fcfs the "
        "instances ignore priorities, so the Conductor must too, --priority-estimates off)",
    )  # fmt: skip
    parser.add_argument(
        "--no-coupled-prefix-caching",
        action="store_true",
        help="turn off coupled instances' local prefix cache",
    )


_SERVING_HELP = {
    "request_overhead_s": "seconds per request before placement (HTTP, Conductor round trip)",
    "prefill_handoff_s_per_token": "prefill-instance seconds per prompt token after the "
    "forward (store save, KV streaming, hand-over)",
    "decode_per_seq_overhead_s": "seconds per sequence per decode step outside the forward",
    "decode_step_overhead_s": "seconds per decode step (any batch) outside the forward",
    "kv_import_s_per_token": "seconds per prompt token to import a handed-off request's KV",
    "step_jitter_sigma": "log-space std. dev. of a decode step's time (lognormal, median 1)",
    "step_wait_mean_s": "mean of an exponential wait added to every step (lost time slices)",
    "background_cpu_s_per_token": "CPU seconds of gateway/client per output token (with "
    "--host-cores)",
}


def _add_serving_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "serving path", "time outside the engine's forward (default: the profile's terms, else 0)"
    )
    for name in SERVING_TERM_NAMES:
        flag = "--" + name.replace("_", "-")
        group.add_argument(flag, type=float, dest=name, metavar="S", help=_SERVING_HELP[name])
    group.add_argument(
        "--host-cores",
        type=float,
        help="all instances are single-threaded processes sharing this many CPUs "
        "(one small machine); default: each instance has its own hardware",
    )
    group.add_argument(
        "--first-token-at",
        choices=FIRST_TOKEN_AT,
        default="join",
        help="disaggregated first token: when the decode instance takes the request into "
        "its batch (join, default) or when its KV arrives there (kv: what a live "
        "prefill worker does)",
    )
    group.add_argument(
        "--instance-prefix-fetch",
        choices=PREFIX_FETCH_MODES,
        help="when the instances pull a remote prefix: queued (when the request's turn "
        "comes, holding the instance) or overlap (on arrival, while the queue runs: what "
        "halfmoon's live workers do); default: as the Conductor estimates (--prefix-fetch)",
    )


def register(subparsers: Any) -> None:
    """Add ``halfmoon simulate``."""
    parser = subparsers.add_parser(
        "simulate",
        help="replay a trace or dataset on a simulated cluster driven by the Conductor",
        description="Discrete-event simulation of a disaggregated (xPyD) or coupled (xM) "
        "cluster; prints a summary and optionally writes the JSON report and a plot.",
    )
    add_workload_args(parser, "dataset and random-policy seed")
    _add_cluster_args(parser)
    _add_serving_args(parser)
    add_conductor_options(parser, "paper")
    parser.add_argument("--json", metavar="OUT", help="write the JSON report here")
    parser.add_argument(
        "--records", metavar="OUT", help="write every request's record (JSON, as halfmoon bench)"
    )
    parser.add_argument("--plot", metavar="OUT.png", help="write TTFT/TBT CDFs here")
    parser.set_defaults(func=run_simulate)
