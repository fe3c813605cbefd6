"""A worker's own registry (halfmoon.serve.worker.metrics): the request clocks, the step
figures, the load gauges and the block store's figures, in-process with a fake clock;
and a worker answering ``metrics_query``."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from halfmoon.engine.engine import EngineStats
from halfmoon.serve.control.messages import (
    MetricsQuery,
    MetricsText,
    decode_message,
    encode_message,
)
from halfmoon.serve.runtime import free_port
from halfmoon.serve.worker.conductor_link import ConductorLink, WorkerIdentity
from halfmoon.serve.worker.metrics import WorkerMetrics
from halfmoon.serve.worker.process import Worker
from halfmoon.store import BlockMeta, StoreConfig, TieredStore
from tests.serve.fakes import IdleRole

BLOCK_BYTES = 4096
SECRET = b"worker-metrics-secret"


class _Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _out(rid: str, *tokens: int) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, new_token_ids=tokens)


@pytest.fixture
def clock() -> _Clock:
    return _Clock()


@pytest.fixture
def metrics(clock) -> WorkerMetrics:
    return WorkerMetrics(clock=clock)


def _value(m: WorkerMetrics, name: str, **labels: str) -> float:
    value = m.registry.get_sample_value(name, labels)
    assert value is not None, name
    return value


def test_fcfs_queue_then_prefill_then_decode(metrics, clock):
    """Two requests queue at t=0; the first runs in the step at t=1 (one still waits), the
    second in the step at t=2; tokens come at the end of each step."""
    metrics.request_queued("a", 40)
    metrics.request_queued("b", 7)
    metrics.observe_step(1.0, 0.5, [_out("a", 11)], num_waiting=1)
    metrics.observe_step(2.0, 0.25, [_out("a", 12), _out("b", 21)], num_waiting=0)
    metrics.observe_step(3.0, 0.25, [_out("a", 13), _out("b", 22)], num_waiting=0)
    metrics.request_finished("a", 3)
    metrics.request_finished("b", 2)
    assert _value(metrics, "halfmoon:request_queue_time_seconds_sum") == pytest.approx(1.0 + 2.0)
    assert _value(metrics, "halfmoon:request_prefill_time_seconds_sum") == pytest.approx(0.75)
    assert _value(metrics, "halfmoon:request_prompt_tokens_sum") == 47
    assert _value(metrics, "halfmoon:request_prompt_tokens_count") == 2
    assert _value(metrics, "halfmoon:request_generation_tokens_sum") == 5
    # a: first token at 1.5, last at 3.25; b: 2.25 -> 3.25.
    assert _value(metrics, "halfmoon:request_decode_time_seconds_sum") == pytest.approx(2.75)
    # Gaps: a 0.75 and 1.0, b 1.0.
    assert _value(metrics, "halfmoon:time_per_output_token_seconds_sum") == pytest.approx(2.75)
    assert _value(metrics, "halfmoon:time_per_output_token_seconds_count") == 3
    assert _value(metrics, "halfmoon:engine_step_seconds_count", phase="prefill") == 2
    assert _value(metrics, "halfmoon:engine_step_seconds_count", phase="decode") == 1
    assert _value(metrics, "halfmoon:engine_batch_size_sum") == 1 + 2 + 2
    assert metrics.num_tracked == 0


def test_a_decode_worker_counts_decode_only(metrics, clock):
    clock.now_s = 10.0
    metrics.request_joined("r")
    metrics.observe_step(10.0, 0.1, [_out("r", 5)], num_waiting=0)
    metrics.observe_step(10.1, 0.1, [_out("r", 6)], num_waiting=0)
    metrics.request_finished("r", 3)
    assert _value(metrics, "halfmoon:request_decode_time_seconds_sum") == pytest.approx(0.2)
    assert _value(metrics, "halfmoon:request_generation_tokens_sum") == 3
    assert _value(metrics, "halfmoon:request_prompt_tokens_count") == 0
    assert _value(metrics, "halfmoon:request_queue_time_seconds_count") == 0
    assert _value(metrics, "halfmoon:engine_step_seconds_count", phase="decode") == 2


def test_handed_over_and_aborted_requests_are_forgotten(metrics):
    metrics.request_queued("handed", 16)
    metrics.request_queued("aborted", 16)
    metrics.request_dropped("aborted")
    metrics.observe_step(0.0, 0.1, [_out("handed", 1)], num_waiting=0)
    metrics.request_dropped("handed")  # its decode worker counts its tokens
    assert _value(metrics, "halfmoon:request_prompt_tokens_count") == 1
    assert _value(metrics, "halfmoon:request_generation_tokens_count") == 0
    assert metrics.num_tracked == 0


def test_load_gauges_and_preemptions(metrics):
    text = metrics.render(EngineStats(2, 3, 100, 75, 0, 4))
    assert "halfmoon:kv_cache_usage_perc 0.25" in text
    assert "halfmoon:num_requests_waiting 2.0" in text
    assert "halfmoon:num_requests_running 3.0" in text
    assert "halfmoon:kv_cache_used_blocks 25.0" in text
    assert "halfmoon:num_preemptions_total 4.0" in text
    metrics.render(EngineStats(0, 0, 100, 100, 0, 6))
    assert _value(metrics, "halfmoon:num_preemptions_total") == 6
    assert _value(metrics, "halfmoon:kv_cache_usage_perc") == 0.0


def test_the_sleep_state_as_vllms(metrics):
    """vLLM's ``engine_sleep_state`` gauge: awake, or asleep at level 1."""
    text = metrics.render(EngineStats(0, 0, 100, 100, 0, 0))
    assert 'halfmoon:engine_sleep_state{sleep_state="awake"} 1.0' in text
    assert 'halfmoon:engine_sleep_state{sleep_state="weights_offloaded"} 0.0' in text
    text = metrics.render(EngineStats(0, 0, 100, 100, 0, 0, sleeping=True))
    assert 'halfmoon:engine_sleep_state{sleep_state="awake"} 0.0' in text
    assert 'halfmoon:engine_sleep_state{sleep_state="weights_offloaded"} 1.0' in text
    assert 'halfmoon:engine_sleep_state{sleep_state="discard_all"} 0.0' in text


