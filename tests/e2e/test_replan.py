"""Live re-planning on a real cluster (``halfmoon serve --replan``, tiny preset, 1P2D).

The workload changes half-way: first short prompts with long answers (decode-heavy: the
1P2D split it starts on serves it), then long prompts with short answers in bursts
(prefill-heavy: one prefill worker queues a burst's prompts one after the other, so
with a TTFT SLO of about two prompts' prefill, two prefill workers serve twice as many
within it). The re-planner must keep 1P2D through the first half, then move a decode
worker to prefill: it drains ``decode-1`` (its requests finish), starts ``prefill-1``,
and the cluster serves on as 2P1D. Every request must succeed throughout, and the
Conductor must end with its books balanced. Asserts on roles and counts, never timings.
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from halfmoon.costmodel import CostProfile
from halfmoon.serve.control.messages import WorkloadQuery, WorkloadWindow

#: Short rounds and a short window, so that the test sees a decision within seconds.
REPLAN_ARGS = ("--kv-cache-mb", "64", "--attention", "reference", "--early-reject", "none",
               "--prefill", "1", "--decode", "2", "--replan", "--replan-interval", "4",
               "--replan-window", "12", "--replan-min-requests", "8",
               "--tbt-slo", "0.5")  # fmt: skip
CHAT = (24, 48)  # prompt tokens, output tokens
SUMMARY = (960, 2)
BURST = 4


def _profile(cluster) -> CostProfile:
    """The measured profile the cluster's workers registered with (its cache may hold
    others, measured by clusters of other settings)."""
    window = cluster.call_conductor(WorkloadQuery(window_s=1.0))
    assert isinstance(window, WorkloadWindow) and window.profile, window
    return CostProfile.from_dict(window.profile)


def _ttft_slo_s(profile: CostProfile) -> float:
    """About two summary prefills: one prefill worker meets it for half of a burst."""
    return round(2.2 * profile.prefill_s(SUMMARY[0]), 3)


def _post(client: httpx.Client, shape: tuple[int, int], i: int) -> httpx.Response:
    prompt = [(7 * i + j) % 200 + 10 for j in range(shape[0])]  # distinct: no prefix hits
    body = {"model": "tiny", "prompt": prompt, "max_tokens": shape[1], "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    return client.post("/v1/completions", json=body)


def _roles(cluster) -> dict[str, str]:
    pong = cluster.ping_conductor()
    return {i: r for i, r in pong.instances.items() if i not in pong.draining}


def _phase(cluster, shape, seconds, stop_when=None) -> list[int]:
    """Bursts of BURST requests of ``shape`` every second for ``seconds`` (or until
    ``stop_when()``); returns every response's status."""
    statuses: list[int] = []
    lock = threading.Lock()
    with httpx.Client(base_url=cluster.base_url, timeout=180, trust_env=False) as client, \
            ThreadPoolExecutor(32) as pool:  # fmt: skip
        futures = []
        start = time.monotonic()
        n = 0
        while time.monotonic() - start < seconds:
            if stop_when is not None and stop_when():
                break
            futures += [pool.submit(_post, client, shape, n + k) for k in range(BURST)]
            n += BURST
            time.sleep(max(0.0, start + n / BURST - time.monotonic()))
        for f in futures:
            with lock:
                statuses.append(f.result().status_code)
    return statuses


def test_a_shift_to_long_prompts_moves_a_decode_worker_to_prefill(cluster_factory, tmp_path):
    # The first cluster measures the preset's profile (shared with later ones): the TTFT
    # SLO is set from it, so the test holds on a fast or a slow machine alike.
    probe = cluster_factory("--kv-cache-mb", "64", "--attention", "reference")
    slo = _ttft_slo_s(_profile(probe))
    probe.stop()
    cluster = cluster_factory(*REPLAN_ARGS, "--ttft-slo", str(slo))
    assert sorted(_roles(cluster).values()) == ["decode", "decode", "prefill"]

    chat = _phase(cluster, CHAT, seconds=8)
    assert set(chat) == {200}
    assert sorted(_roles(cluster).values()) == ["decode", "decode", "prefill"]  # stays

    def moved() -> bool:
        return "re-plan: 1P2D -> 2P1D" in cluster.log_path.read_text()

    summaries = _phase(cluster, SUMMARY, seconds=90, stop_when=moved)
    assert set(summaries) == {200}
    log = cluster.log_path.read_text()
    assert moved(), log[-4000:]
    # The rounds before the shift kept the split; the move's round names its goodputs.
    rounds = re.findall(r"re-plan: (1P2D|2P1D) (stays|-> 2P1D) \(\d+ requests; goodput (\{.*\})\)",
                        log)  # fmt: skip
    assert rounds and rounds[-1][1] == "-> 2P1D"
    goodput = json.loads(rounds[-1][2])
    assert goodput["2P1D"] > goodput["1P2D"]

    # decode-1 drains and exits; prefill-1 starts and registers; the cluster serves on.
    deadline = time.monotonic() + 240
    while sorted(_roles(cluster).items()) != [("decode-0", "decode"), ("prefill-0", "prefill"),
                                              ("prefill-1", "prefill")]:  # fmt: skip
        assert time.monotonic() < deadline, cluster.log_path.read_text()[-4000:]
        time.sleep(0.5)
    assert "decode-1 drained; starting prefill-1" in cluster.log_path.read_text()
    after = _phase(cluster, SUMMARY, seconds=3)
    assert set(after) == {200}
    with httpx.Client(base_url=cluster.base_url, timeout=30, trust_env=False) as client:
        assert client.get("/health").json()["status"] == "ok"
        # The operator sees it: /metrics counts the rounds and the move, the cluster page
        # shows the latest round.
        metrics = client.get("/metrics").text
        assert re.search(r'^halfmoon:replan_rounds_total\{.*outcome="move".*\} 1\.0$', metrics,
                         re.M), metrics  # fmt: skip
        assert re.search(r'^halfmoon:replan_moves_total\{.*to_role="prefill".*\} 1\.0$', metrics,
                         re.M), metrics  # fmt: skip
        # The latest round is the move (1P2D -> 2P1D) or, once the cooldown after it has
        # passed, one at 2P1D: which one depends on how fast prefill-1 started (with its
        # kernels cached, the move can end inside the 30 s cooldown).
        (latest,) = client.get("/dashboard/state").json()["replan"]
        assert (latest["split"], latest["target"]) in {("1P2D", "2P1D"), ("2P1D", None)}, latest
        assert latest["goodput_rps"]["2P1D"] > 0
    deadline = time.monotonic() + 30
    while (pong := cluster.ping_conductor()).num_placements:
        assert time.monotonic() < deadline, pong
        time.sleep(0.2)
    assert pong.integrity == "ok"
