"""The Conductor's command-line options, declared once.

``halfmoon simulate``, ``halfmoon conductor`` and ``halfmoon serve`` all take the same
scheduling flags from :func:`add_conductor_options`; only their defaults differ, and only
by a named preset (:data:`PRESETS`):

============================  ========  ======  =================================================
setting                       paper     live    why they differ
============================  ========  ======  =================================================
``--early-reject``            none      snapshot  the paper's goodput experiments admit everything
                                                  first; a live cluster should say 429 early
``--tbt-slo`` (s)             0.1       1.0     100 ms on A800s; a CPU decode step is ~10x slower
``--cpp-min-tokens``          2048      512     the paper's long prompts vs a small CPU model's
``--prefill-calibration``     off       on      a live instance runs at the speed its host allows,
                                                  not its profile's
``--decode-kv-booking``       output    prompt  a trace knows each output length and the simulated
                                                  decode instances reserve it; live it is only
                                                  max_tokens, and the engines preempt instead
============================  ========  ======  =================================================

Every other default is common to both. ``paper`` is also :class:`ConductorConfig`'s own
defaults (``halfmoon simulate``); ``live`` is what ``halfmoon serve`` / ``conductor`` use.
Choices are checked by :func:`conductor_config_from_args` (a one-line ``HalfmoonError``
naming the flag), not by argparse, so every command reports them the same way.
"""

from __future__ import annotations

import argparse
from typing import Any

from halfmoon.conductor.calibration import MAX_STDDEVS
from halfmoon.conductor.config import (
    BALANCING_MODES,
    DECODE_KV_BOOKINGS,
    EARLY_REJECT_MODES,
    PREFIX_FETCH_MODES,
    ConductorConfig,
)
from halfmoon.conductor.policies import COUPLED_ROUTERS, POLICIES
from halfmoon.core.config import TBT_METRICS, SLOConfig
from halfmoon.core.errors import HalfmoonError
from halfmoon.core.flags import (
    check_at_least,
    check_choice,
    check_fraction,
    check_positive,
    check_range,
)

_COMMON: dict[str, Any] = {
    "policy": "kvcache-centric",
    "coupled_router": "cache-aware",
    "ttft_slo": 30.0,
    "tbt_metric": "top10mean",
    "cpp_stages": 1,
    "cpp_chunk_tokens": 1024,
    "cpp_hidden_bytes_per_token": None,
    "kvcache_balancing_threshold": 0.1,
    "balancing": "fixed",
    "link_backlog": False,
    # The paper's estimate in both: halfmoon's live workers overlap a fetch with their
    # queue, but estimating it so measured no better (docs/simulation.md, section 7).
    "prefix_fetch": "queued",
    "lateness_stddevs": 0.0,
    "priority_estimates": "on",
    "decode_time_by_prefix": "off",
}
#: Defaults per preset (the table in the module docstring).
PRESETS: dict[str, dict[str, Any]] = {
    "paper": {
        **_COMMON,
        "early_reject": "none",
        "tbt_slo": 0.1,
        "cpp_min_tokens": 2048,
        "prefill_calibration": "off",
        "decode_kv_booking": "output",
    },
    "live": {
        **_COMMON,
        "early_reject": "snapshot",
        "tbt_slo": 1.0,
        "cpp_min_tokens": 512,
        "prefill_calibration": "on",
        "decode_kv_booking": "prompt",
    },
}


