"""Adaptive busy-polling of a socket before a blocking receive.

A request/response round trip between two processes sleeps twice (each side waits for
the other). When the two run on different cores, every wake-up is an inter-processor
interrupt; in our VM measurements (benchmarks/dataplane/store.py, 4 KiB remote read) that made a
round trip ~120 us, against ~35 us when both sides poll briefly instead. When the peer
shares our core, polling only delays it, and an idle peer makes polling pure waste: so a
few polls in a row that find nothing pause polling for a while. The pause is a time, not
a number of frames: counted in frames (256), the misses at the end of a burst of large
transfers kept the small round trips that followed from polling at all, and a remote
4 KiB read took ~130 us instead of ~60 us for the whole next phase.

The pause starts short (0.5 ms) and doubles, up to 5 ms, while the polls after each pause
miss too; a poll that finds its frame starts over. A busy peer that was slow a few times
in a row (this host's hiccups) costs a short pause: with a fixed 5 ms one, a run of 3,000
one-block writes often had 60-90 of them sleep (~100 us more each here), enough to
move their p99. An idle peer is polled at most 400 us per 5 ms.

Only a poll that waited for its frame counts as a hit. One whose first try finds the
bytes there did not need polling (the caller had slept for them, or the peer ran while
this thread was off the CPU): it leaves the run of misses as it is. Counted as hits, such
reads ended every run of misses, and two threads that the scheduler had put on one core
(a sleeping thread is woken onto its waker's core) kept polling each other off it: every
64 KiB single write then cost a whole poll on each side, 300-650 us for up to ~75 writes
in a row (traced per call, both sides: docs/benchmarks.md, 2026-12-03).

Nor does a poll go on while more threads are ready to run than this process has CPUs
(``/proc/loadavg``'s count of runnable threads, read once a wait after 20 us without a
frame, ~2 us a read): then some thread, perhaps the peer that would send our frame, waits
for a CPU, and polling would keep it off one. With both sides pinned to one core, the
p99 of one-block writes went from 300-370 to 200-270 us (150 us polls); on two free
cores nothing moved beyond the noise (docs/benchmarks.md, 2026-12-04). Where
``/proc/loadavg`` counts more than this process's CPUs (a container on a larger host
without its own view), it says crowded more often and the caller sleeps instead of
polling: slower, never wrong.
"""

from __future__ import annotations

import os
import socket
import time

#: Default poll before sleeping on an awaited frame: longer than a sleeping peer takes to
#: wake up and answer (~60-100 us here), or one side's miss makes the other's miss too and
#: both end up sleeping on every frame (with 50 us, a 4 KiB read took 60 or 130 us from one
#: run to the next; with 150 us, 32-60 us). 400 us rides out most of this VM's stalls
#: (the hypervisor takes a spinning vCPU away for over 60 us ~150 times a second) instead
#: of adding a wake-up to them: 64 KiB one-block writes' p99 0.57-1.01x of 150 us's
#: (median 0.88) in six runs, 4 KiB remote store reads' p99 134-159 us against 206-228
#: (2026-12-04). A longer poll costs only where a CPU is short, and there it stands down.
DEFAULT_BUSY_POLL_S = 400e-6
_MISSES_TO_PAUSE = 3
_PAUSE_S = 5e-3  # the longest pause
_FIRST_PAUSE_S = 0.5e-3
#: How long a poll runs before it looks whether a thread waits for a CPU: most frames of
#: a peer on a core of its own come sooner, and they do not pay for the look (~2 us).
_LOOK_AFTER_S = 20e-6


def _open_loadavg() -> int | None:
    try:
        return os.open("/proc/loadavg", os.O_RDONLY)
    except OSError:  # not Linux: nothing tells us, so never crowded
        return None


_LOADAVG = _open_loadavg()


def runnable_threads() -> int:
    """Threads running or ready to run on the whole machine right now (the caller
    included), from ``/proc/loadavg``; 0 where the kernel does not say."""
    if _LOADAVG is None:
        return 0
    return int(os.pread(_LOADAVG, 128, 0).split()[3].split(b"/", 1)[0])


def usable_cpus() -> int:
    """CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def crowded(cpus: int) -> bool:
    """Whether more threads are ready to run than ``cpus``: someone waits for a CPU."""
    return runnable_threads() > cpus


class BusyPoller:
    """Non-blocking receives on ``sock`` for up to ``poll_s`` before the caller sleeps."""

    def __init__(self, sock: socket.socket, poll_s: float) -> None:
        if poll_s < 0:
            raise ValueError(f"busy_poll_s must be >= 0, got {poll_s}")
        self._sock = sock
        self.poll_s = poll_s
        self._misses = 0
        self._paused_until = 0.0  # perf_counter time before which nothing is polled
        self._pause_s = _FIRST_PAUSE_S  # the next pause's length
        self._cpus = usable_cpus()

    def poll_into(self, view: memoryview) -> int:
        """Bytes received into ``view`` while polling; 0 if none came (or polling is off).

        Raises ``EOFError`` if the peer closed the connection.
        """
        if not self.poll_s:
            return 0
        now = time.perf_counter()
        if now < self._paused_until:
            return 0
        until = now + self.poll_s
        look_at = now + _LOOK_AFTER_S  # then see whether a thread waits for a CPU
        waited = False
        while True:
            try:
                n = self._sock.recv_into(view, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                waited = True
                now = time.perf_counter()
                if now < look_at:
                    continue
                if look_at:
                    look_at = 0.0
                    if crowded(self._cpus):
                        self._missed()
                        return 0
                if now < until:
                    continue
                self._missed()
                return 0
            if n == 0:
                raise EOFError
            if waited:  # it came while we polled: polling paid off
                self._misses, self._pause_s = 0, _FIRST_PAUSE_S
            return n

    def _missed(self) -> None:
        """A poll found nothing (or did not poll): after a few in a row, pause polling."""
        self._misses += 1
        if self._misses >= _MISSES_TO_PAUSE:
            self._paused_until = time.perf_counter() + self._pause_s
            self._pause_s = min(2 * self._pause_s, _PAUSE_S)
            self._misses = _MISSES_TO_PAUSE - 1  # one more miss: a longer pause
