import os
import socket
import time

import pytest

from halfmoon.transfer import busypoll
from halfmoon.transfer.busypoll import BusyPoller, crowded


@pytest.fixture(autouse=True)
def cpus_to_spare(monkeypatch):
    """These tests are about polling; on a loaded host (a parallel test run) polls would
    stand down for the threads waiting for a CPU. The crowded case has its own tests."""
    monkeypatch.setattr(busypoll, "crowded", lambda cpus: False)


@pytest.fixture
def sock_pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_poll_takes_waiting_bytes_and_reports_none_after_its_budget(sock_pair):
    a, b = sock_pair
    poller = BusyPoller(b, 200e-6)
    view = memoryview(bytearray(64))
    a.sendall(b"hello")
    assert poller.poll_into(view) == 5 and bytes(view[:5]) == b"hello"
    assert poller.poll_into(view) == 0  # nothing came within 200 us


def paused_poller(sock) -> tuple[BusyPoller, memoryview]:
    """A 100 us poller on ``sock`` after three fruitless polls (so it pauses itself)."""
    poller = BusyPoller(sock, 100e-6)
    view = memoryview(bytearray(64))
    for _ in range(3):
        assert poller.poll_into(view) == 0
    return poller, view


def test_fruitless_polls_pause_polling_for_a_while(sock_pair, monkeypatch):
    # A long first pause: the 0.5 ms one could end while a loaded host runs other threads.
    monkeypatch.setattr(busypoll, "_FIRST_PAUSE_S", 10.0)
    a, b = sock_pair
    poller, view = paused_poller(b)
    a.sendall(b"late")
    assert poller.poll_into(view) == 0  # paused: the caller sleeps in recv instead
    assert b.recv(64) == b"late"


def test_the_pause_is_a_time_not_a_number_of_frames(sock_pair, monkeypatch):
    """However few frames pass while paused, polling resumes once the pause is over
    (counted in frames, a burst's misses kept the next phase's round trips from polling)."""
    monkeypatch.setattr(busypoll, "_FIRST_PAUSE_S", 0.05)
    a, b = sock_pair
    poller, view = paused_poller(b)
    a.sendall(b"x")
    assert poller.poll_into(view) == 0  # within the pause: nothing is polled
    time.sleep(0.1)
    assert poller.poll_into(view) == 1 and bytes(view[:1]) == b"x"  # the pause is over


def test_pauses_grow_while_polls_keep_missing_and_a_hit_starts_over(sock_pair):
    """A busy peer that was slow a few times costs a short pause; an idle one is polled
    less and less often (pauses of 0.5, 1, 2, 4, then 5 ms between fruitless polls)."""
    a, b = sock_pair
    poller, view = paused_poller(b)
    lengths = [poller._pause_s]  # noqa: SLF001  (the next pause, after the first 0.5 ms)
    for _ in range(4):
        time.sleep(max(0.0, poller._paused_until - time.perf_counter()))  # noqa: SLF001
        assert poller.poll_into(view) == 0  # one more miss after a pause: a longer pause
        assert poller._paused_until > time.perf_counter() - 1e-3  # noqa: SLF001
        lengths.append(poller._pause_s)  # noqa: SLF001
    assert lengths == [1e-3, 2e-3, 4e-3, 5e-3, 5e-3]
    time.sleep(max(0.0, poller._paused_until - time.perf_counter()))  # noqa: SLF001
    assert hit_while_polling(poller, view, a) == 1  # the next run of misses starts short
    for _ in range(3):
        assert poller.poll_into(view) == 0
    assert poller._pause_s == 1e-3  # noqa: SLF001  (it paused 0.5 ms and doubled once)


