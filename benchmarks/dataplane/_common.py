"""Helpers shared by benchmarks.dataplane.transfer and .store: the Mooncake venv, its
tuning, its processes (always stopped), free ports, per-round ratios, the loopback
ceiling rows, result tables and the JSON report."""

from __future__ import annotations

import json
import os
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from halfmoon.transfer.microbench import (
    GIB,
    KIB,
    MIB,
    BenchResult,
    Step,
    VerificationError,
    stop_process,
)

from .loopback_ceiling import pairs_gib_s

HERE = Path(__file__).resolve().parent
#: Mooncake's venv (mooncake_env.sh makes it), beside the vLLM one in benchmarks/.
MOONCAKE_VENV = HERE.parent / ".mooncake-venv"
MOONCAKE_PKG = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
#: Mooncake's TCP slice (``MC_TCP_SLICE_SIZE``; its default is 64 KiB). 1 MiB matches the
#: slices our tcp transport sends.
DEFAULT_MOONCAKE_SLICE_BYTES = MIB


def mooncake_env(
    slice_bytes: int = DEFAULT_MOONCAKE_SLICE_BYTES, extra: Sequence[str] = ()
) -> dict[str, str]:
    """The environment of every Mooncake process: Mooncake's documented knobs, tuned for
    TCP on one host, then ``extra`` ``KEY=VALUE`` overrides.

    - ``MC_TCP_BIND_ADDRESS``: bind its TCP transport to loopback like everything here.
    - ``MC_TCP_SLICE_SIZE``: bytes per TCP slice (default 65536).
    - ``MC_TCP_ENABLE_CONNECTION_POOL``: keep TCP connections open between transfers
      (Transfer Engine "Advanced Runtime Options").
    - ``MC_STORE_CLIENT_METRIC=0``: no client-side metrics collection (on by default).
    """
    env = {
        "MC_TCP_BIND_ADDRESS": "127.0.0.1",
        "MC_TCP_SLICE_SIZE": str(slice_bytes),
        "MC_TCP_ENABLE_CONNECTION_POOL": "1",
        "MC_STORE_CLIENT_METRIC": "0",
        "GLOG_minloglevel": "2",
        "OPENBLAS_NUM_THREADS": "1",
    }
    for item in extra:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--mooncake-env wants KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def add_mooncake_options(parser: Any) -> None:
    """``--no-mooncake``, ``--mooncake-slice-bytes`` and ``--mooncake-env``."""
    parser.add_argument("--no-mooncake", action="store_true")
    parser.add_argument(
        "--mooncake-slice-bytes",
        type=int,
        default=DEFAULT_MOONCAKE_SLICE_BYTES,
        help="Mooncake's MC_TCP_SLICE_SIZE (its own default: 65536)",
    )
    parser.add_argument(
        "--mooncake-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another Mooncake environment setting (repeatable; recorded in the output)",
    )


def parse_size(text: str) -> int:
    """``64K`` / ``1M`` / ``4096`` -> bytes."""
    text = text.strip().upper()
    for suffix, scale in (("K", KIB), ("M", MIB), ("G", 1 << 30)):
        if text.endswith(suffix):
            return int(text[:-1]) * scale
    return int(text)


def size_label(num_bytes: int) -> str:
    """1048576 -> ``1M``."""
    return f"{num_bytes // MIB}M" if num_bytes >= MIB else f"{num_bytes // KIB}K"


