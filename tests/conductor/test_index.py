import random

from hypothesis import given
from hypothesis import strategies as st

from halfmoon.conductor import PrefixIndex


def _naive(held: dict[str, set[int]], hashes: list[int], ids: list[str]) -> dict[str, int]:
    out = {}
    for iid in ids:
        n = 0
        for h in hashes:
            if h not in held.get(iid, set()):
                break
            n += 1
        out[iid] = n
    return out


def test_match_example_from_docstring():
    idx = PrefixIndex()
    for iid in ("a", "b", "c", "d"):
        idx.add_instance(iid)
    for iid, blocks in {"a": [0, 1, 2], "b": [0], "c": [], "d": [0, 1]}.items():
        for h in blocks:
            idx.stored(iid, h)
    assert idx.match([0, 1, 2, 3], ["a", "b", "c", "d"]) == {"a": 3, "b": 1, "c": 0, "d": 2}
    assert idx.match([], ["a"]) == {"a": 0}
    assert idx.match([0], ["unknown"]) == {"unknown": 0}
    # Only the holders of the first block, for the instances of the mask.
    assert idx.match_holders([0, 1, 2, 3], idx.mask(["a", "b", "c"])) == {"a": 3, "b": 1}
    assert idx.match_holders([5], idx.mask(["a", "b", "c", "d"])) == {}


def test_tiers_count_as_held_until_gone_from_all():
    idx = PrefixIndex()
    idx.stored("a", 7, "dram")
    idx.stored("a", 7, "ssd")  # demotion: stored in ssd before dram eviction
    idx.evicted("a", 7, "dram")
    assert idx.holds("a", 7)
    idx.evicted("a", 7, "ssd")
    assert not idx.holds("a", 7)
    assert len(idx) == 0


def test_remove_instance_clears_its_blocks_and_reuses_slot():
    idx = PrefixIndex()
    idx.stored("a", 1)
    idx.stored("b", 1)
    idx.remove_instance("a")
    assert idx.holders(1) == ["b"]
    idx.stored("c", 2)
    assert idx.match([1], ["b", "c"]) == {"b": 1, "c": 0}
    assert not idx.holds("c", 1)


@given(st.data())
def test_match_agrees_with_naive(data):
    rng = random.Random(data.draw(st.integers(0, 10_000)))
    ids = [f"i{k}" for k in range(data.draw(st.integers(1, 70)))]
    idx = PrefixIndex()
    held: dict[str, set[int]] = {}
    for _ in range(data.draw(st.integers(0, 300))):
        iid, h = rng.choice(ids), rng.randrange(12)
        if rng.random() < 0.7:
            idx.stored(iid, h, rng.choice(["dram", "ssd"]))
            held.setdefault(iid, set()).add(h)
        else:
            idx.evicted(iid, h, "dram")
            idx.evicted(iid, h, "ssd")
            held.get(iid, set()).discard(h)
    hashes = [rng.randrange(12) for _ in range(rng.randrange(10))]
    assert idx.match(hashes, ids) == _naive(held, hashes, ids)


@given(st.data())
def test_num_held_counts_distinct_blocks_in_any_tier(data):
    """The per-instance count kept as events come equals a scan of the index, through
    stores in several tiers, evictions of held and unknown pairs, and removals."""
    index = PrefixIndex()
    ids = ["a", "b", "c"]
    held: dict[str, set[tuple[str, int]]] = {i: set() for i in ids}
    for _ in range(data.draw(st.integers(0, 60))):
        iid = data.draw(st.sampled_from(ids))
        tier = data.draw(st.sampled_from(["dram", "ssd"]))
        h = data.draw(st.integers(0, 8))
        op = data.draw(st.sampled_from(["store", "store", "evict", "remove"]))
        if op == "store":
            index.stored(iid, h, tier)
            held[iid].add((tier, h))
        elif op == "evict":
            index.evicted(iid, h, tier)
            held[iid].discard((tier, h))
        else:
            index.remove_instance(iid)
            held[iid] = set()
        for i in ids:
            assert index.num_held(i) == len({b for _, b in held[i]})
