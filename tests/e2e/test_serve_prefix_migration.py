"""A prefix cached on prefill worker A is used by prefill worker B through a transfer."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import openai
import pytest

from .test_serve_disaggregated import _metric


def _until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def two_prefill(cluster_factory, tmp_path_factory):
    ssd = tmp_path_factory.mktemp("ssd")
    return cluster_factory(
        "--prefill", "2", "--decode", "1", "--kv-cache-mb", "64",
        "--store-ssd-dir", str(ssd), "--store-ssd-mb", "32", "--prefix-store", "copy",
    )  # fmt: skip


def _completer(cluster) -> Callable[..., object]:
    """``complete(prompt, n=2)``: a greedy completion of ``n`` tokens from ``cluster``."""
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="none", max_retries=0)

    def complete(prompt, n=2):
        return client.completions.create(
            model="tiny", prompt=prompt, max_tokens=n, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip

    return complete


def test_remote_prefix_is_pulled_not_recomputed(two_prefill):
    complete = _completer(two_prefill)

    prefix = " ".join(f"shared{i}" for i in range(500))
    complete(prefix + " warm")  # the prefix now lives in one prefill worker's store
    holder = [p for p in two_prefill.ping_workers() if p.stats.get("store_blocks")]
    assert len(holder) == 1
    # Keep that worker busy with a long unrelated prompt, so the Conductor prefers the
    # idle worker and has it fetch the prefix instead of waiting or recomputing.
    _until(lambda: two_prefill.ping_conductor().num_placements == 0)  # "warm" released
    busy = threading.Thread(target=complete, args=(" ".join(f"x{i}" for i in range(3000)), 1))
    busy.start()
    # The long prompt must reach the Conductor first: wait until it is placed.
    _until(lambda: two_prefill.ping_conductor().num_placements >= 1)
    bytes_before = _metric(two_prefill, "halfmoon:kv_transfer_bytes_total")
    out = complete(prefix + " then a question")
    busy.join()
    pongs = {p.instance_id: p for p in two_prefill.ping_workers()}
    pulled = {i: p.stats.get("blocks_pulled", 0) for i, p in pongs.items()}
    assert max(pulled.values()) > 0, pongs
    assert out.usage.prompt_tokens_details.cached_tokens >= 900
    assert _metric(two_prefill, "halfmoon:kv_transfer_bytes_total") > bytes_before
    assert all(p.integrity == "ok" for p in pongs.values())


def test_hot_prefix_is_replicated_to_another_prefill_worker(two_prefill):
    """K=8 uses of one prefix within the window make the Conductor copy it (for real)."""
    client = openai.OpenAI(base_url=two_prefill.base_url + "/v1", api_key="none", max_retries=0)
    prefix = " ".join(f"hot{i}" for i in range(200))
    before = {p.instance_id: p.stats["blocks_pulled"] for p in two_prefill.ping_workers()
              if p.role == "prefill"}  # fmt: skip

    def gained() -> int:
        after = [p for p in two_prefill.ping_workers() if p.role == "prefill"]
        return max(p.stats["blocks_pulled"] - before[p.instance_id] for p in after)

    # The copy is asynchronous (the Conductor orders it, the target pulls), and a use
    # counts once the Conductor's index knows the prefix's blocks (their store events):
    # under load either can lag, so keep using the prefix, up to 40 times, until it has.
    for k in range(40):
        client.completions.create(model="tiny", prompt=f"{prefix} question {k}", max_tokens=1)
        if k >= 7 and gained() >= 20:  # ~25 blocks of the hot prefix were copied
            break
    _until(lambda: gained() >= 20, timeout_s=30.0)
    assert k < 20, k  # hot after about K=8 uses, not by chance much later


@pytest.fixture(scope="module")
def two_prefill_demote(cluster_factory):
    return cluster_factory(
        "--prefill", "2", "--decode", "1", "--kv-cache-mb", "64", "--prefix-store", "demote"
    )  # fmt: skip


def test_with_demote_a_prefix_in_a_peers_pool_is_pulled_from_the_pool(two_prefill_demote):
    """--prefix-store demote: a prefill copies nothing into the store, the Conductor still
    knows where the prefix is (the pool's own events), and a peer pulls it out of that
    worker's pool."""
    cluster = two_prefill_demote
    complete = _completer(cluster)

    prefix = " ".join(f"pooled{i}" for i in range(500))
    complete(prefix + " warm")
    prefill = [p for p in cluster.ping_workers() if p.role == "prefill"]
    assert [p.stats["store_blocks"] for p in prefill] == [0, 0]  # nothing copied
    _until(lambda: cluster.ping_conductor().num_placements == 0)
    busy = threading.Thread(target=complete, args=(" ".join(f"y{i}" for i in range(3000)), 1))
    busy.start()
    _until(lambda: cluster.ping_conductor().num_placements >= 1)
    out = complete(prefix + " then a question")
    busy.join()
    pongs = [p for p in cluster.ping_workers() if p.role == "prefill"]
    assert max(p.stats["blocks_pulled"] for p in pongs) > 0, pongs
    assert max(p.stats["blocks_read_for_peers"] for p in pongs) > 0, pongs
    assert out.usage.prompt_tokens_details.cached_tokens >= 900
    assert all(p.integrity == "ok" for p in cluster.ping_workers())
