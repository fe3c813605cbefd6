"""The gateway's one ``/metrics``: every process's text labelled and merged
(halfmoon.serve.gateway.scrape), and a process that does not answer skipped and counted."""

from __future__ import annotations

import asyncio
import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from halfmoon.serve.control.messages import MetricsText
from halfmoon.serve.gateway.backend import BackendError
from halfmoon.serve.gateway.cluster_client import ClusterBackend
from halfmoon.serve.gateway.prom import GatewayMetrics
from halfmoon.serve.gateway.scrape import ProcessText, merge, scrape
from halfmoon.serve.runtime import free_port
from halfmoon.serve.worker.conductor_link import ConductorLink, WorkerIdentity
from tests.serve.fakes import conductor_thread

SECRET = b"metrics-merge-secret"


def _text(step_s: list[float], sent_bytes: float) -> str:
    """A worker-like registry's text: a step-time histogram and a byte counter."""
    r = CollectorRegistry()
    steps = Histogram("halfmoon:engine_step_seconds", "Steps.", ["phase"], buckets=(0.1, 1.0),
                      registry=r)  # fmt: skip
    for s in step_s:
        steps.labels("decode").observe(s)
    Counter("halfmoon:kv_transfer_sent_bytes", "Sent.", registry=r).inc(sent_bytes)
    return generate_latest(r).decode()


def _samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_merge_labels_every_sample_and_keeps_histograms_intact():
    gateway = GatewayMetrics()
    gateway.scrape_errors.labels("decode-1").inc()
    text = merge([
        ProcessText("gateway", "gateway", gateway.render().decode()),
        ProcessText("prefill", "prefill-0", _text([0.05, 0.5], 1000)),
        ProcessText("decode", "decode-0", _text([0.05, 0.05, 5.0], 0)),
    ], "tiny").decode()  # fmt: skip
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names))  # one family per name, across processes
    assert text.count("# TYPE halfmoon:engine_step_seconds histogram") == 1
    for family in families:
        for s in family.samples:
            assert s.labels["model_name"] == "tiny", s
            assert s.labels["role"] in ("gateway", "prefill", "decode"), s
    samples = _samples(text)

    def value(name: str, role: str, worker: str, **labels: str) -> float:
        key = {"model_name": "tiny", "role": role, "worker": worker, **labels}
        return samples[(name, frozenset(key.items()))]

    bucket = "halfmoon:engine_step_seconds_bucket"
    assert value(bucket, "prefill", "prefill-0", phase="decode", le="0.1") == 1
    assert value(bucket, "prefill", "prefill-0", phase="decode", le="+Inf") == 2
    assert value(bucket, "decode", "decode-0", phase="decode", le="0.1") == 2
    assert value(bucket, "decode", "decode-0", phase="decode", le="1.0") == 2
    assert value("halfmoon:engine_step_seconds_count", "decode", "decode-0", phase="decode") == 3
    assert value("halfmoon:engine_step_seconds_sum", "decode", "decode-0",
                 phase="decode") == pytest.approx(5.1)  # fmt: skip
    assert value("halfmoon:kv_transfer_sent_bytes_total", "prefill", "prefill-0") == 1000
    # The scrape-error counter keeps its own worker label: the process that was skipped.
    assert value("halfmoon:scrape_errors_total", "gateway", "decode-1") == 1
    assert "_created" not in text


def test_merge_skips_a_text_that_does_not_parse_and_a_type_clash():
    clash = "# TYPE halfmoon:kv_transfer_sent_bytes gauge\nhalfmoon:kv_transfer_sent_bytes 3\n"
    text = merge([
        ProcessText("prefill", "p0", _text([0.5], 7)),
        ProcessText("decode", "d0", "this is { not metrics"),
        ProcessText("decode", "d1", clash),
    ], "m").decode()  # fmt: skip
    assert 'worker="p0"' in text
    assert 'worker="d0"' not in text and 'worker="d1"' not in text


class _Backend:
    """A backend offering ``metrics_texts`` with canned answers."""

    def __init__(self, answer):
        self.answer = answer

    async def metrics_texts(self, timeout_s: float):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def test_scrape_counts_the_processes_that_did_not_answer():
    metrics = GatewayMetrics()
    texts = [MetricsText(instance_id="prefill-0", role="prefill", text=_text([0.2], 5))]
    backend = _Backend((texts, ["decode-0"]))
    text = asyncio.run(scrape(backend, metrics, "tiny")).decode()
    assert (
        'halfmoon:kv_transfer_sent_bytes_total{model_name="tiny",role="prefill",'
        'worker="prefill-0"} 5.0' in text
    )
    assert (
        'halfmoon:scrape_errors_total{model_name="tiny",role="gateway",'
        'worker="decode-0"} 1.0' in text
    )
    # A Conductor that does not answer at all: counted as such, the gateway's own served.
    text = asyncio.run(scrape(_Backend(BackendError("away")), metrics, "tiny")).decode()
    assert 'worker="conductor"} 1.0' in text
    assert 'role="prefill"' not in text


def test_a_backend_without_metrics_texts_serves_the_gateways_own():
    text = asyncio.run(scrape(object(), GatewayMetrics(), "echo")).decode()
    assert (
        'halfmoon:time_to_first_token_seconds_count{model_name="echo",role="gateway",'
        'worker="gateway"} 0.0' in text
    )
    assert "halfmoon:scrape_errors_total{" not in text


@pytest.fixture
def conductor():
    """A Conductor service answering on its own thread."""
    with conductor_thread(SECRET) as service:
        yield service


def test_a_dead_worker_is_skipped_within_the_timeout(conductor, gateways):
    """A registered worker whose command socket nobody serves: the Conductor's metrics
    come, the worker is counted in scrape_errors, the scrape does not wait on it."""
    me = WorkerIdentity("decode", "decode-9", f"tcp://127.0.0.1:{free_port()}")
    link = ConductorLink(conductor.endpoint, SECRET, me)
    link.register(kv_capacity_tokens=128, timeout_s=10)
    backend = ClusterBackend(conductor.endpoint, SECRET, 16)
    try:
        with TestClient(gateways.app(backend, model="tiny")) as client:
            start = time.monotonic()
            text = client.get("/metrics").text
            # (each process is awaited 0.3 s at most; the bound only tells skipping from
            # waiting on the dead worker: a loaded CI host once took 1.003 s)
            assert time.monotonic() - start < 3.0
            assert (
                'halfmoon:scrape_errors_total{model_name="tiny",role="gateway",'
                'worker="decode-9"} 1.0' in text
            )
            assert (
                'halfmoon:conductor_instances{instance_role="decode",model_name="tiny",'
                'role="conductor",state="placeable",worker="conductor"} 1.0'
            ) in text
            client.portal.call(backend.close)
    finally:
        link.close()
