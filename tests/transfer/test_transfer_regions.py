"""A region's slices for an inline push: segments back to back join, bad ones are refused."""

import pytest

from halfmoon.transfer import RemoteError
from halfmoon.transfer.regions import MemoryRegion


def test_segments_back_to_back_join_into_one_view():
    region = MemoryRegion.wrap("r", bytearray(range(100)))
    views, total = region.slices([[0, 10], [10, 10], [20, 5], [40, 10], [50, 0], [50, 5], [0, 3]])
    assert total == 43
    assert [bytes(v) for v in views] == [bytes(range(25)), bytes(range(40, 55)), bytes(range(3))]


@pytest.mark.parametrize(
    "segments",
    [
        [[0, 10], [95, 10]],  # past the end
        [[-1, 5]],
        [[5, -1]],
        [[0, 10], [10]],  # malformed
        [[0, "10"]],
        [[0.0, 10]],
        ["ab"],
        [[95, 10]],  # one segment (the fast path), past the end
        [[True, 10]],
        [[0, 10, 1]],
    ],
)
def test_a_bad_segment_is_a_remote_error(segments):
    region = MemoryRegion.wrap("r", bytearray(100))
    with pytest.raises(RemoteError):
        region.slices(segments)


def test_one_segment_is_one_view_of_the_region():
    region = MemoryRegion.wrap("r", bytearray(range(100)))
    views, total = region.slices([[90, 10]])
    assert total == 10 and [bytes(v) for v in views] == [bytes(range(90, 100))]
    assert region.slices([[100, 0]])[1] == 0
