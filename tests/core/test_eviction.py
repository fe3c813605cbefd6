import pytest
from hypothesis import given
from hypothesis import strategies as st

from halfmoon.core.eviction import POLICY_NAMES, PrefixCache, make_policy


def test_lru_order():
    p = make_policy("lru")
    for k in (1, 2, 3):
        p.record_access(k, 0)
    p.record_access(1, 0)
    assert [p.pop_victim() for _ in range(3)] == [2, 3, 1]
    with pytest.raises(KeyError):
        p.pop_victim()


def test_lfu_count_then_recency():
    p = make_policy("lfu")
    for k in (1, 2, 3):
        p.record_access(k, 0)
    p.record_access(1, 0)
    p.record_access(3, 0)
    p.record_access(3, 0)
    # counts: 1->2, 2->1, 3->3; victim order 2, 1, 3
    assert [p.pop_victim() for _ in range(3)] == [2, 1, 3]


def test_lfu_tie_broken_by_least_recent():
    p = make_policy("lfu")
    p.record_access(10, 0)
    p.record_access(20, 0)
    assert p.pop_victim() == 10


def test_length_aware_evicts_later_positions_first_on_ties():
    p = make_policy("length-aware")
    p.record_access(100, 0)
    p.record_access(101, 1)
    p.record_access(102, 2)
    p.record_access(100, 0)  # count 2: kept longest
    assert [p.pop_victim() for _ in range(3)] == [102, 101, 100]


def test_discard_and_counts_forgotten_on_eviction():
    p = make_policy("lfu")
    p.record_access(1, 0)
    p.record_access(1, 0)
    p.record_access(2, 0)
    p.discard(2)
    p.discard(99)  # absent: ignored
    assert 2 not in p and len(p) == 1
    assert p.pop_victim() == 1
    p.record_access(1, 0)  # re-inserted with count 1
    p.record_access(3, 0)
    p.record_access(3, 0)
    assert p.pop_victim() == 1


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown eviction policy 'fifo'"):
        make_policy("fifo")


def test_prefix_cache_replay_rule():
    cache = PrefixCache(capacity_blocks=3, policy="lru")
    assert cache.access([1, 2, 3]) == 0
    assert cache.access([1, 2, 4]) == 2  # 1, 2 hit; 4 inserted; 3 evicted
    assert 3 not in cache and len(cache) == 3
    assert cache.access([1, 5, 2]) == 1  # stops at first miss even though 2 is resident


def test_prefix_cache_unbounded_and_zero():
    inf = PrefixCache(None)
    inf.access(list(range(100)))
    assert len(inf) == 100
    zero = PrefixCache(0)
    assert zero.access([1, 2]) == 0 and zero.access([1, 2]) == 0
    with pytest.raises(ValueError):
        PrefixCache(-1)


@given(
    st.sampled_from(POLICY_NAMES),
    st.integers(0, 8),
    st.lists(st.lists(st.integers(0, 20), min_size=1, max_size=6), max_size=30),
)
def test_capacity_never_exceeded(policy, capacity, requests):
    cache = PrefixCache(capacity, policy)
    for req in requests:
        hit = cache.access(req)
        assert 0 <= hit <= len(req)
        assert len(cache) <= capacity
