"""Live re-planning against fixed splits, on a workload whose mix changes half-way.

Three ``halfmoon serve`` clusters of three workers on this host, one after the other, get
the same requests: first ``--chat-s`` seconds of chat (short prompts, long answers:
decode-heavy), then ``--summary-s`` seconds of summaries (long prompts, short answers:
prefill-heavy), both in bursts of ``--burst`` requests a second (distinct prompts: no
prefix hits). The clusters:

- ``1P2D``: the split planned for chat, fixed;
- ``2P1D``: the split for summaries, fixed;
- ``1P2D+replan``: starts as 1P2D with ``--replan`` (short rounds: ``--interval`` s over
  a ``--window`` s window), so it should move a decode worker to prefill after the shift.

Measured by the client (``halfmoon.bench``): per phase, goodput (requests meeting both
SLOs per second of the phase), SLO attainment and TTFT percentiles; for the summaries
phase also over the requests sent after the re-planned cluster's move completed (the
same span on every cluster), and the same at the ``--report-ttft-slos``. The TTFT SLO
(which the re-planner plans for) is ``--ttft-slo``, else ``--ttft-factor`` x the measured
profile's prefill time of one summary prompt (one prefill worker then meets it for about
half of a burst, two for all of it); the TBT SLO is ``--tbt-slo``. Run from the
repository root::

    .venv/bin/python -m benchmarks.eval.replan_live --ttft-slo 0.6 \
        --json benchmarks/results/replan_live.json
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from halfmoon.bench.client import ClientConfig
from halfmoon.bench.runner import run_benchmark
from halfmoon.bench.workload import BenchRequest, PromptMaker, PromptSpec
from halfmoon.core.config import SLOConfig
from halfmoon.core.request import Request
from halfmoon.costmodel import CostProfile
from halfmoon.metrics.records import records_to_json
from halfmoon.metrics.report import summarize
from halfmoon.serve.launch.local import LocalCluster

CHAT = (24, 48)  # prompt tokens, output tokens
SUMMARY = (960, 2)
BLOCK = 16  # tokens per prompt block (distinct ids per request: no prefix hits)


def workload(chat_s: float, summary_s: float, burst: int) -> list[BenchRequest]:
    """Bursts of ``burst`` requests a second: chat for ``chat_s``, then summaries."""
    planned = []
    next_block = 0
    for phase, shape, start_s, seconds in (("chat", CHAT, 0.0, chat_s),
                                           ("summary", SUMMARY, chat_s, summary_s)):  # fmt: skip
        for second in range(int(seconds)):
            for k in range(burst):
                n_blocks = -(-shape[0] // BLOCK)
                hashes = tuple(range(next_block, next_block + n_blocks))
                next_block += n_blocks
                at_s = start_s + second
                request = Request(f"{phase}-{second}-{k}", at_s, shape[0], shape[1], hashes, BLOCK)
                planned.append(BenchRequest(request, at_s))
    return planned


def _cluster_args(model: str, split: tuple[int, int], slo: SLOConfig, replan: bool,
                  interval_s: float, window_s: float) -> list[str]:  # fmt: skip
    args = ["--model", model, "--kv-cache-mb", "64", "--prefill", str(split[0]),
            "--decode", str(split[1]), "--early-reject", "none", "--ttft-slo", str(slo.ttft_s),
            "--tbt-slo", str(slo.tbt_s)]  # fmt: skip
    if replan:
        args += ["--replan", "--replan-interval", str(interval_s), "--replan-window",
                 str(window_s), "--replan-min-requests", "8"]  # fmt: skip
    return args


def _profile(cache: Path) -> CostProfile:
    paths = sorted((cache / "profiles").glob("*.json"))
    if not paths:
        raise SystemExit(f"no measured profile under {cache}/profiles")
    return CostProfile.load(paths[-1])


def _phase_report(records: list, slo: SLOConfig, since_s: float, until_s: float) -> dict:
    chosen = [r for r in records if since_s <= r.arrival_s < until_s]
    if not chosen:
        return {}
    report = summarize(chosen, slo, duration_s=until_s - since_s)
    return {
        "num_requests": report["num_requests"],
        "num_errors": report["num_errors"],
        "goodput_rps": round(report["goodput_rps"], 3),
        "slo_attainment": round(report["slo_attainment"], 3),
        "ttft_s": {k: round(report["ttft_s"][k], 3) for k in ("p50", "p90", "p99")},
    }


def _rounds(log: str) -> list[str]:
    """The re-planner's rounds and moves, as the launcher logged them."""
    pattern = re.compile(r"re-plan: \w+ (stays|->)|drained; starting|serves as \w+ \(was")
    return [line[:240] for line in log.splitlines() if pattern.search(line)]


