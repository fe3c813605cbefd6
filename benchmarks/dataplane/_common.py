"""Helpers shared by benchmarks.dataplane.transfer and .store: the Mooncake venv,
its processes (always stopped), free ports, result tables and the markdown report."""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from halfmoon.transfer.microbench import KIB, MIB, BenchResult, stop_process

HERE = Path(__file__).resolve().parent
#: Mooncake's venv (mooncake_env.sh makes it), beside the vLLM one in benchmarks/.
MOONCAKE_VENV = HERE.parent / ".mooncake-venv"
MOONCAKE_PKG = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
#: Mooncake's own env knob: bind its TCP transport to loopback, like everything else here.
#: (Mooncake 0.3.13 still listens on all interfaces; every address we give it is 127.0.0.1.)
MOONCAKE_ENV = {
    "MC_TCP_BIND_ADDRESS": "127.0.0.1",
    "GLOG_minloglevel": "2",
    "OPENBLAS_NUM_THREADS": "1",
}


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
    """A child process printing JSON lines, read on a thread (waits never hang)."""

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
                yield self._lines.get(timeout=0.2)
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
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
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
    fields = BenchResult.__dataclass_fields__
    return [BenchResult(**{k: r[k] for k in fields}) for r in records if "gib_per_s" in r]


def find(
    results: Sequence[BenchResult], system: str, op: str, transport: str, size: int
) -> BenchResult | None:
    """The result of one configuration, if measured."""
    for r in results:
        if (r.system, r.op, r.transport, r.block_bytes) == (system, op, transport, size):
            return r
    return None


def write_json(path: str, payload: dict) -> None:
    """Save raw results."""
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")


def alternate_rounds(
    num_rounds: int,
    ours: Callable[[], list[BenchResult]],
    mooncake: Callable[[], list[BenchResult]] | None,
) -> tuple[list[list[BenchResult]], str]:
    """``num_rounds`` rounds of ours then Mooncake's (alternating, so shifts in machine
    load hit both); after Mooncake's first failure, said once on stderr, only ours run.
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


def finish(args: Any, results: list[BenchResult], mooncake_error: str, started_s: float,
           markdown: Callable[[list[BenchResult]], str]) -> None:  # fmt: skip
    """The common tail: elapsed time, ``--markdown`` table, ``--json`` raw results."""
    print(f"({time.monotonic() - started_s:.0f} s)")
    if args.markdown:
        print(markdown(results))
    if args.json:
        write_json(
            args.json, {"results": [r.to_dict() for r in results], "mooncake_error": mooncake_error}
        )
