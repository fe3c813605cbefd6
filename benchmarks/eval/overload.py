"""How fast does an overloaded gateway answer? Time to a 429, to a 200, and connections
closed without any answer, under a burst far beyond what a tiny cluster serves.

Run from the repository root::

    .venv/bin/python -m benchmarks.eval.overload [--num-requests 2000] [--concurrency 256]
        [--prompt-tokens 1024] [--max-tokens 32] [--ttft-slo 2] [--shared-pool]
        [--json out.json] [--py-spy DIR] [-- EXTRA SERVE ARGS]

It starts ``halfmoon serve --model tiny --prefill 1 --decode 1`` (one torch thread per
worker, early rejection ``snapshot`` with a ``--ttft-slo`` the burst soon exceeds; extra
arguments after ``--`` go to ``halfmoon serve``, e.g. ``--max-concurrent-requests 32``),
then sends ``--num-requests`` streamed completions from ``--concurrency`` connections,
each sending its next request as soon as it has the last answer. Each prompt is
``--prompt-tokens`` random token ids (distinct per request: no prefix hits), so a few
requests fill the prefill queue and the rest are refused. Per request it records when
the answer's head came (a 200 comes with the first token) and the end of its body; a
429's ``Retry-After``, JSON error and kind of refusal (its first words); a connection
closed before any answer. It prints p50 / p90 / max per outcome and the CPU each process
used per request (the client included: all share the host's cores).

The client is one asyncio loop with an ``httpx.AsyncClient`` per connection.
``--shared-pool`` gives them all one client (one pool of ``--concurrency`` connections),
as ``halfmoon bench`` and most hand-written load scripts do: at 256 connections httpcore
spends most of the client's CPU scanning its pool on every request and response, sends
and reads wait seconds, connections sit idle past the server's 5 s keep-alive and are
closed just as the stalled client reuses them; all of that counts as the server's.

``--py-spy DIR`` samples the gateway and the Conductor with py-spy (``pip install
py-spy``) during the burst into ``DIR/gateway.txt`` and ``DIR/conductor.txt`` (collapsed
stacks, idle ones included, so waits show).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from halfmoon.engine.catalog import cache_dir
from halfmoon.serve.launch.local import LocalCluster, argv_of, children_of


@dataclass
class Outcome:
    """One request as the client saw it."""

    kind: str  # "200", "429", "closed" (no response head), "other"
    start_s: float  # sent, from the start of the burst
    head_s: float  # send -> response head (or -> the failure)
    end_s: float  # send -> body read to the end (or -> the failure)
    status: int = 0  # HTTP status (0: no response)
    retry_after: bool = False
    json_error: bool = False
    detail: str = ""


@dataclass
class Summary:
    """Counts and latency quantiles per outcome (seconds)."""

    num_requests: int
    concurrency: int
    wall_s: float
    counts: dict[str, int] = field(default_factory=dict)
    head_s: dict[str, dict[str, float]] = field(default_factory=dict)
    end_200_s: dict[str, float] = field(default_factory=dict)
    num_429_without_retry_after: int = 0
    num_errors_without_json: int = 0
    details: dict[str, int] = field(default_factory=dict)
    detail_head_s: dict[str, dict[str, float]] = field(default_factory=dict)
    #: CPU milliseconds each process used during the burst, per request sent.
    cpu_ms_per_request: dict[str, float] = field(default_factory=dict)


def quantiles(values: list[float]) -> dict[str, float]:
    """p50, p90, max of ``values`` (empty: {})."""
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": statistics.median(ordered), "p90": at(0.9), "max": ordered[-1]}


async def one(client: httpx.AsyncClient, body: dict[str, Any], t0: float) -> Outcome:
    """Send ``body`` as a streamed completion and classify the answer (``t0``: when the
    burst started, on the ``time.perf_counter`` clock)."""
    sent = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            head = time.perf_counter() - sent
            raw = await r.aread()
            end = time.perf_counter() - sent
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        t = time.perf_counter() - sent
        return Outcome("closed", sent - t0, t, t, detail=f"{type(exc).__name__}: {exc}")
    except httpx.HTTPError as exc:
        t = time.perf_counter() - sent
        return Outcome("other", sent - t0, t, t, detail=f"{type(exc).__name__}: {exc}")
    status = r.status_code
    kind = str(status) if status in (200, 429) else "other"
    message = ""
    if status != 200:
        try:
            message = str(json.loads(raw)["error"]["message"])
        except (ValueError, KeyError, TypeError):
            pass
    elif b"[DONE]" not in raw:
        kind = "other"  # a stream that ended early
    # A 429 is summarised by the kind of refusal (its first words), anything else whole.
    detail = " ".join(message.split()[:4]) if status == 429 else f"HTTP {status}: {raw[:120]!r}"
    return Outcome(
        kind, sent - t0, head, end, status, "retry-after" in r.headers, bool(message),
        "" if kind == "200" else detail,
    )  # fmt: skip


async def burst(
    base_url: str,
    num_requests: int,
    concurrency: int,
    prompt_tokens: int,
    max_tokens: int,
    shared_pool: bool = False,
) -> tuple[list[Outcome], float]:
    """Send the requests from ``concurrency`` connections, each with a client of its own
    (``shared_pool``: one client for all, see the module doc); (outcomes, wall seconds)."""
    rng = random.Random(0)
    bodies = [
        {"model": "tiny", "prompt": [rng.randrange(1, 500) for _ in range(prompt_tokens)],
         "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
        for _ in range(num_requests)
    ]  # fmt: skip
    outcomes: list[Outcome] = []
    timeout = httpx.Timeout(600.0, connect=60.0, pool=600.0)
    pool_size = concurrency if shared_pool else 1
    limits = httpx.Limits(max_connections=pool_size, max_keepalive_connections=pool_size)
    tls = ssl.create_default_context()  # one for all: each costs milliseconds of CPU
    clients = [
        httpx.AsyncClient(
            base_url=base_url, limits=limits, timeout=timeout, verify=tls, trust_env=False
        )
        for _ in range(1 if shared_pool else concurrency)
    ]

    async def connection(client: httpx.AsyncClient) -> None:
        while bodies:
            outcomes.append(await one(client, bodies.pop(), start))

    start = time.perf_counter()
    await asyncio.gather(*(connection(clients[i % len(clients)]) for i in range(concurrency)))
    wall_s = time.perf_counter() - start
    for client in clients:
        await client.aclose()
    return outcomes, wall_s


def summarize(outcomes: list[Outcome], concurrency: int, wall_s: float) -> Summary:
    """Counts and quantiles per outcome."""
    s = Summary(len(outcomes), concurrency, wall_s)
    for kind in ("200", "429", "closed", "other"):
        mine = [o for o in outcomes if o.kind == kind]
        s.counts[kind] = len(mine)
        s.head_s[kind] = quantiles([o.head_s for o in mine])
    s.end_200_s = quantiles([o.end_s for o in outcomes if o.kind == "200"])
    s.num_429_without_retry_after = sum(o.kind == "429" and not o.retry_after for o in outcomes)
    s.num_errors_without_json = sum(o.status not in (0, 200) and not o.json_error for o in outcomes)
    for key in sorted({o.detail[:100] for o in outcomes if o.detail}):
        heads = [o.head_s for o in outcomes if o.detail and o.detail[:100] == key]
        s.details[key] = len(heads)
        s.detail_head_s[key] = quantiles(heads)
    return s


def format_summary(s: Summary) -> str:
    """A few lines of text."""
    lines = [f"{s.num_requests} requests at concurrency {s.concurrency} in {s.wall_s:.1f} s"]
    for kind, q in s.head_s.items():
        spread = ", ".join(f"{k} {v:.3f}" for k, v in q.items())
        lines.append(f"  {kind:>6}: {s.counts[kind]:5d}  head s: {spread}")
    if s.end_200_s:
        spread = ", ".join(f"{k} {v:.3f}" for k, v in s.end_200_s.items())
        lines.append(f"  200 to end of stream s: {spread}")
    lines.append(f"  429 without Retry-After: {s.num_429_without_retry_after}")
    lines.append(f"  errors without a JSON body: {s.num_errors_without_json}")
    for detail, n in sorted(s.details.items(), key=lambda kv: -kv[1])[:8]:
        q = s.detail_head_s[detail]
        lines.append(f"  {n:5d} x {detail} (p50 {q['p50']:.3f} s, max {q['max']:.3f} s)")
    cpu = ", ".join(f"{name} {ms:.2f}" for name, ms in s.cpu_ms_per_request.items())
    lines.append(f"  CPU ms per request: {cpu}")
    return "\n".join(lines)


def start_py_spy(pid: int, out: Path) -> subprocess.Popen | None:
    """py-spy sampling ``pid`` into ``out`` until SIGINT (None without py-spy)."""
    exe = shutil.which("py-spy")
    if exe is None:
        print("py-spy not found on PATH: no profile", file=sys.stderr)
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = [exe, "record", "--pid", str(pid), "--idle", "--format", "raw", "--rate", "50",
            "--output", str(out)]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def processes(cluster: LocalCluster) -> dict[str, int]:
    """PIDs of the gateway (the launcher), the Conductor, the workers and this client."""
    assert cluster.proc is not None
    pids = {"client": os.getpid(), "gateway": cluster.proc.pid}
    for pid in children_of(cluster.proc.pid):
        argv = argv_of(pid)
        if "conductor" in argv:
            pids["conductor"] = pid
        elif "--role" in argv:
            pids[f"{argv[argv.index('--role') + 1]}-{argv[argv.index('--index') + 1]}"] = pid
    return pids


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) ``pid`` has used so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--ttft-slo", type=float, default=2.0)
    parser.add_argument(
        "--shared-pool", action="store_true",
        help="one httpx pool for every connection, as `halfmoon bench` has",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="write the summary and every outcome here")
    parser.add_argument(
        "--py-spy", type=Path, help="profile the gateway and the Conductor into this directory"
    )
    parser.add_argument("serve_args", nargs="*", help="extra `halfmoon serve` arguments")
    args = parser.parse_args(argv)
    serve = [
        "--model", "tiny", "--prefill", "1", "--decode", "1", "--num-threads", "1",
        "--early-reject", "snapshot", "--ttft-slo", str(args.ttft_slo), *args.serve_args,
    ]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="halfmoon-overload-") as tmp:
        cache = cache_dir()  # the tiny preset, written once
        with LocalCluster(serve, cache, secrets.token_hex(16), Path(tmp) / "serve.log") as c:
            pids = processes(c)
            spies = [
                start_py_spy(pids[name], args.py_spy / f"{name}.txt")
                for name in (("gateway", "conductor") if args.py_spy else ())
            ]
            cpu_before = {name: cpu_s(pid) for name, pid in pids.items()}
            try:
                outcomes, wall_s = asyncio.run(
                    burst(c.base_url, args.num_requests, args.concurrency,
                          args.prompt_tokens, args.max_tokens, args.shared_pool)
                )  # fmt: skip
            finally:
                cpu_used = {name: cpu_s(pid) - cpu_before[name] for name, pid in pids.items()}
                for spy in filter(None, spies):
                    spy.send_signal(2)  # SIGINT: py-spy writes what it has
                    spy.wait(60)
            log_tail = (Path(tmp) / "serve.log").read_text()[-2000:]
    summary = summarize(outcomes, args.concurrency, wall_s)
    summary.cpu_ms_per_request = {
        name: round(used * 1e3 / len(outcomes), 2) for name, used in cpu_used.items()
    }
    print(format_summary(summary))
    if summary.counts["closed"] or summary.counts["other"]:
        print("serve log tail:\n" + log_tail, file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(
            {"args": {k: str(v) for k, v in vars(args).items()}, "summary": asdict(summary),
             "outcomes": [asdict(o) for o in outcomes]}, indent=1,
        ))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
