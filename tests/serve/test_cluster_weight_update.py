"""The cluster's all-or-none weight update (ClusterOperations.update_weights) against
scripted answers: every worker stages before any commits; one that cannot stage has
every other drop theirs; a worker that registered or restarted during the update is given
the new weights too; the Conductor records them once any worker serves them; a draining
worker is left out."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from halfmoon.serve.control.messages import (
    ConductorPong,
    Error,
    Message,
    Ping,
    UpdateWeights,
    WeightsOk,
)
from halfmoon.serve.gateway.backend import BackendError
from halfmoon.serve.gateway.cluster_ops import ClusterOperations, serving


class Scripted(ClusterOperations):
    """Answers as a cluster would: ``pongs`` in turn (the last one repeated), each
    worker's ``update_weights`` with ``weights_ok`` unless ``refuse`` names it for that
    op; every message is kept in ``sent`` as (endpoint, op)."""

    def __init__(self, pongs: list[ConductorPong], refuse: dict[str, str] | None = None,
                 busy: dict[str, int] | None = None):  # fmt: skip
        self._conductor_endpoint = "conductor"
        self.pongs = pongs
        self.refuse = refuse or {}
        #: Commits a worker answers "requests are running" (retryable) before it takes one.
        self.busy = dict(busy or {})
        self.sent: list[tuple[str, str]] = []

    async def _call(self, endpoint: str, msg: Message, timeout_s: float) -> Message:
        if isinstance(msg, Ping):
            return self.pongs.pop(0) if len(self.pongs) > 1 else self.pongs[0]
        assert isinstance(msg, UpdateWeights)
        self.sent.append((endpoint, msg.op))
        if self.refuse.get(endpoint) == msg.op:
            return Error(error=f"{endpoint} cannot {msg.op}")
        if msg.op == "commit" and self.busy.get(endpoint, 0) > 0:
            self.busy[endpoint] -= 1
            return Error(error=f"{endpoint}: requests are running here", retryable=True)
        return WeightsOk(weights=msg.weights)


def pong(**incarnations: str) -> ConductorPong:
    return ConductorPong(endpoints={i: f"tcp://{i}" for i in incarnations},
                         incarnations=dict(incarnations))  # fmt: skip


def test_all_stage_before_any_commits_and_the_conductor_records_them():
    ops = Scripted([pong(p0="a", d0="b")])
    asyncio.run(ops.update_weights("/ckpt/1", "1"))
    stages = [e for e, op in ops.sent[:2] if op == "stage"]
    assert sorted(stages) == ["tcp://d0", "tcp://p0"]
    assert sorted(ops.sent[2:4]) == [("tcp://d0", "commit"), ("tcp://p0", "commit")]
    assert ops.sent[4:] == [("conductor", "record")]


def test_one_that_cannot_stage_leaves_every_worker_as_it_was():
    ops = Scripted([pong(p0="a", d0="b")], refuse={"tcp://d0": "stage"})
    with pytest.raises(BackendError, match="tcp://d0 cannot stage"):
        asyncio.run(ops.update_weights("/ckpt/1", "1"))
    assert not [s for s in ops.sent if s[1] in ("commit", "record")]
    assert sorted(e for e, op in ops.sent if op == "drop") == ["tcp://d0", "tcp://p0"]


def test_a_worker_that_restarted_meanwhile_is_given_them_too():
    # d0 restarts (a new incarnation) and d1 joins while the update runs
    ops = Scripted([pong(p0="a", d0="b"), pong(p0="a", d0="b2", d1="c")])
    asyncio.run(ops.update_weights("/ckpt/1", "1"))
    late = ops.sent[ops.sent.index(("conductor", "record")) + 1 :]
    assert sorted(late) == [("tcp://d0", "commit"), ("tcp://d0", "stage"),
                            ("tcp://d1", "commit"), ("tcp://d1", "stage")]  # fmt: skip
    assert ("tcp://p0", "stage") not in late


def test_a_worker_still_ending_requests_is_asked_to_commit_again():
    # p0's aborted requests are still finishing their KV streams at the first two asks
    ops = Scripted([pong(p0="a", d0="b")], busy={"tcp://p0": 2})
    asyncio.run(ops.update_weights("/ckpt/1", "1"))
    assert ops.sent.count(("tcp://p0", "commit")) == 3
    assert ops.sent.count(("tcp://d0", "commit")) == 1
    assert ("conductor", "record") in ops.sent and not [s for s in ops.sent if s[1] == "drop"]


def test_a_worker_busy_past_the_settle_time_fails_the_update(monkeypatch):
    from halfmoon.serve.gateway import cluster_ops

    monkeypatch.setattr(cluster_ops, "COMMIT_SETTLE_S", 0.3)
    ops = Scripted([pong(p0="a", d0="b")], busy={"tcp://p0": 10**6})
    with pytest.raises(BackendError, match="requests are running here"):
        asyncio.run(ops.update_weights("/ckpt/1", "1"))
    assert 2 <= ops.sent.count(("tcp://p0", "commit")) <= 6


def test_a_draining_worker_is_left_out():
    """It takes no new request and exits once idle (it may be gone, not yet noticed):
    neither weights nor adapters (cluster_ops.serving) are sent to it."""
    draining = dataclasses.replace(pong(p0="a", d0="b", d1="c"), draining=["d1"])
    assert serving(draining) == {"p0": "tcp://p0", "d0": "tcp://d0"}
    ops = Scripted([draining])
    asyncio.run(ops.update_weights("/ckpt/1", "1"))
    assert not [s for s in ops.sent if s[0] == "tcp://d1"]
    assert ("tcp://d0", "commit") in ops.sent
