import numpy as np
import pytest

from halfmoon.store.shm import create_segment
from halfmoon.transfer.memcopy import GIL_FREE_BYTES, copy_into


@pytest.mark.parametrize("size", [1, 4096, GIL_FREE_BYTES - 1, GIL_FREE_BYTES, 3 << 20])
def test_copy_into_places_the_bytes_and_nothing_else(size):
    segment = create_segment(size + 8192)
    try:
        src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
        copy_into(segment.buf, 4096, memoryview(src))
        got = np.frombuffer(segment.buf, np.uint8)
        assert (got[4096 : 4096 + size] == src).all()
        assert not got[:4096].any() and not got[4096 + size :].any()
        del got
    finally:
        segment.close(unlink=True)


@pytest.mark.parametrize("size", [100, GIL_FREE_BYTES])
def test_copy_into_refuses_a_range_past_the_end(size):
    dest = memoryview(bytearray(size + 10))
    with pytest.raises(ValueError):
        copy_into(dest, 11, memoryview(bytes(size)))


def test_copy_blocks_joins_runs_adjacent_in_memory_and_at_the_destination(monkeypatch):
    from halfmoon.transfer import memcopy

    calls: list[tuple[int, int]] = []
    real = memcopy.copy_into
    monkeypatch.setattr(
        memcopy, "copy_into", lambda d, o, s: (calls.append((o, s.nbytes)), real(d, o, s))
    )
    rows = np.arange(8 * 100, dtype=np.uint8).reshape(8, 100) % 251  # back to back
    loose = [np.full(100, 200 + i, np.uint8) for i in range(2)]  # each its own buffer
    blocks = [
        (0, rows[0]), (100, rows[1]), (200, rows[2]),  # one run of three
        (400, rows[3]),  # adjacent in memory, not at the destination: a new run
        (500, rows[4]), (600, loose[0]), (700, loose[1]),
        (800, memoryview(bytes([9]) * 100)),  # read-only: alone
        (900, rows[6]), (1000, rows[5]),  # destination order against memory order
    ]  # fmt: skip
    dest = memoryview(bytearray(1100))
    memcopy.copy_blocks(dest, [(o, memoryview(b)) for o, b in blocks])
    for offset, src in blocks:
        assert bytes(dest[offset : offset + 100]) == bytes(memoryview(src))
    assert bytes(dest[300:400]) == bytes(100)  # untouched
    assert calls == [(0, 300), (400, 200), (600, 100), (700, 100), (800, 100), (900, 100),
                     (1000, 100)]  # fmt: skip
