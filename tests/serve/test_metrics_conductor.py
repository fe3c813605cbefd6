"""The Conductor's registry (halfmoon.serve.control.conductor_metrics), and the service
answering ``metrics_query`` with decisions it really made."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import pytest
import zmq

from halfmoon.conductor import Conductor, ConductorConfig
from halfmoon.conductor.messages import RejectCode
from halfmoon.core.clock import ManualClock, WallClock
from halfmoon.core.hashing import hash_blocks
from halfmoon.serve.control.conductor_main import load_cost_model
from halfmoon.serve.control.conductor_metrics import (
    ConductorMetrics,
    InstanceFigures,
    balancing_families,
)
from halfmoon.serve.control.conductor_service import ConductorService
from halfmoon.serve.control.messages import (
    FirstTokenSeen,
    MetricsQuery,
    MetricsText,
    Schedule,
    decode_message,
    encode_message,
)
from halfmoon.serve.control.protocol import hashes_to_wire
from halfmoon.serve.control.status import conductor_state

SECRET = b"conductor-metrics-secret"


class _Decision:
    def __init__(self, accepted: bool, reject_code: str = "") -> None:
        self.accepted = accepted
        self.reject_code = reject_code


@contextlib.contextmanager
def _connected(core: Conductor) -> Iterator[tuple[ConductorService, zmq.Socket]]:
    """A Conductor service on a free port around ``core`` and a socket to it, both
    closed on exit."""
    service = ConductorService(core, SECRET, "tcp://127.0.0.1:*")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(service.endpoint)
    try:
        yield service, sock
    finally:
        sock.close(0)
        service.close()


def test_decisions_by_outcome_and_reason_and_instances():
    figures = InstanceFigures(
        roles={"p0": "prefill", "p1": "prefill", "d0": "decode"},
        draining=frozenset({"p1"}),
        index_blocks={"p0": 12, "p1": 0},
        prefill_scale={"p0": 2.5},
    )
    m = ConductorMetrics(lambda: figures)
    m.observe_decision(_Decision(True), 0.001)
    m.observe_decision(_Decision(True), 0.002)
    m.observe_decision(_Decision(False, RejectCode.TTFT), 0.0005)
    get = m.registry.get_sample_value
    assert get("halfmoon:conductor_decisions_total", {"outcome": "accepted", "reason": ""}) == 2
    assert get("halfmoon:conductor_decisions_total", {"outcome": "rejected", "reason": "ttft"}) == 1
    # Every reject code has its series from the start.
    assert get("halfmoon:conductor_decisions_total",
               {"outcome": "rejected", "reason": RejectCode.KV_FULL}) == 0  # fmt: skip
    assert get("halfmoon:conductor_decision_time_seconds_count") == 3
    instances = "halfmoon:conductor_instances"
    assert get(instances, {"instance_role": "prefill", "state": "placeable"}) == 1
    assert get(instances, {"instance_role": "prefill", "state": "draining"}) == 1
    assert get(instances, {"instance_role": "decode", "state": "placeable"}) == 1
    assert get(instances, {"instance_role": "coupled", "state": "placeable"}) == 0
    assert get("halfmoon:conductor_index_blocks", {"instance_id": "p0"}) == 12
    assert get("halfmoon:conductor_prefill_scale", {"instance_id": "p0"}) == 2.5
    assert get("halfmoon:conductor_prefill_scale", {"instance_id": "p1"}) is None


def test_the_link_backlog_is_a_gauge():
    state = {"mode": "adaptive", "threshold": 0.1, "fetching": True, "max_link_backlog_s": 1.5}
    families = {f.name: f for f in balancing_families(state)}
    (sample,) = families["halfmoon:conductor_balancing_link_backlog_seconds"].samples
    assert sample.value == 1.5 and sample.labels == {"mode": "adaptive"}


def test_the_service_counts_its_decisions_and_answers_metrics_query():
    config = ConductorConfig(block_size_tokens=16)
    core = Conductor(config, load_cost_model(None, 16384), WallClock(), random.Random(0))
    with _connected(core) as (service, sock):
        tokens = list(range(32))
        schedule = Schedule(
            request_id="r0", input_length=32, output_length=4, block_size=16,
            hashes=hashes_to_wire(hash_blocks(tokens, 16).hashes), msg_id=1,
        )  # fmt: skip
        for msg in (schedule, MetricsQuery(msg_id=2)):
            sock.send_multipart(encode_message(msg, SECRET))
            service.handle_one()
        decision = decode_message(sock.recv_multipart(), SECRET)
        assert not decision.accepted and decision.reject_code == RejectCode.NO_INSTANCE, decision
        reply = decode_message(sock.recv_multipart(), SECRET)
        assert isinstance(reply, MetricsText) and reply.msg_id == 2
        assert reply.role == "conductor" and reply.instance_id == "conductor"
        assert ('halfmoon:conductor_decisions_total{outcome="rejected",reason="no_instance"} 1.0'
                in reply.text)  # fmt: skip
        assert "halfmoon:conductor_decision_time_seconds_count 1.0" in reply.text
        # The cache-balancing state (the default: fixed at 0.1, fetching on).
        assert 'halfmoon:conductor_balancing_threshold{mode="fixed"} 0.1' in reply.text
        assert 'halfmoon:conductor_balancing_fetching{mode="fixed"} 1.0' in reply.text
        assert 'halfmoon:conductor_balancing_link_backlog_seconds{mode="fixed"} 0.0' in reply.text


def test_the_gateways_first_token_notices_teach_the_conductor_its_lateness():
    """A placed request's ``first_token`` message (no reply) is a lateness sample; one for
    a request the Conductor never placed is ignored; the gauge carries what it learned."""
    config = ConductorConfig(block_size_tokens=16, prefill_calibration=True)
    clock = ManualClock()
    core = Conductor(config, load_cost_model(None, 16384), clock, random.Random(0))
    core.add_prefill_instance("p0")
    core.add_decode_instance("d0")
    with _connected(core) as (service, sock):
        for n in range(3):
            tokens = list(range(100 * n, 100 * n + 32))
            schedule = Schedule(
                request_id=f"r{n}", input_length=32, output_length=4, block_size=16,
                hashes=hashes_to_wire(hash_blocks(tokens, 16).hashes), msg_id=n + 1,
            )  # fmt: skip
            sock.send_multipart(encode_message(schedule, SECRET))
            service.handle_one()
            decision = decode_message(sock.recv_multipart(), SECRET)
            assert decision.accepted, decision
            clock.advance(decision.est_ttft_s + 0.25)  # every first token 0.25 s late
            sock.send_multipart(encode_message(FirstTokenSeen(request_id=f"r{n}"), SECRET))
            service.handle_one()
        sock.send_multipart(encode_message(FirstTokenSeen(request_id="unknown"), SECRET))
        service.handle_one()
        assert not sock.poll(100)  # no reply to a notice
        assert core.lateness_samples == 3
        assert core.ttft_lateness_s == pytest.approx(0.25)
        spread = conductor_state(service, [])["ttft_lateness_spread"]
        assert spread == {"mean_s": pytest.approx(0.25), "std_s": pytest.approx(0, abs=1e-6),
                          "stddevs": 0.0}  # fmt: skip
        sock.send_multipart(encode_message(MetricsQuery(msg_id=9), SECRET))
        service.handle_one()
        reply = decode_message(sock.recv_multipart(), SECRET)
        assert "halfmoon:conductor_ttft_lateness_seconds 0.25" in reply.text


def test_a_requests_priority_reaches_the_conductors_books():
    """The gateway's ``priority`` (vLLM's, under --scheduling-policy priority) is booked
    with the placement, so later estimates leave it out or count it."""
    core = Conductor(ConductorConfig(block_size_tokens=16), load_cost_model(None, 16384),
                     ManualClock(), random.Random(0))  # fmt: skip
    core.add_prefill_instance("p0")
    core.add_decode_instance("d0")
    with _connected(core) as (service, sock):
        for n, priority in enumerate((0, 3, -1)):
            tokens = list(range(100 * n, 100 * n + 32))
            schedule = Schedule(
                request_id=f"r{n}", input_length=32, output_length=4, block_size=16,
                hashes=hashes_to_wire(hash_blocks(tokens, 16).hashes), priority=priority,
                msg_id=n + 1,
            )  # fmt: skip
            sock.send_multipart(encode_message(schedule, SECRET))
            service.handle_one()
            assert decode_message(sock.recv_multipart(), SECRET).accepted
        state = core._prefill["p0"]
        assert state.priority_of == {"r1": 3, "r2": -1}
        assert state.queue_s(0.0, -1) < state.queue_s(0.0, 0) < state.queue_s(0.0)
        # The operator's view (the status): what was placed per priority since the first
        # request of a priority other than 0, and the share more urgent work took.
        shown = conductor_state(service, [])["priorities"]
        assert shown["estimates"] is True and list(shown["placed_prefill_s"]) == ["-1", "3"]
        assert shown["urgent_share"]["-1"] == 0.0 < shown["urgent_share"]["3"]