def mooncake_python() -> Path:
    """The Mooncake venv's interpreter, created (with libibverbs1) on first use."""
    python = MOONCAKE_VENV / "bin" / "python"
    probe = (
        [str(python), "-c", "import mooncake.engine, mooncake.store"] if python.exists() else None
    )
    if probe is None or subprocess.run(probe, capture_output=True).returncode != 0:
        print(f"setting up {MOONCAKE_VENV} with {MOONCAKE_PKG} ...", file=sys.stderr)
        subprocess.run(["bash", str(HERE / "mooncake_env.sh"), str(MOONCAKE_VENV)], check=True)
    return python


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JsonProcess:
    """A child process printing JSON lines, read on a thread (waits never hang).

    A ``{"verification_error": ...}`` record (Mooncake's peer found wrong bytes) raises
    :class:`VerificationError` wherever records are read.
    """

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self._lines: queue.Queue[dict] = queue.Queue()
        self.stderr_tail: list[str] = []
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self._lines.put(json.loads(line))

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr_tail = (self.stderr_tail + [line.rstrip()])[-20:]

    def records(self, timeout_s: float) -> Iterator[dict]:
        """JSON records until the process exits (or ``timeout_s`` passes: RuntimeError)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                record = self._lines.get(timeout=0.2)
                if "verification_error" in record:
                    raise VerificationError(f"Mooncake: {record['verification_error']}")
                yield record
                continue
            except queue.Empty:
                pass
            if self.proc.poll() is not None and self._lines.empty():
                if self.proc.returncode:
                    raise RuntimeError(
                        f"{self.proc.args[:3]} failed: {' | '.join(self.stderr_tail[-5:])}"
                    )
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.proc.args[:3]} timed out: {' | '.join(self.stderr_tail[-5:])}"
                )

    def first(self, key: str, timeout_s: float = 60.0) -> dict:
        """The first record holding ``key``."""
        for record in self.records(timeout_s):
            if key in record:
                return record
        raise RuntimeError(
            f"{self.proc.args[:3]} exited without a {key!r} record: {self.stderr_tail[-5:]}"
        )

    def send(self, line: str) -> None:
        """One line on the child's stdin."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        """Close stdin (the child's cue to exit), kill it if it lingers."""
        stop_process(self.proc)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


@contextmanager
def processes() -> Iterator[list[JsonProcess]]:
    """Collects child processes; every one is stopped on exit, whatever happened."""
    started: list[JsonProcess] = []
    try:
        yield started
    finally:
        for proc in reversed(started):
            proc.stop()


def results_from(records: Sequence[dict]) -> list[BenchResult]:
    """BenchResults out of Mooncake's JSON rows (skipping other records)."""
    return [BenchResult.from_dict(r) for r in records if "gib_per_s" in r]


def check_plan(results: Sequence[BenchResult], plan: Sequence[Step]) -> None:
    """Mooncake's rows must have moved the plan's blocks per batch (RuntimeError if not)."""
    blocks = {step.block_bytes: step.num_blocks for step in plan}
    for r in results:
        if r.num_blocks != 1 and r.num_blocks != blocks.get(r.block_bytes):
            raise RuntimeError(
                f"Mooncake's {r.op} at {r.block_bytes} B moved {r.num_blocks} blocks per "
                f"batch, ours {blocks.get(r.block_bytes)}"
            )


def find(
    results: Sequence[BenchResult], system: str, op: str, transport: str, size: int
) -> BenchResult | None:
    """The result of one configuration, if measured."""
    for r in results:
        if (r.system, r.op, r.transport, r.block_bytes) == (system, op, transport, size):
            return r
    return None


#: A figure read out of one round's results (None: not measured).
Figure = Callable[[Sequence[BenchResult]], "float | None"]


def figure(system: str, op: str, transport: str, size: int, attr: str = "gib_per_s") -> Figure:
    """The ``attr`` of one configuration."""

    def read(results: Sequence[BenchResult]) -> float | None:
        found = find(results, system, op, transport, size)
        return None if found is None else getattr(found, attr)

    return read


@dataclass(frozen=True)
class Ratio:
    """``ours`` over ``theirs``, computed in every round; ``label`` names what is
    compared (transports on both sides) and ``unit`` how the ratio prints (x or %)."""

    label: str
    ours: Figure
    theirs: Figure
    unit: str = "x"

    def per_round(self, rounds: Sequence[Sequence[BenchResult]]) -> list[float]:
        """One ratio per round where both figures were measured."""
        values = []
        for one_round in rounds:
            ours, theirs = self.ours(one_round), self.theirs(one_round)
            if ours is not None and theirs:
                values.append(ours / theirs)
        return values

    def format(self, value: float) -> str:
        """``1.72x`` or ``85%``."""
        return f"{100 * value:.0f}%" if self.unit == "%" else f"{value:.2f}x"


