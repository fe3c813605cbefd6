import threading
import time

import numpy as np
import pytest

from halfmoon.core.buffers import GIL_FREE_BYTES, buffer_address, copy_into, span_at


def test_adjacent_slices_have_adjacent_addresses_and_make_one_span():
    rows = np.arange(300, dtype=np.uint8).reshape(3, 100)
    a, b = buffer_address(memoryview(rows[0])), buffer_address(memoryview(rows[1]))
    assert a is not None and b == a + 100
    assert bytes(span_at(a, 200)) == bytes(rows[:2].reshape(-1))


def test_read_only_and_empty_buffers_have_no_address():
    assert buffer_address(memoryview(b"read only")) is None
    assert buffer_address(memoryview(bytearray())) is None


def _longest_pause_of_a_counting_thread(copy, to_the_end: bool = False) -> tuple[float, float]:
    """(longest pause of a thread that loops meanwhile, seconds the copy took);
    ``to_the_end``: the pause in which the copy ended counts too (a copy that holds the
    GIL may end, and the loop be told to stop, before the thread runs again)."""
    done = threading.Event()
    longest = [0.0]

    def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            now = time.perf_counter()
            longest[0] = max(longest[0], now - last)
            last = now
        if to_the_end:
            longest[0] = max(longest[0], time.perf_counter() - last)

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.01)
    longest[0] = 0.0
    started = time.perf_counter()
    copy()
    took = time.perf_counter() - started
    done.set()
    ticker.join()
    return longest[0], took


def test_a_large_copy_lets_other_threads_run():
    """From GIL_FREE_BYTES on, ``copy_into`` releases the GIL: a thread that loops during
    one 128 MiB copy is never held up for anything like the copy's length, where a slice
    assignment (the small-buffer path) holds it for all of it."""
    n = 128 << 20
    src, dest = memoryview(np.ones(n, np.uint8)), memoryview(np.zeros(n, np.uint8))
    for source in (src, memoryview(src.tobytes())):  # writable (memmove), read-only (numpy)
        paused, took = _longest_pause_of_a_counting_thread(lambda s=source: copy_into(dest, 0, s))
        assert dest[0] == dest[-1] == 1
        assert paused < took / 2, (paused, took)
        dest[:] = np.zeros(n, np.uint8)
    held, took = _longest_pause_of_a_counting_thread(
        lambda: dest.__setitem__(slice(None), src), to_the_end=True
    )
    assert held > took / 2  # the assignment holds the GIL throughout: the harness can tell


def test_copy_into_checks_its_range():
    dest = memoryview(bytearray(GIL_FREE_BYTES))
    copy_into(dest, 10, memoryview(b"abc"))
    assert bytes(dest[10:13]) == b"abc"
    with pytest.raises(ValueError, match="outside the destination"):
        copy_into(dest, GIL_FREE_BYTES - 1, memoryview(b"ab"))
