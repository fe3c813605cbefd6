"""``POST /reset_prefix_cache`` through a live cluster started with vLLM's
``VLLM_SERVER_DEV_MODE=1``: every worker forgets its pool's cached prefixes, and with
``reset_external=true`` its block store's too, so the next request of a prompt computes
it afresh (a benchmark's cold start without restarting the cluster)."""

from __future__ import annotations

import httpx
import openai
import pytest

PROMPT = " ".join(f"reset{i}" for i in range(150))


@pytest.fixture(scope="module")
def devmode(cluster_factory):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_SERVER_DEV_MODE", "1")  # the cluster's processes inherit it
        # copy: every prompt block is in the prefill worker's store too (under the
        # default, demote, the store holds only what the pool evicted)
        return cluster_factory("--kv-cache-mb", "64", "--prefix-store", "copy")


def _cached(cluster) -> int:
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="none", max_retries=0)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0)
    return out.usage.prompt_tokens_details.cached_tokens


def _reset(cluster, **params) -> dict:
    r = httpx.post(cluster.base_url + "/reset_prefix_cache", params=params, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_reset_forgets_the_pools_and_with_external_the_stores(devmode):
    assert _cached(devmode) == 0
    assert _cached(devmode) > 100  # from the prefill worker's pool
    assert _reset(devmode) == {"success": True}
    # the pools forgot it; the prefill worker's store still holds it (loaded from there)
    assert _cached(devmode) > 100
    assert _reset(devmode, reset_external="true") == {"success": True}
    prefill = [p for p in devmode.ping_workers() if p.role == "prefill"]
    assert [p.stats["store_blocks"] for p in prefill] == [0]
    assert _cached(devmode) == 0  # computed afresh
    assert _cached(devmode) > 100  # and cached again
    assert all(p.integrity == "ok" for p in devmode.ping_workers())
