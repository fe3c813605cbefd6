import numpy as np

from halfmoon.core.buffers import buffer_address, span_at


def test_adjacent_slices_have_adjacent_addresses_and_make_one_span():
    rows = np.arange(300, dtype=np.uint8).reshape(3, 100)
    a, b = buffer_address(memoryview(rows[0])), buffer_address(memoryview(rows[1]))
    assert a is not None and b == a + 100
    assert bytes(span_at(a, 200)) == bytes(rows[:2].reshape(-1))


def test_read_only_and_empty_buffers_have_no_address():
    assert buffer_address(memoryview(b"read only")) is None
    assert buffer_address(memoryview(bytearray())) is None
