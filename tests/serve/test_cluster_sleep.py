"""The cluster's all-or-none sleep (ClusterOperations.sleep_workers / wake_workers)
against scripted workers: every worker (but a draining one) sleeps, one still ending its
requests is asked again, and when one cannot, those that slept wake up again."""

from __future__ import annotations

import asyncio

import pytest

from halfmoon.serve.control.messages import ConductorPong, Error, Message, Ping, Sleep, SleepState
from halfmoon.serve.gateway.backend import BackendError, BackendRefused
from halfmoon.serve.gateway.cluster_ops import ClusterOperations


class Scripted(ClusterOperations):
    """Workers p0, d0 (and draining d1) that sleep and wake; ``refuse`` maps an endpoint
    to its refusal (an Error); ``busy`` counts the sleeps it answers retryably first."""

    def __init__(self, refuse: dict[str, Error] | None = None,
                 busy: dict[str, int] | None = None) -> None:  # fmt: skip
        self._conductor_endpoint = "conductor"
        self.refuse = refuse or {}
        self.busy = dict(busy or {})
        self.sent: list[tuple[str, str]] = []
        self.asleep: set[str] = set()

    async def _call(self, endpoint: str, msg: Message, timeout_s: float) -> Message:
        if isinstance(msg, Ping):
            return ConductorPong(endpoints={i: f"tcp://{i}" for i in ("p0", "d0", "d1")},
                                 draining=["d1"])  # fmt: skip
        assert isinstance(msg, Sleep)
        self.sent.append((endpoint, msg.op))
        if msg.op == "sleep" and endpoint in self.refuse:
            return self.refuse[endpoint]
        if msg.op == "sleep" and self.busy.get(endpoint, 0) > 0:
            self.busy[endpoint] -= 1
            return Error(error=f"{endpoint}: requests are running here", retryable=True)
        (self.asleep.add if msg.op == "sleep" else self.asleep.discard)(endpoint)
        return SleepState(sleeping=msg.op == "sleep", released_bytes=100)


def test_every_serving_worker_sleeps_once_its_requests_have_ended():
    ops = Scripted(busy={"tcp://d0": 2})
    assert asyncio.run(ops.sleep_workers()) == 200  # p0's and d0's
    assert ops.asleep == {"tcp://p0", "tcp://d0"}
    assert ops.sent.count(("tcp://d0", "sleep")) == 3 and ("tcp://d1", "sleep") not in ops.sent
    asyncio.run(ops.wake_workers())
    assert not ops.asleep


@pytest.mark.parametrize(
    ("refusal", "kind"),
    [(Error(error="d0: no sleep mode here", unsupported=True), BackendRefused),
     (Error(error="d0: the engine's prefix cache could not be reset"), BackendError)],
)  # fmt: skip
def test_one_that_cannot_sleep_wakes_the_others(refusal, kind):
    ops = Scripted(refuse={"tcp://d0": refusal})
    with pytest.raises(kind, match=refusal.error) as raised:
        asyncio.run(ops.sleep_workers())
    assert isinstance(raised.value, BackendRefused) == (kind is BackendRefused)
    assert not ops.asleep and ("tcp://p0", "wake") in ops.sent
