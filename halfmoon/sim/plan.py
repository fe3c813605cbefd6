"""``halfmoon plan``: search, with the simulator, the cluster shape and Conductor settings
that give the most goodput on a workload within its SLOs.

The search is coarse to fine, every stage's simulations in parallel
(:mod:`halfmoon.sim.parallel`):

1. the P:D split over a coarse grid (eighths of the instances), every other setting at
   its base (``snapshot`` early rejection, no CPP, the fixed balancing threshold);
2. the splits next to the best one, down to one instance;
3. for the two best splits, one setting changed at a time: early rejection ``none`` and
   ``predict``, CPP with 2 and 4 stages (where the prompts are long enough), and
   ``adaptive`` balancing;
4. the best split with every setting that helped in stage 3 at once;

plus the same instances coupled (``xM``, vLLM-like) as a reference. Results are ranked
by goodput (requests meeting both SLOs per second; within 0.5% counts as a tie), then SLO
attainment, then headroom: the larger of TTFT p90 and TBT p90 as a share of its SLO
(lower is better), so among configurations that all keep up with the load the one
furthest from its limits comes first.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from halfmoon.conductor.config import ConductorConfig
from halfmoon.core.config import TBT_METRICS, SLOConfig
from halfmoon.core.errors import HalfmoonError
from halfmoon.core.flags import check_at_least, check_choice, check_fraction, check_positive
from halfmoon.core.request import Request
from halfmoon.costmodel.base import CostModel
from halfmoon.costmodel.models import get_model
from halfmoon.sim.config import ClusterSpec, SimConfig
from halfmoon.sim.parallel import SimJob, default_processes, run_jobs
from halfmoon.workload.cli import add_workload_args
from halfmoon.workload.trace import block_tokens_for_scale

CPP_STAGES = (2, 4)
#: Goodputs this close (relative) rank as equal: headroom decides between them.
GOODPUT_TIE = 0.005


@dataclass(frozen=True)
class PlanPoint:
    """One configuration: the split (``decode`` 0: ``prefill`` coupled instances) and the
    Conductor settings searched."""

    prefill: int
    decode: int
    early_reject: str = "snapshot"
    cpp_stages: int = 1
    balancing: str = "fixed"

    @property
    def coupled(self) -> bool:
        """Whether this is the coupled (xM) reference."""
        return self.decode == 0

    @property
    def cluster(self) -> str:
        """``8P8D`` or ``16M``."""
        return f"{self.prefill}M" if self.coupled else f"{self.prefill}P{self.decode}D"

    def conductor(self, base: ConductorConfig) -> ConductorConfig:
        """``base`` with this point's settings."""
        return replace(
            base, early_reject=self.early_reject, cpp_stages=self.cpp_stages,
            balancing=self.balancing,
        )  # fmt: skip

    def command(self, slo: SLOConfig, threshold: float, cpp_min_tokens: int) -> str:
        """The ``halfmoon serve`` command line that runs this configuration (the simulated
        CPP threshold spelled out: ``serve``'s own default is lower)."""
        argv = ["halfmoon", "serve"]
        if self.coupled:
            argv += ["--mode", "coupled", "--instances", str(self.prefill)]
        else:
            argv += ["--prefill", str(self.prefill), "--decode", str(self.decode)]
        argv += ["--early-reject", self.early_reject]
        if self.cpp_stages > 1:
            argv += ["--cpp-stages", str(self.cpp_stages), "--cpp-min-tokens", str(cpp_min_tokens)]
        argv += ["--balancing", self.balancing, "--kvcache-balancing-threshold", f"{threshold:g}"]
        argv += ["--ttft-slo", f"{slo.ttft_s:g}", "--tbt-slo", f"{slo.tbt_s:g}"]
        argv += ["--tbt-metric", slo.tbt_metric]
        return shlex.join(argv)


