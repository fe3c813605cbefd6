"""A bounded load test: 500 requests at concurrency 32 while a prefill and a decode
worker are SIGKILLed, and then a decode and a prefill worker are frozen (SIGSTOP) for
5 s each. Every request completes or gets a clear error; nothing hangs; the block pools
stay consistent; no process outlives the launcher.

Set ``HALFMOON_RSS_OUT=FILE`` to write each process's peak RSS (docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from .conftest import alive, children_of, processes_mentioning
from .test_faults import _pids

NUM_REQUESTS = 500
CONCURRENCY = 32


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _name(pid: int) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    if "worker" in argv:
        return f"{argv[argv.index('--role') + 1]}-{argv[argv.index('--index') + 1]}"
    return "conductor" if "conductor" in argv else "?"


#: Seconds each frozen worker stays stopped.
FREEZE_S = 5.0


def test_500_requests_at_concurrency_32_with_workers_killed_and_frozen(cluster_factory):
    cluster = cluster_factory("--prefill", "2", "--decode", "2", "--kv-cache-mb", "48")
    outcomes: list[str] = []
    lock = threading.Lock()
    client = httpx.Client(base_url=cluster.base_url, timeout=120)

    def one(i: int) -> str:
        body = {"model": "tiny", "prompt": f"load test request {i} " * (1 + i % 7),
                "max_tokens": 8, "ignore_eos": True, "temperature": 0}  # fmt: skip
        try:
            r = client.post("/v1/completions", json=body)
        except httpx.HTTPError as exc:  # a hang would surface here as a timeout
            return f"transport:{type(exc).__name__}"
        if r.status_code == 200:
            ok = r.json()["usage"]["completion_tokens"] == 8
            result = "ok" if ok else "short"
        else:
            assert r.json()["error"]["message"], r.text  # a clear error, never a bare 500
            result = f"http{r.status_code}"
        with lock:
            outcomes.append(result)
        return result

    def killer() -> None:
        for threshold, role in ((100, "prefill"), (250, "decode")):
            while len(outcomes) < threshold:
                time.sleep(0.05)
            os.kill(_pids(cluster, role)[0], signal.SIGKILL)
        for threshold, role in ((330, "decode"), (420, "prefill")):
            while len(outcomes) < threshold:
                time.sleep(0.05)
            victim = _pids(cluster, role)[-1]
            os.kill(victim, signal.SIGSTOP)
            try:
                time.sleep(FREEZE_S)
            finally:
                os.kill(victim, signal.SIGCONT)

    saboteur = threading.Thread(target=killer, daemon=True)
    saboteur.start()
    start = time.monotonic()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        results = list(pool.map(one, range(NUM_REQUESTS)))
    elapsed = time.monotonic() - start
    saboteur.join(FREEZE_S + 5)
    client.close()

    assert len(results) == NUM_REQUESTS
    assert not [r for r in results if r.startswith("transport") or r == "short"], results
    assert results.count("ok") >= NUM_REQUESTS * 0.9, {r: results.count(r) for r in set(results)}

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            pongs = cluster.ping_workers()
            if len(pongs) == 4 and all(p.num_running == 0 for p in pongs):
                break
        except AssertionError:
            pass
        time.sleep(0.5)
    assert len(pongs) == 4 and all(p.integrity == "ok" for p in pongs), pongs

    children = children_of(cluster.proc.pid)
    rss = {_name(pid): round(_peak_rss_mib(pid), 1) for pid in children}
    rss["launcher+gateway"] = round(_peak_rss_mib(cluster.proc.pid), 1)
    if os.environ.get("HALFMOON_RSS_OUT"):
        Path(os.environ["HALFMOON_RSS_OUT"]).write_text(
            json.dumps(
                {
                    "elapsed_s": round(elapsed, 1),
                    "outcomes": {r: results.count(r) for r in set(results)},
                    "peak_rss_mib": rss,
                },
                indent=2,
            )  # fmt: skip
        )
    cluster.proc.terminate()
    cluster.proc.wait(30)
    assert [pid for pid in children if alive(pid)] == []
    assert processes_mentioning(str(cluster.cache)) == []