class _SendsOnFirstMiss:
    """A poller's socket whose first fruitless read has ``sender`` send a byte: the byte
    comes while the poll polls, however the threads are scheduled (a byte sent from a
    thread 2 ms after the poll began was already waiting when a loaded CI host ran the
    poll late, and the test failed)."""

    def __init__(self, sock: socket.socket, sender: socket.socket) -> None:
        self._sock, self._sender, self._sent = sock, sender, False

    def recv_into(self, view: memoryview, nbytes: int, flags: int) -> int:
        try:
            return self._sock.recv_into(view, nbytes, flags)
        except BlockingIOError:
            if not self._sent:
                self._sent = True
                self._sender.sendall(b"y")
            raise


def hit_while_polling(poller: BusyPoller, view: memoryview, sender: socket.socket) -> int:
    """One poll that finds a byte sent while it polls."""
    budget, poller.poll_s = poller.poll_s, 5.0
    sock = poller._sock  # noqa: SLF001
    poller._sock = _SendsOnFirstMiss(sock, sender)  # type: ignore[assignment]  # noqa: SLF001
    try:
        return poller.poll_into(view)
    finally:
        poller._sock, poller.poll_s = sock, budget  # noqa: SLF001


def test_bytes_already_waiting_say_nothing_about_polling(sock_pair):
    """A poll whose first try finds its bytes did not need to poll (typically: the caller
    slept for them, or the peer ran while this thread was off the CPU): it neither ends a
    run of misses nor adds to it. Counted as hits, such reads kept two threads that had
    landed on one core polling each other out of the CPU on every frame."""
    a, b = sock_pair
    poller = BusyPoller(b, 100e-6)
    view = memoryview(bytearray(64))
    for _ in range(2):
        assert poller.poll_into(view) == 0  # a miss
        a.sendall(b"z")
        assert poller.poll_into(view) == 1  # already there: no news
    assert poller._paused_until == 0.0  # noqa: SLF001  (two misses: not paused yet)
    before = time.perf_counter()
    assert poller.poll_into(view) == 0  # the third miss in a row pauses polling
    assert poller._paused_until > before + 100e-6  # noqa: SLF001  (past the poll's end)
    time.sleep(max(0.0, poller._paused_until - time.perf_counter()))  # noqa: SLF001
    assert hit_while_polling(poller, view, a) == 1
    assert poller._misses == 0  # noqa: SLF001  (a hit after waiting: polling paid off)


def test_polling_off_eof_and_bad_budget(sock_pair):
    a, b = sock_pair
    view = memoryview(bytearray(64))
    a.sendall(b"x")
    assert BusyPoller(b, 0.0).poll_into(view) == 0  # off: leaves the byte for recv
    assert b.recv(1) == b"x"
    a.close()
    with pytest.raises(EOFError):
        BusyPoller(b, 1e-3).poll_into(view)
    with pytest.raises(ValueError, match="busy_poll_s"):
        BusyPoller(b, -1.0)


def test_no_polling_while_threads_wait_for_a_cpu(sock_pair, monkeypatch):
    """When more threads are ready to run than we have CPUs (perhaps the peer that would
    answer), a poll stands down at its first look (after 20 us) and counts as a miss:
    three pause polling."""
    monkeypatch.setattr(busypoll, "crowded", lambda cpus: True)
    a, b = sock_pair
    poller = BusyPoller(b, 5.0)
    view = memoryview(bytearray(64))
    start = time.perf_counter()
    for _ in range(3):
        assert poller.poll_into(view) == 0
    assert time.perf_counter() - start < 1.0  # none of them polled its 5 s
    assert poller._paused_until > 0.0  # noqa: SLF001  (three misses: paused)
    a.sendall(b"w")
    assert BusyPoller(b, 5.0).poll_into(view) == 1  # bytes already there are still taken


def test_crowded_counts_the_threads_ready_to_run():
    runnable = busypoll.runnable_threads()
    if busypoll._LOADAVG is None:  # noqa: SLF001
        assert runnable == 0 and not crowded(0)
        return
    assert runnable >= 1  # this thread runs
    assert crowded(0)  # (the module's own function: the fixture stubs busypoll.crowded)
    assert not crowded(1_000_000)
    assert 1 <= busypoll.usable_cpus() <= (os.cpu_count() or 1)