def add_conductor_options(parser: argparse.ArgumentParser, preset: str) -> None:
    """The Conductor's scheduling flags, with the defaults of ``preset`` (see PRESETS)."""
    d = PRESETS[preset]
    g = parser.add_argument_group(f"Conductor (defaults: the {preset!r} preset)")
    g.add_argument("--policy", default=d["policy"], help=f"one of {', '.join(POLICIES)}")
    g.add_argument("--coupled-router", default=d["coupled_router"],
                   help=f"one of {', '.join(COUPLED_ROUTERS)}")  # fmt: skip
    g.add_argument("--ttft-slo", type=float, default=d["ttft_slo"], help="TTFT SLO, seconds")
    g.add_argument("--tbt-slo", type=float, default=d["tbt_slo"], help="TBT SLO, seconds")
    g.add_argument("--tbt-metric", default=d["tbt_metric"], help=f"one of {', '.join(TBT_METRICS)}")
    g.add_argument("--early-reject", default=d["early_reject"],
                   help=f"one of {', '.join(EARLY_REJECT_MODES)}")  # fmt: skip
    g.add_argument(
        "--kvcache-balancing-threshold", type=float, default=d["kvcache_balancing_threshold"],
        metavar="F", help="fetch a longer prefix from another instance only when it is "
        "longer than the local one by more than F x the prompt (0..1; 1: never fetch)",
    )  # fmt: skip
    g.add_argument(
        "--balancing", default=d["balancing"],
        help="fixed: use --kvcache-balancing-threshold; adaptive: learn the threshold "
        "online from measured prefill times, starting from (and falling back to) it",
    )  # fmt: skip
    g.add_argument(
        "--link-backlog", action="store_true", default=d["link_backlog"],
        help="price a prefix fetch by the planned backlog of both instances' links (every "
        "fetch, KV hand-off and copy the Conductor plans is booked on them) instead of as "
        "if the network were idle; --balancing adaptive always does",
    )  # fmt: skip
    g.add_argument(
        "--prefix-fetch", default=d["prefix_fetch"], metavar="|".join(PREFIX_FETCH_MODES),
        help="how the Conductor estimates a remote prefix's fetch: queued (when the "
        "request's turn comes, holding the instance: TTFT = queue + fetch + prefill, the "
        "paper's) or overlap (on arrival, while the queue runs, as halfmoon's live workers "
        "pull it: TTFT = max(queue, fetch) + prefill); simulated instances run it the same "
        "way unless --instance-prefix-fetch says otherwise",
    )  # fmt: skip
    g.add_argument(
        "--prefill-calibration", default=d["prefill_calibration"], metavar="on|off",
        help="scale each prefill instance's estimates by how much longer (or shorter) its "
        "finished prefills took than the cost model said, and add how late first tokens "
        "reach clients to the TTFT held against the SLO (both learned online)",
    )  # fmt: skip
    g.add_argument(
        "--lateness-stddevs", type=float, default=d["lateness_stddevs"], metavar="K",
        help="with --prefill-calibration on, hold the learned first-token lateness as its "
        "mean plus K standard deviations (0: the mean; 1.3: about its 90th percentile)",
    )  # fmt: skip
    g.add_argument(
        "--decode-time-by-prefix", default=d["decode_time_by_prefix"], metavar="on|off",
        help="with --early-reject predict, predict each request's decode duration as the "
        "median of the earlier requests sharing its prompt's first block (the others: "
        "by the durations of all)",
    )  # fmt: skip
    g.add_argument(
        "--decode-kv-booking", default=d["decode_kv_booking"], metavar="output|prompt",
        help="what a request must find free in a decode instance's KV pool: output (its "
        "prompt plus its output length, reserved from the start, as simulated decode "
        "instances do) or prompt (its prompt and first token: the engines grow its KV as "
        "it decodes and preempt when full, so a max_tokens bound is not held against the "
        "pool)",
    )  # fmt: skip
    g.add_argument(
        "--priority-estimates", default=d["priority_estimates"], metavar="on|off",
        help="under --scheduling-policy priority, estimate a request's queue from the "
        "prefills its engine serves first (lower or equal priority values, and the one in "
        "service), so urgent requests are placed and admitted by their own wait; off: "
        "from the whole queue, as under fcfs",
    )  # fmt: skip
    g.add_argument(
        "--cpp-stages", type=int, default=d["cpp_stages"],
        help="chunked pipeline parallelism: prefill instances form groups of K consecutive "
        "ones that run long prompts as a K-stage pipeline (1: off)",
    )  # fmt: skip
    g.add_argument("--cpp-chunk-tokens", type=int, default=d["cpp_chunk_tokens"],
                   help="CPP chunk size, tokens")  # fmt: skip
    g.add_argument(
        "--cpp-min-tokens", type=int, default=d["cpp_min_tokens"],
        help="prompts shorter than this never use a CPP group; longer ones do when the "
        "Conductor estimates a lower TTFT",
    )  # fmt: skip
    g.add_argument(
        "--cpp-hidden-bytes-per-token", type=int, default=d["cpp_hidden_bytes_per_token"],
        help="hidden-state bytes per token between CPP stages (default: the model's "
        "hidden size x dtype bytes; live: what the workers report when they register)",
    )  # fmt: skip


def _on(flag: str, value: str) -> bool:
    """An ``on|off`` flag's value as a bool (HalfmoonError naming ``flag`` otherwise)."""
    return check_choice(flag, value, ("on", "off")) == "on"


def conductor_config_from_args(
    args: argparse.Namespace, block_size_tokens: int, hidden_bytes_per_token: int | None = None
) -> ConductorConfig:
    """The ConductorConfig the options describe (raises HalfmoonError naming a bad flag).

    ``block_size_tokens`` is the cluster's (or the trace's) block size; the CPP hidden size
    is the flag's when given, else ``hidden_bytes_per_token``."""
    hidden = args.cpp_hidden_bytes_per_token
    if hidden is not None and hidden < 0:
        raise HalfmoonError(f"--cpp-hidden-bytes-per-token must be >= 0, got {hidden}")
    threshold = check_fraction("--kvcache-balancing-threshold", args.kvcache_balancing_threshold)
    return ConductorConfig(
        policy=check_choice("policy", args.policy, POLICIES),
        block_size_tokens=check_at_least("--block-size", block_size_tokens, 1),
        slo=SLOConfig(
            check_positive("--ttft-slo", args.ttft_slo),
            check_positive("--tbt-slo", args.tbt_slo),
            check_choice("tbt metric", args.tbt_metric, TBT_METRICS),
        ),
        early_reject=check_choice("early-reject mode", args.early_reject, EARLY_REJECT_MODES),
        kvcache_balancing_threshold=threshold,
        balancing=check_choice("balancing mode", args.balancing, BALANCING_MODES),
        link_backlog=bool(args.link_backlog),
        prefix_fetch=check_choice("--prefix-fetch", args.prefix_fetch, PREFIX_FETCH_MODES),
        prefill_calibration=_on("--prefill-calibration", args.prefill_calibration),
        lateness_stddevs=check_range("--lateness-stddevs", args.lateness_stddevs, 0.0, MAX_STDDEVS),
        coupled_router=check_choice("coupled router", args.coupled_router, COUPLED_ROUTERS),
        cpp_stages=check_at_least("--cpp-stages", args.cpp_stages, 1),
        cpp_chunk_tokens=check_at_least("--cpp-chunk-tokens", args.cpp_chunk_tokens, 1),
        cpp_min_tokens=check_at_least("--cpp-min-tokens", args.cpp_min_tokens, 0),
        cpp_hidden_bytes_per_token=hidden if hidden is not None else hidden_bytes_per_token,
        decode_time_by_prefix=_on("--decode-time-by-prefix", args.decode_time_by_prefix),
        priority_estimates=_on("--priority-estimates", args.priority_estimates),
        decode_kv_booking=check_choice(
            "--decode-kv-booking", args.decode_kv_booking, DECODE_KV_BOOKINGS
        ),
    )