@dataclass(frozen=True)
class PlanResult:
    """A simulated configuration and what it achieved."""

    point: PlanPoint
    report: dict[str, Any]
    stage: int

    @property
    def slo_load(self) -> float:
        """How close the run is to its SLOs: the larger of TTFT p90 / TTFT SLO and
        TBT p90 / TBT SLO (below 1: headroom)."""
        r = self.report
        ttft, tbt = r["ttft_s"]["p90"], r["tbt_s"]["p90"]
        if ttft is None or tbt is None:
            return math.inf
        return max(ttft / r["slo"]["ttft_s"], tbt / r["slo"]["tbt_s"])

    @property
    def rank_key(self) -> tuple[float, float, float]:
        """Best first: most goodput (within ``GOODPUT_TIE`` counts as equal), then SLO
        attainment, then the most headroom (:attr:`slo_load`)."""
        r = self.report
        goodput = r["goodput_rps"]
        bucket = math.floor(math.log(goodput) / math.log1p(GOODPUT_TIE)) if goodput > 0 else -1e9
        return (-bucket, -r["slo_attainment"], self.slo_load)

    def to_json(self, base: ConductorConfig) -> dict[str, Any]:
        """The planner's JSON entry (``--json``)."""
        p, r = self.point, self.report
        threshold = base.kvcache_balancing_threshold
        return {
            "prefill": p.prefill,
            "decode": p.decode,
            "cluster": p.cluster,
            "mode": "coupled" if p.coupled else "disaggregated",
            "goodput_rps": r["goodput_rps"],
            "slo_attainment": r["slo_attainment"],
            "command": p.command(base.slo, threshold, base.cpp_min_tokens),
            "early_reject": "none" if p.coupled else p.early_reject,
            "cpp_stages": p.cpp_stages,
            "balancing": p.balancing,
            "kvcache_balancing_threshold": threshold,
            "ttft_p90_s": r["ttft_s"]["p90"],
            "tbt_p90_s": r["tbt_s"]["p90"],
            "num_rejected": r["num_rejected"],
            "slo_load": self.slo_load,
            "stage": self.stage,
        }


def coarse_splits(instances: int) -> list[int]:
    """Prefill counts of stage 1: eighths of the instances (all when there are few)."""
    if instances < 2:
        raise HalfmoonError(f"--instances must be >= 2 (one prefill, one decode), got {instances}")
    if instances <= 9:
        return list(range(1, instances))
    return sorted({min(instances - 1, max(1, round(instances * k / 8))) for k in range(1, 8)})