def run_one(name: str, args: list[str], cache: Path, planned: list[BenchRequest],
            model: str, tmp: Path) -> dict[str, Any]:  # fmt: skip
    """One cluster through the whole workload: records and the launcher's log."""
    log_path = tmp / f"{name}.log"
    with LocalCluster(args, cache, secrets.token_hex(16), log_path) as cluster:
        config = ClientConfig(cluster.base_url, model, temperature=0.0, timeout_s=300)
        prompts = PromptMaker(PromptSpec(vocab_size=256, min_token_id=10), BLOCK)
        start = time.time()
        run = run_benchmark(planned, config, prompts)
        log = log_path.read_text()
        done = re.search(r"(\S+) serves as (\w+) \(was (\S+)\)", log)
    return {"records": run.records, "log": log, "started": start,
            "moved": done.group(0) if done else None}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run the three clusters and print (and optionally write) the comparison."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--chat-s", type=float, default=30)
    p.add_argument("--summary-s", type=float, default=90)
    p.add_argument("--burst", type=int, default=4)
    p.add_argument("--interval", type=float, default=5.0)
    p.add_argument("--window", type=float, default=15.0)
    p.add_argument(
        "--ttft-factor",
        type=float,
        default=2.2,
        help="TTFT SLO = this x the profile's prefill of one summary prompt",
    )
    p.add_argument(
        "--ttft-slo",
        type=float,
        default=None,
        help="TTFT SLO in seconds (instead of --ttft-factor)",
    )
    p.add_argument(
        "--report-ttft-slos",
        default="0.5,0.6,0.8",
        help="also report each phase's goodput at these TTFT SLOs (seconds)",
    )
    p.add_argument("--tbt-slo", type=float, default=0.5)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--records",
        default=None,
        metavar="OUT",
        help="also write every cluster's request records here (JSON)",
    )
    a = p.parse_args(argv)
    planned = workload(a.chat_s, a.summary_s, a.burst)
    with tempfile.TemporaryDirectory(prefix="replan-live-") as tmp_dir:
        tmp = Path(tmp_dir)
        cache = tmp / "cache"  # shared: the preset, kernels and profile are made once
        probe = LocalCluster(["--model", a.model, "--kv-cache-mb", "64"], cache,
                             secrets.token_hex(16), tmp / "probe.log")  # fmt: skip
        with probe:
            pass
        profile = _profile(cache)
        ttft_s = a.ttft_slo or round(a.ttft_factor * profile.prefill_s(SUMMARY[0]), 3)
        slo = SLOConfig(ttft_s=ttft_s, tbt_s=a.tbt_slo)
        print(
            f"TTFT SLO {slo.ttft_s}s (profile: a {SUMMARY[0]}-token prefill takes "
            f"{profile.prefill_s(SUMMARY[0]):.3f}s), TBT SLO {slo.tbt_s}s",
            flush=True,
        )
        runs = {}
        for name, split, replan in (("1P2D+replan", (1, 2), True), ("1P2D", (1, 2), False),
                                    ("2P1D", (2, 1), False)):  # fmt: skip
            args = _cluster_args(a.model, split, slo, replan, a.interval, a.window)
            runs[name] = run_one(name, args, cache, planned, a.model, tmp)
            print(f"{name}: done; {runs[name]['moved'] or 'no move'}", flush=True)
        if a.records:
            Path(a.records).write_text(json.dumps(
                {name: records_to_json(r["records"]) for name, r in runs.items()}))  # fmt: skip
        # When the re-planned cluster's move completed, in the run's time.
        replanned = runs["1P2D+replan"]
        moved_at_s = _move_time_s(replanned)
        end_s = a.chat_s + a.summary_s
        result: dict[str, Any] = {
            "model": a.model, "slo": {"ttft_s": slo.ttft_s, "tbt_s": slo.tbt_s},
            "workload": {"chat": CHAT, "summary": SUMMARY, "chat_s": a.chat_s,
                         "summary_s": a.summary_s, "burst": a.burst},
            "replan": {"interval_s": a.interval, "window_s": a.window,
                       "move_completed_s": moved_at_s,
                       "rounds": _rounds(replanned["log"])},
            "clusters": {},
        }  # fmt: skip
        for name, r in runs.items():
            rows = {
                "chat": _phase_report(r["records"], slo, 0.0, a.chat_s),
                "summary": _phase_report(r["records"], slo, a.chat_s, end_s),
            }
            if moved_at_s is not None and moved_at_s < end_s:
                rows["summary_after_move"] = _phase_report(r["records"], slo, moved_at_s, end_s)
            for other in (float(x) for x in a.report_ttft_slos.split(",") if x):
                at = SLOConfig(ttft_s=other, tbt_s=slo.tbt_s)
                spans = {"chat": (0.0, a.chat_s), "summary": (a.chat_s, end_s)}
                if moved_at_s is not None and moved_at_s < end_s:
                    spans["summary_after_move"] = (moved_at_s, end_s)
                rows[f"goodput_at_ttft_{other:g}s"] = {
                    span: _phase_report(r["records"], at, *bounds)["goodput_rps"]
                    for span, bounds in spans.items()
                }
            result["clusters"][name] = rows
    print(json.dumps(result, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _move_time_s(run: dict[str, Any]) -> float | None:
    """Seconds after the workload's start when the new worker served (from the log's
    timestamps), None without a move."""
    stamp = re.search(r"^(\S+ \S+).*serves as \w+ \(was", run["log"], re.MULTILINE)
    if stamp is None:
        return None
    import datetime

    for fmt in ("%Y-%m-%d %H:%M:%S,%f", "%Y-%m-%dT%H:%M:%S.%f", "%Y-%m-%d %H:%M:%S.%f"):
        try:
            at = datetime.datetime.strptime(stamp.group(1), fmt).timestamp()
            return round(at - run["started"], 1)
        except ValueError:
            continue
    return None


if __name__ == "__main__":
    sys.exit(main())
