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
    ],
)
def test_a_bad_segment_is_a_remote_error(segments):
    region = MemoryRegion.wrap("r", bytearray(100))
    with pytest.raises(RemoteError):
        region.slices(segments)