class Planner:
    """Runs the staged search of configurations of ``instances`` instances for ``requests``
    (:meth:`run`: every configuration simulated, best first)."""

    def __init__(
        self,
        requests: Sequence[Request],
        cost_model: CostModel,
        sim: SimConfig,
        conductor: ConductorConfig,
        instances: int,
        processes: int | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.requests = list(requests)
        if not self.requests:
            raise HalfmoonError("the workload has no requests")
        self.cost_model = cost_model
        self.sim = sim
        self.base = conductor
        self.instances = instances
        self.processes = processes
        self.log = log or (lambda _: None)
        self.results: dict[PlanPoint, PlanResult] = {}
        self._long_prompts = max(r.input_length for r in self.requests) >= conductor.cpp_min_tokens

    def _run(self, points: Sequence[PlanPoint], stage: int) -> None:
        todo = [p for p in dict.fromkeys(points) if p not in self.results]
        if not todo:
            return
        start = time.perf_counter()
        jobs = [
            SimJob(replace(self.sim, cluster=self._cluster(p)), p.conductor(self.base))
            for p in todo
        ]
        for point, report in zip(
            todo, run_jobs(self.requests, self.cost_model, jobs, self.processes), strict=True
        ):
            self.results[point] = PlanResult(point, report, stage)
        self.log(
            f"stage {stage}: {len(todo)} simulations in {time.perf_counter() - start:.1f} s; "
            f"best so far {self.ranked()[0].point.cluster} "
            f"({self.ranked()[0].report['goodput_rps']:.3f} req/s)"
        )

    @staticmethod
    def _cluster(point: PlanPoint) -> ClusterSpec:
        if point.coupled:
            return ClusterSpec(num_coupled=point.prefill)
        return ClusterSpec(point.prefill, point.decode)

    def ranked(self) -> list[PlanResult]:
        """Every simulated configuration, best first."""
        return sorted(self.results.values(), key=lambda r: r.rank_key)

    def _best_splits(self, count: int) -> list[PlanPoint]:
        base = [r.point for r in self.ranked() if not r.point.coupled]
        seen: list[int] = []
        for point in base:
            if point.prefill not in seen:
                seen.append(point.prefill)
        return [PlanPoint(p, self.instances - p) for p in seen[:count]]

    def run(self) -> list[PlanResult]:
        """All stages; returns every result, best first."""
        n = self.instances
        coarse = coarse_splits(n)
        self._run([PlanPoint(p, n - p) for p in coarse] + [PlanPoint(n, 0)], 1)
        best = self._best_splits(1)[0].prefill
        step = max(1, n // 8)
        near = [p for d in range(1, step + 1) for p in (best - d, best + d) if 0 < p < n]
        self._run([PlanPoint(p, n - p) for p in near], 2)
        variants: list[PlanPoint] = []
        for split in self._best_splits(2):
            variants += [replace(split, early_reject=m) for m in ("none", "predict")]
            variants.append(replace(split, balancing="adaptive"))
            if self._long_prompts:
                variants += [replace(split, cpp_stages=k) for k in CPP_STAGES if k <= split.prefill]
        self._run(variants, 3)
        self._run([self._combined(self._best_splits(1)[0])], 4)
        return self.ranked()

    def _combined(self, split: PlanPoint) -> PlanPoint:
        """``split`` with the setting of each knob that beat the base in stage 3."""
        base = self.results[split].rank_key
        combined = split
        for field in ("early_reject", "cpp_stages", "balancing"):
            tried = [
                r
                for r in self.results.values()
                if r.stage == 3
                and r.point.prefill == split.prefill
                and getattr(r.point, field) != getattr(split, field)
            ]
            better = [r for r in tried if r.rank_key < base]
            if better:
                winner = min(better, key=lambda r: r.rank_key).point
                combined = replace(combined, **{field: getattr(winner, field)})
        return combined


def format_plan(results: Sequence[PlanResult], top: int) -> str:
    """The best ``top`` configurations as a table."""
    from halfmoon.workload.report import format_table

    rows = []
    for rank, r in enumerate(results[:top], 1):
        p, rep = r.point, r.report
        rows.append([
            str(rank), p.cluster, "-" if p.coupled else p.early_reject, str(p.cpp_stages),
            p.balancing, f"{rep['goodput_rps']:.3f}", f"{rep['slo_attainment']:.3f}",
            f"{rep['ttft_s']['p90']:.2f}" if rep["ttft_s"]["p90"] is not None else "-",
            f"{rep['tbt_s']['p90'] * 1e3:.0f}" if rep["tbt_s"]["p90"] is not None else "-",
        ])  # fmt: skip
    header = ["#", "cluster", "early reject", "cpp", "balancing", "goodput req/s",
              "attainment", "TTFT p90 s", "TBT p90 ms"]  # fmt: skip
    return format_table(header, rows)


def run_plan(args: argparse.Namespace) -> int:
    """``halfmoon plan``: load the workload, search, print the best, write JSON."""
    from halfmoon.sim.cli import make_cost_model, workload_requests

    instances = check_at_least("--instances", args.instances, 2)
    processes = default_processes() if args.processes is None else args.processes
    processes = check_at_least("--processes", processes, 1)
    top = check_at_least("--top", args.top, 1)
    slo = SLOConfig(
        check_positive("--ttft-slo", args.ttft_slo),
        check_positive("--tbt-slo", args.tbt_slo),
        check_choice("tbt metric", args.tbt_metric, TBT_METRICS),
    )
    threshold = check_fraction("--kvcache-balancing-threshold", args.kvcache_balancing_threshold)
    if args.gpus_per_instance < 1:
        raise HalfmoonError(f"--gpus-per-instance must be >= 1, got {args.gpus_per_instance}")
    cost_model = make_cost_model(
        args.model, args.gpu, args.gpus_per_instance, args.profile, args.nic_gbps
    )
    spec = get_model(args.model)
    if args.priority_mix:
        raise HalfmoonError("halfmoon plan sizes fcfs clusters: --priority-mix is for "
                            "halfmoon simulate and halfmoon bench")  # fmt: skip
    requests, _ = workload_requests(args)
    requests = list(requests)
    if args.max_requests is not None:
        requests = requests[: check_at_least("--max-requests", args.max_requests, 1)]
    sim = SimConfig(
        cluster=ClusterSpec(1, 1), slo=slo, num_layers=spec.num_layers,
        time_scale=check_positive("--time-scale", args.time_scale),
    )  # fmt: skip
    conductor = ConductorConfig(
        block_size_tokens=block_tokens_for_scale(args.length_scale),
        slo=slo,
        kvcache_balancing_threshold=threshold,
        cpp_hidden_bytes_per_token=spec.hidden_size * spec.dtype_bytes,
    )
    start = time.perf_counter()
    print(
        f"planning {instances} instances for {len(requests)} requests "
        f"({processes} parallel simulations)",
        file=sys.stderr,
    )
    log = (lambda line: print(line, file=sys.stderr)) if not args.quiet else None
    results = Planner(requests, cost_model, sim, conductor, instances, processes, log).run()
    print(format_plan(results, top))
    best = results[0]
    print(f"\nbest: {best.point.cluster}, {best.report['goodput_rps']:.3f} req/s within SLO "
          f"({len(results)} configurations in {time.perf_counter() - start:.0f} s)")  # fmt: skip
    command = best.point.command(slo, threshold, conductor.cpp_min_tokens)
    print(f"serve it: {command} --model MODEL")
    if args.json is not None:
        entries = [r.to_json(conductor) for r in results]
        try:
            Path(args.json).write_text(json.dumps(entries, indent=2) + "\n")
        except OSError as exc:
            raise HalfmoonError(f"cannot write {args.json}: {exc.strerror}") from None
        print(f"plan written to {args.json}")
    return 0


def register(subparsers: Any) -> None:
    """Add ``halfmoon plan``."""
    from halfmoon.sim.cli import add_cost_model_args

    parser = subparsers.add_parser(
        "plan",
        help="search the P:D split and Conductor settings with the most goodput (simulated)",
        description="Simulate the workload on every promising shape of N instances (P:D "
        "split, early rejection, CPP, cache balancing; coarse to fine, in parallel) and "
        "print the best configurations by goodput within the SLOs, with the command that "
        "serves each.",
    )
    add_workload_args(parser, "dataset seed")
    parser.add_argument("--instances", type=int, required=True, help="instances to split")
    add_cost_model_args(parser)
    parser.add_argument("--ttft-slo", type=float, default=30.0, help="TTFT SLO, seconds")
    parser.add_argument("--tbt-slo", type=float, default=0.1, help="TBT SLO, seconds")
    parser.add_argument(
        "--tbt-metric", default="top10mean", help=f"one of {', '.join(TBT_METRICS)}"
    )  # fmt: skip
    parser.add_argument(
        "--kvcache-balancing-threshold", type=float, default=0.1, metavar="F",
        help="the fixed threshold (and adaptive's starting point) of every configuration",
    )  # fmt: skip
    parser.add_argument("--processes", type=int, help="parallel simulations (default: cores)")
    parser.add_argument("--top", type=int, default=5, help="configurations to print")
    parser.add_argument("--json", metavar="OUT", help="write every configuration, best first")
    parser.add_argument("--quiet", action="store_true", help="no per-stage progress on stderr")
    parser.set_defaults(func=run_plan)
