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