def ratio_report(
    ratios: Sequence[Ratio], rounds: Sequence[Sequence[BenchResult]]
) -> tuple[list[str], dict[str, list[float]]]:
    """Printed lines (median over rounds, then every round) and the per-round values."""
    lines, values = [], {}
    for ratio in ratios:
        per_round = ratio.per_round(rounds)
        if not per_round:
            continue
        values[ratio.label] = per_round
        listed = ", ".join(ratio.format(v) for v in per_round)
        median = ratio.format(statistics.median(per_round))
        lines.append(f"{ratio.label} = {median}  (per round: {listed})")
    return lines, values


def ceiling_rows(seconds: float) -> list[BenchResult]:
    """One-way loopback tcp of a cold 64 MiB span without our code (two bare sender /
    receiver process pairs, 1 MiB writes; loopback_ceiling.py), without and with xxh3 on
    both sides; ``gib_per_s`` is the one-way figure."""
    return [
        _ceiling_row("bare", pairs_gib_s(seconds, checksum=False)),
        _ceiling_row("bare+xxh3", pairs_gib_s(seconds, checksum=True)),
    ]


def _ceiling_row(sender: str, gib_s: float) -> BenchResult:
    return BenchResult("ceiling", "one-way", sender, MIB, 1, gib_s, MIB / gib_s / GIB, 0.0)


def markdown(results: Sequence[BenchResult]) -> str:
    """Results as a markdown table."""
    rows = [
        "| system | op | transport | block | blocks | GiB/s | batch ms (p50) "
        "| 1-block us (p50) | 1-block us (p99) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rows.append(
            f"| {r.system} | {r.op} | {r.transport} | {size_label(r.block_bytes)} "
            f"| {r.num_blocks} | {r.gib_per_s:.2f} | {r.batch_s_p50 * 1e3:.2f} "
            f"| {r.op_us_p50:.0f} | {r.op_us_p99:.0f} |"
        )
    return "\n".join(rows)


def alternate_rounds(
    num_rounds: int,
    ours: Callable[[], list[BenchResult]],
    mooncake: Callable[[], list[BenchResult]] | None,
) -> tuple[list[list[BenchResult]], str]:
    """``num_rounds`` rounds of ours then Mooncake's (alternating, so shifts in machine
    load hit both); after Mooncake's first failure to run, said once on stderr, only ours
    run. Wrong bytes (:class:`VerificationError`) are not such a failure: they propagate.
    Returns the rounds and that failure ("" if none)."""
    rounds: list[list[BenchResult]] = []
    mooncake_error = ""
    for _ in range(num_rounds):
        one_round = ours()
        if mooncake is not None and not mooncake_error:
            try:
                one_round += mooncake()
            except (RuntimeError, OSError) as exc:
                mooncake_error = str(exc)
                print(f"Mooncake could not run: {exc}", file=sys.stderr)
        rounds.append(one_round)
    return rounds, mooncake_error


def print_env(env: dict[str, str], what: str = "Mooncake env") -> None:
    """``Mooncake env: K=V K=V`` on one line."""
    print(f"{what}: " + " ".join(f"{k}={v}" for k, v in env.items()))


def finish(
    args: Any, report: dict[str, Any], results: Sequence[BenchResult], started_s: float
) -> None:
    """The common tail: elapsed time, ``--markdown`` table, ``--json`` with the options,
    every round's rows, the medians and the per-round ratios in ``report``."""
    print(f"({time.monotonic() - started_s:.0f} s)")
    if args.markdown:
        print(markdown(results))
    if args.json:
        payload = {"options": vars(args), **report}
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")


def run_report(
    rounds: Sequence[Sequence[BenchResult]],
    results: Sequence[BenchResult],
    ratios: dict[str, list[float]],
    **extra: Any,
) -> dict[str, Any]:
    """The JSON report: every round's rows, the medians over rounds, per-round ratios."""
    return {
        "rounds": [[r.to_dict() for r in one_round] for one_round in rounds],
        "results": [r.to_dict() for r in results],
        "ratios_per_round": ratios,
        **extra,
    }
