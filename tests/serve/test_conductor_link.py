"""The worker's link to the Conductor takes events from any thread (a store's events come
on the transfer threads that serve peers' pulls, the lifecycle events on the loop thread,
which also sends the batches): each event reaches the Conductor exactly once."""

from __future__ import annotations

import threading

import zmq

from halfmoon.serve.control.messages import Events, decode_message
from halfmoon.serve.worker.conductor_link import ConductorLink, WorkerIdentity

SECRET = b"conductor-link-test-secret-01234"


def test_events_queued_by_many_threads_while_the_loop_sends_arrive_once_each():
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVHWM, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    link = ConductorLink(f"tcp://127.0.0.1:{port}", SECRET, WorkerIdentity("prefill", "p0", ""))
    num_threads, per_thread = 4, 3000

    def queue(t: int) -> None:
        for i in range(per_thread):
            link.event("prefill_started", request_id=f"{t}-{i}")

    threads = [threading.Thread(target=queue, args=(t,)) for t in range(num_threads)]
    try:
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            link.flush()  # the loop thread's batches, taken while events keep coming
        for t in threads:
            t.join()
        link.flush()
        received: list[str] = []
        while len(received) < num_threads * per_thread and router.poll(5000):
            msg = decode_message(router.recv_multipart()[1:], SECRET)
            assert isinstance(msg, Events)
            received += [e.request_id for e in msg.events]
        want = [f"{t}-{i}" for t in range(num_threads) for i in range(per_thread)]
        assert len(received) == len(want) and sorted(received) == sorted(want)
    finally:
        link.close()
        router.close(0)
