"""The cache events' fast constructors build the same frozen values as the classes."""

import dataclasses

import pytest

from halfmoon.core.events import (
    TIER_DRAM,
    TIER_SSD,
    BlockEvicted,
    BlockStored,
    block_evicted,
    block_stored,
)


@pytest.mark.parametrize(
    ("fast", "cls"), [(block_stored, BlockStored), (block_evicted, BlockEvicted)]
)
@pytest.mark.parametrize("tier", [TIER_DRAM, TIER_SSD])
def test_fast_events_equal_the_classes_own(fast, cls, tier):
    event = fast(2**128 - 1, tier)
    assert type(event) is cls
    assert event == cls(2**128 - 1, tier)
    assert hash(event) == hash(cls(2**128 - 1, tier))
    assert repr(event) == repr(cls(2**128 - 1, tier))
    assert event.at("p0") == cls(2**128 - 1, tier, "p0")
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.tier = TIER_SSD  # type: ignore[misc]


def test_a_stored_event_never_equals_an_evicted_one():
    assert block_stored(5, TIER_DRAM) != block_evicted(5, TIER_DRAM)
