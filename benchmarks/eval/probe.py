"""Conductor decision latency inside a live cluster, measured from outside.

The Conductor service does not time its decisions, so a probe thread talks to it over
its own signed control channel while the benchmark loads the cluster, every
``interval_s``:

1. ``ping``: the round trip of a message the service answers without scheduling
   (transport, signing, dispatch) -- the baseline;
2. ``schedule`` of a probe request whose block hashes are those of a real prompt of the
   running workload (so the prefix match walks real index entries), exactly as the gateway
   sends it -- the round trip of a placement;
3. ``request_finished`` for the probe, so the Conductor forgets it at once (the probe is
   booked for about a millisecond, a negligible load on the estimates of real requests).

decision ~= schedule round trip - ping round trip (paired; which of the two goes first
alternates). Both include the wait behind whatever the single-threaded service is
handling (worker events, real placements) and, on a busy machine, the wait for a CPU:
that is part of the decision latency a request sees.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import zmq

from halfmoon.core.hashing import hash_blocks
from halfmoon.serve.control.protocol import decode, encode, hashes_to_wire


@dataclass
class ProbeSamples:
    """Round trips (seconds) per label, in the order taken."""

    ping_s: dict[str, list[float]] = field(default_factory=dict)
    schedule_s: dict[str, list[float]] = field(default_factory=dict)


class ConductorProbe:
    """Probe a Conductor while ``label`` names what is running (None: pause)."""

    def __init__(self, endpoint: str, secret: bytes, coupled: bool, interval_s: float = 0.1):
        self.endpoint, self.secret, self.coupled, self.interval_s = (
            endpoint, secret, coupled, interval_s,
        )  # fmt: skip
        self.samples = ProbeSamples()
        self.label: str | None = None
        self.prompts: Sequence[Sequence[int]] = ()
        self._stop = threading.Event()
        self._ids = itertools.count()
        self._num_sent = 0
        self._thread = threading.Thread(target=self._run, name="conductor-probe", daemon=True)

    def __enter__(self) -> ConductorProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _call(self, sock: zmq.Socket, message: dict) -> tuple[dict, float]:
        start = time.perf_counter()
        sock.send_multipart(encode(message, self.secret))
        if not sock.poll(5000):
            raise TimeoutError(f"conductor at {self.endpoint} did not answer")
        reply = decode(sock.recv_multipart(), self.secret)
        return reply, time.perf_counter() - start

    def _run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        try:
            while not self._stop.wait(self.interval_s):
                label, prompts = self.label, self.prompts
                if label is None or not prompts:
                    continue
                self._probe(sock, label, prompts[self._num_sent % len(prompts)])
                self._num_sent += 1
        finally:
            sock.close(0)

    def _probe(self, sock: zmq.Socket, label: str, prompt: Sequence[int]) -> None:
        number = next(self._ids)
        rid = f"probe-{number}"
        # Alternate which goes first: the first message after a sleep pays for waking up.
        ping_first = number % 2 == 0
        if ping_first:
            _, ping_s = self._call(sock, {"type": "ping"})
        hashes = hash_blocks(prompt, 16).hashes
        decision, schedule_s = self._call(sock, {
            "type": "schedule", "request_id": rid, "input_length": len(prompt),
            "output_length": 32, "block_size": 16, "hashes": hashes_to_wire(hashes),
            "coupled": self.coupled,
        })  # fmt: skip
        if not ping_first:
            _, ping_s = self._call(sock, {"type": "ping"})
        if decision.get("accepted"):
            instance = decision["prefill"]["instance_id"]
            sock.send_multipart(encode({
                "type": "events", "instance_id": instance,
                "events": [{"kind": "request_finished", "request_id": rid}],
            }, self.secret))  # fmt: skip
        self.samples.ping_s.setdefault(label, []).append(ping_s)
        self.samples.schedule_s.setdefault(label, []).append(schedule_s)


def set_workload(probe: ConductorProbe, label: str | None, prompts: Sequence[Sequence[int]]):
    """Point the probe at the running workload (``label`` None pauses it)."""
    probe.prompts = prompts
    probe.label = label


def prompt_sample(make: Callable[[int], Sequence[int]], num: int) -> list[Sequence[int]]:
    """The first ``num`` prompts of a workload, for probe requests."""
    return [make(i) for i in range(num)]
