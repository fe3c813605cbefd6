"""The live copy-vs-demote benchmark's own arithmetic (benchmarks/eval/prefix_store_live.py):
reading the store's series out of a scrape, the workload, and comparing the answers. The
benchmark itself starts clusters; it is run by hand (docs/benchmarks.md)."""

from __future__ import annotations

import argparse

from benchmarks.eval.prefix_store_live import compare_answers, metric_sum, store_state, workload

SCRAPE = """\
# HELP halfmoon:kv_store_bytes bytes of KV held
# TYPE halfmoon:kv_store_bytes gauge
halfmoon:kv_store_bytes{model_name="bench",role="prefill",tier="dram",worker="prefill-0"} 1.048576e+06
halfmoon:kv_store_bytes{model_name="bench",role="prefill",tier="dram",worker="prefill-1"} 65536.0
halfmoon:kv_store_bytes{model_name="bench",role="prefill",tier="ssd",worker="prefill-0"} 7.0
halfmoon:kv_store_blocks{model_name="bench",role="prefill",tier="dram",worker="prefill-0"} 16.0
halfmoon:kv_store_blocks{model_name="bench",role="prefill",tier="dram",worker="prefill-1"} 1.0
halfmoon:kv_store_evictions_total{model_name="bench",role="prefill",tier="dram",worker="prefill-0"} 5.0
halfmoon:prefix_cache_hits_total{model_name="bench",role="gateway",worker="gateway"} 128.0
halfmoon:prefix_cache_hits_total{model_name="bench",role="prefill",worker="prefill-0"} 999.0
halfmoon:scrape_errors_total 0.0
"""


def test_metric_sum_adds_the_matching_samples_only():
    assert metric_sum(SCRAPE, "halfmoon:kv_store_bytes", tier="dram") == 1048576 + 65536
    assert metric_sum(SCRAPE, "halfmoon:kv_store_bytes") == 1048576 + 65536 + 7
    assert metric_sum(SCRAPE, "halfmoon:kv_store_bytes", worker="prefill-1") == 65536
    assert metric_sum(SCRAPE, "halfmoon:scrape_errors_total") == 0.0
    assert metric_sum(SCRAPE, "halfmoon:kv_store") == 0.0  # a prefix of a name is not it
    assert metric_sum(SCRAPE, "halfmoon:kv_store_bytes", tier="nvme") == 0.0


def test_store_state_sums_the_prefill_workers_dram_tier():
    state = store_state(SCRAPE)
    assert state["store_bytes"] == 1048576 + 65536
    assert state["store_blocks"] == 17
    assert state["store_evictions"] == 5
    assert state["prefix_hits"] == 128  # the gateway's count, not the worker's


def _args(**kw) -> argparse.Namespace:
    base = dict(seed=3, documents=5, doc_tokens=32, question_tokens=4, zipf=0.8, requests=40)
    return argparse.Namespace(**{**base, **kw})


def test_workload_is_deterministic_and_shares_documents():
    prompts = workload(_args())
    assert prompts == workload(_args())
    assert prompts != workload(_args(seed=4))
    assert all(len(p) == 36 for p in prompts)
    docs = {tuple(p[:32]) for p in prompts}
    assert 1 < len(docs) <= 5  # documents repeat
    assert len({tuple(p[32:]) for p in prompts}) > 35  # questions (almost all) do not


def _answers(size: float, policy: str, texts: list[str], logprobs: list[float]) -> dict:
    tokens = [[t] for t in texts]
    return {"store_mb": size, "policy": policy, "texts": texts, "tokens": tokens,
            "logprobs": [[x] for x in logprobs]}  # fmt: skip


def test_compare_answers_lists_the_requests_that_differ():
    records = [
        _answers(1.0, "copy", ["a", "b", "c"], [-1.0, -2.0, -3.0]),
        _answers(1.0, "demote", ["a", "x", "c"], [-1.25, -9.0, -3.0]),
        _answers(2.0, "copy", ["a", "b", "c"], [-1.0, -2.0, -3.0]),
        _answers(2.0, "demote", ["a", "b", "c"], [-1.0, -2.0, -3.0]),
        _answers(4.0, "copy", ["a"], [-1.0]),  # alone: nothing to compare
    ]
    records[3]["tokens"][2] = ["c", "d"]  # the same text from other tokens
    assert compare_answers(records) == {
        "1": {"num_differ": 1, "first_differ": [1], "max_logprob_diff": 0.25},
        "2": {"num_differ": 1, "first_differ": [2], "max_logprob_diff": 0.0},
    }