def test_requests_the_engine_dropped_count_by_retryable(metrics):
    metrics.request_failed(True)
    metrics.request_failed(True)
    metrics.request_failed(False)
    text = metrics.render(EngineStats(0, 0, 100, 100, 0, 0))
    assert 'halfmoon:engine_request_failures_total{retryable="true"} 2.0' in text
    assert 'halfmoon:engine_request_failures_total{retryable="false"} 1.0' in text


def test_kv_bytes_and_transfer_time(metrics):
    metrics.observe_kv_sent(1000, 0.02)
    metrics.observe_kv_sent(500, 0.01)
    metrics.observe_kv_received(300)
    assert _value(metrics, "halfmoon:kv_transfer_sent_bytes_total") == 1500
    assert _value(metrics, "halfmoon:kv_transfer_received_bytes_total") == 300
    assert _value(metrics, "halfmoon:kv_transfer_seconds_count") == 2


def test_store_figures_per_tier(metrics):
    store = TieredStore(StoreConfig(BLOCK_BYTES, 4 * BLOCK_BYTES))
    try:
        metrics.add_store(store.stats, BLOCK_BYTES)
        for h in (1, 2, 3):
            store.put(h, bytes([h]) * BLOCK_BYTES, BlockMeta(16, h - 1))
        buf = bytearray(BLOCK_BYTES)
        assert store.get_into(1, buf) is not None
        assert store.get_into(99, buf) is None
        assert _value(metrics, "halfmoon:kv_store_blocks", tier="dram") == 3
        assert _value(metrics, "halfmoon:kv_store_bytes", tier="dram") == 3 * BLOCK_BYTES
        assert _value(metrics, "halfmoon:kv_store_capacity_blocks", tier="dram") == 4
        assert _value(metrics, "halfmoon:kv_store_blocks", tier="ssd") == 0
        assert _value(metrics, "halfmoon:kv_store_hits_total", tier="dram") == 1
        assert _value(metrics, "halfmoon:kv_store_misses_total") == 1
        assert _value(metrics, "halfmoon:kv_store_corrupt_blocks_total") == 0
        assert _value(metrics, "halfmoon:kv_store_evictions_total", tier="dram") == 0
    finally:
        store.close()


def test_a_worker_answers_metrics_query_with_its_engine_servers_metrics_after_its_own():
    """A worker whose engine runs in a server of its own (vLLM) sends that server's
    metrics text after its registry's."""
    vllm_text = (
        '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="m"} 2.0\n'
    )
    engine = SimpleNamespace(
        stats=lambda: EngineStats(2, 1, 10, 5, 0, 0), config=SimpleNamespace(block_size=16),
        has_unfinished_requests=lambda: False, close=lambda: None, metrics_text=vllm_text,
        take_failures=lambda: [],
    )  # fmt: skip
    me = WorkerIdentity("coupled", "c0", "")
    link = ConductorLink(f"tcp://127.0.0.1:{free_port()}", SECRET, me)
    worker = Worker(me, engine, SECRET, link, "tcp://127.0.0.1:*")
    worker.set_role(IdleRole())
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop.is_set,), daemon=True)
    thread.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(worker.endpoint)
    try:
        sock.send_multipart(encode_message(MetricsQuery(msg_id=7), SECRET))
        assert sock.poll(5000)
        reply = decode_message(sock.recv_multipart(), SECRET)
        assert isinstance(reply, MetricsText) and reply.msg_id == 7
        assert (reply.instance_id, reply.role) == ("c0", "coupled")
        samples = {s.name: s.value for f in text_string_to_metric_families(reply.text)
                   for s in f.samples}  # fmt: skip
        assert samples["halfmoon:kv_cache_usage_perc"] == 0.5
        assert samples["halfmoon:num_requests_waiting"] == 2
        assert samples["vllm:num_requests_waiting"] == 2
    finally:
        sock.close(0)
        stop.set()
        thread.join(5)
        worker.close()


def test_decode_guard_counters(metrics):
    counts = {"guard_refused": 2, "guard_waited": 5, "guard_waiting": 1, "guard_wait_expired": 0}
    metrics.add_guard(lambda: dict(counts))
    assert _value(metrics, "halfmoon:decode_guard_refused_total") == 2
    assert _value(metrics, "halfmoon:decode_guard_waited_total") == 5
    assert _value(metrics, "halfmoon:decode_guard_wait_expired_total") == 0
    assert _value(metrics, "halfmoon:decode_guard_waiting") == 1
    counts["guard_refused"] = 3  # read at collection, not copied at registration
    assert _value(metrics, "halfmoon:decode_guard_refused_total") == 3
