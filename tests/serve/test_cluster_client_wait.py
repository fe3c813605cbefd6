"""How long the gateway waits for a worker while none is registered (a restart in
progress): a new request ``conductor_wait_s``, then 429; a request placed again after
its worker died (its client already reading) ``failover_wait_s``."""

from __future__ import annotations

import asyncio
import time

import pytest

from halfmoon.conductor.messages import RejectCode
from halfmoon.core.request import SamplingParams
from halfmoon.serve.control.messages import Endpoints, PlacementDecision
from halfmoon.serve.gateway.backend import Rejected
from halfmoon.serve.gateway.cluster_client import ClusterBackend

NO_WORKER = PlacementDecision(
    accepted=False, reject_reason="no prefill or decode instance available",
    reject_code=RejectCode.NO_INSTANCE,
)  # fmt: skip
WORKER = Endpoints(instance_id="w", command="tcp://127.0.0.1:1", transfer="tcp://127.0.0.1:2")
PLACED = PlacementDecision(accepted=True, prefill=WORKER, decode=WORKER)


def backend_whose_workers_return_after(seconds: float) -> tuple[ClusterBackend, list[float]]:
    backend = ClusterBackend("tcp://127.0.0.1:1", b"secret", 16)
    backend.conductor_wait_s, backend.failover_wait_s = 0.6, 5.0
    started = time.monotonic()
    asked: list[float] = []

    async def call(endpoint, msg, timeout_s):
        asked.append(time.monotonic() - started)
        assert msg.admitted == (msg.request_id == "again")
        return PLACED if time.monotonic() - started >= seconds else NO_WORKER

    backend._call = call  # the Conductor's answers, without a socket
    return backend, asked


def place(backend: ClusterBackend, request_id: str, admitted: bool):
    params = SamplingParams(max_tokens=4)
    return asyncio.run(backend._place(request_id, [1, 2, 3], params, admitted=admitted))


def test_a_new_request_is_refused_once_the_wait_runs_out() -> None:
    backend, asked = backend_whose_workers_return_after(2.0)
    with pytest.raises(Rejected, match="no prefill or decode instance"):
        place(backend, "new", admitted=False)
    assert 0.6 <= asked[-1] < 2.0


def test_a_failed_over_request_waits_longer_for_a_restarted_worker() -> None:
    backend, asked = backend_whose_workers_return_after(2.0)
    decision, _ = place(backend, "again", admitted=True)
    assert decision.accepted and decision.prefill == WORKER
    assert asked[-1] >= 2.0 and len(asked) >= 4  # asked every 0.5 s meanwhile


def test_a_request_that_computes_its_whole_prompt_is_placed_without_its_hashes() -> None:
    """Prompt log-probabilities: the Conductor must not count (or pull) a cached prefix
    the workers will not use, so the request goes without its block hashes."""
    backend = ClusterBackend("tcp://127.0.0.1:1", b"secret", 2)
    sent = []

    async def call(endpoint, msg, timeout_s):
        sent.append(msg)
        return PLACED

    backend._call = call
    for params in (SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, prompt_logprobs=0)):
        asyncio.run(backend._place("r", [1, 2, 3, 4, 5], params))
    plain, full = sent
    assert len(plain.block_hashes) == 3 and full.block_hashes == []
    assert full.input_length == plain.input_length == 5
