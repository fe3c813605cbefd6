"""How many worker losses the gateway rides out for one request: any number while
tokens keep coming between them (up to ``max_attempts`` placements), but only
``max_losses_without_progress`` with no new token in between (a request that crashes
every worker it reaches must not take down the pool)."""

from __future__ import annotations

import asyncio

import pytest

from halfmoon.core.request import SamplingParams
from halfmoon.serve.control.messages import Endpoints, PlacementDecision
from halfmoon.serve.gateway.backend import BackendError, GenerationChunk
from halfmoon.serve.gateway.cluster_client import ClusterBackend, WorkerLost

WORKER = Endpoints(instance_id="w", command="tcp://127.0.0.1:1", transfer="tcp://127.0.0.1:2")
PLACED = PlacementDecision(accepted=True, prefill=WORKER, decode=WORKER)


def backend_with_attempts(script: list[int]) -> tuple[ClusterBackend, list[tuple]]:
    """A backend whose n-th placement yields ``script[n]`` tokens and then loses its
    worker (the last entry's attempt finishes instead). Records each placement's ids and
    every report to the Conductor."""
    backend = ClusterBackend("tcp://127.0.0.1:1", b"secret", 16)
    seen: list[tuple] = []

    async def place(attempt_id, ids, params, cache_salt, admitted):
        seen.append(("place", attempt_id, len(ids), params.max_tokens, admitted))
        return PLACED, None

    async def start(*args):
        return None

    async def in_order(attempt_id, queue, decision, rtt_s):
        n = len([s for s in seen if s[0] == "place"]) - 1
        last = n == len(script) - 1
        for i in range(script[n]):
            finish = "length" if last and i == script[n] - 1 else None
            yield GenerationChunk((100 + i,), finish)
        if not last:
            raise WorkerLost(f"worker lost on attempt {n}", suspect="w")

    async def told(msg):
        seen.append(("told", msg.wire_name))

    async def abort(attempt_id):
        seen.append(("abort", attempt_id))

    backend._place, backend._start, backend._in_order = place, start, in_order
    backend._tell_conductor, backend._abort_attempt = told, abort
    return backend, seen


def generate(backend: ClusterBackend, max_tokens: int = 20) -> list[int]:
    async def run():
        out = []
        async for chunk in backend.generate("r", [1, 2, 3], SamplingParams(max_tokens=max_tokens)):
            out.extend(chunk.token_ids)
        return out

    return asyncio.run(run())


def test_losses_between_tokens_do_not_add_up() -> None:
    backend, seen = backend_with_attempts([2, 1, 1, 1, 1, 3])  # five losses, each after tokens
    tokens = generate(backend)
    assert len(tokens) == 9
    places = [s for s in seen if s[0] == "place"]
    assert [p[1] for p in places] == ["r", "r~1", "r~2", "r~3", "r~4", "r~5"]
    # Each placement carries the prompt plus what was produced, and asks only for the rest.
    assert [(p[2], p[3]) for p in places] == [(3, 20), (5, 18), (6, 17), (7, 16), (8, 15),
                                              (9, 14)]  # fmt: skip
    assert all(p[4] == (p[1] != "r") for p in places)  # placed again: admitted
    assert seen.count(("told", "instance_failed")) == 5


@pytest.mark.parametrize("script", [[2, 0, 0, 5], [0, 0, 0, 5], [1, 0, 1, 0, 0, 5]])
def test_three_losses_with_no_token_in_between_fail_the_request(script) -> None:
    backend, seen = backend_with_attempts(script)
    with pytest.raises(BackendError, match="lost its workers 3 times with no new token in"):
        generate(backend)
    placed = len([s for s in seen if s[0] == "place"])
    assert placed == len(script) - 1  # the last, which would finish, is never placed
    assert seen.count(("told", "release")) == placed  # no booking left behind


def test_two_losses_with_no_token_in_between_are_ridden_out() -> None:
    backend, _ = backend_with_attempts([3, 0, 2, 0, 4])
    assert len(generate(backend)) == 9


def test_placements_are_bounded_even_while_tokens_come() -> None:
    backend, seen = backend_with_attempts([1] * 20)
    with pytest.raises(BackendError, match="lost its workers 8 times"):
        generate(backend)
    assert len([s for s in seen if s[0] == "place"]) == backend.max_attempts == 8


def test_a_worker_seen_dead_by_its_launcher_fails_over_its_requests_at_once() -> None:
    """``instance_exited`` (the launcher saw the process exit): every attempt routed to
    the instance is told it is lost, others are not, and the Conductor is told."""
    backend = ClusterBackend("tcp://127.0.0.1:1", b"secret", 16)
    told = []

    async def tell(msg):
        told.append(msg)

    backend._tell_conductor = tell
    backend._incarnations = {"decode-0": "inc-a", "prefill-0": "inc-b"}

    async def run():
        queues = {a: asyncio.Queue() for a in ("on-it", "elsewhere", "both")}
        backend._queues.update(queues)
        backend._route_ids.update({
            "on-it": (("prefill-0", "inc-b"), ("decode-0", "inc-a")),
            "elsewhere": (("prefill-0", "inc-b"), ("decode-1", "inc-c")),
            "both": (("decode-0", "inc-a"),),
        })  # fmt: skip
        await backend.instance_exited("decode-0")
        return {a: q.qsize() for a, q in queues.items()}, queues["on-it"].get_nowait()

    sizes, lost = asyncio.run(run())
    assert sizes == {"on-it": 1, "elsewhere": 0, "both": 1}
    assert lost.instance_id == "decode-0"
    assert [(m.wire_name, m.instance_id, m.incarnation) for m in told] == [
        ("instance_failed", "decode-0", "inc-a")
    ]
