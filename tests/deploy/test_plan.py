"""The controller's pool bookkeeping (no Ray)."""

import pytest

from halfmoon.core.errors import HalfmoonError
from halfmoon.deploy.plan import DRAINING, Pools, ScalePlan


def _pools(prefill: int = 1, decode: int = 1) -> Pools:
    pools = Pools("disaggregated")
    for role, n in (("prefill", prefill), ("decode", decode)):
        for _ in range(n):
            pools.add(role)
    return pools


def test_scale_up_adds_new_indexes_and_down_drains_newest_first():
    pools = _pools(1, 1)
    assert pools.plan({"decode": 3}) == ScalePlan(add=("decode", "decode"))
    added = [pools.add(r).name for r in pools.plan({"decode": 3}).add]
    assert added == ["decode-1", "decode-2"]
    plan = pools.plan({"decode": 1, "prefill": 2})
    assert plan == ScalePlan(add=("prefill",), drain=("decode-2", "decode-1"))
    for name in plan.drain:
        assert pools.mark_draining(name).state == DRAINING
    assert pools.counts() == {"prefill": 1, "decode": 1}
    pools.remove("decode-2")
    # an index is never reused: a newcomer is never mistaken for a restart
    assert pools.add("decode").name == "decode-3"
    assert sorted(pools.workers) == ["decode-0", "decode-1", "decode-3", "prefill-0"]
    pools.check_integrity()


def test_plan_changes_nothing_and_unnamed_pools_keep_their_size():
    pools = _pools(2, 2)
    assert pools.plan({"prefill": 1}) == ScalePlan(drain=("prefill-1",))
    assert pools.plan({"prefill": 2, "decode": 2}) == ScalePlan()
    assert pools.counts() == {"prefill": 2, "decode": 2}


def test_bundles_are_reused_by_their_pool():
    pools = Pools("disaggregated")
    pools.give_bundles("prefill", [0])
    pools.give_bundles("decode", [1, 2])
    p0, d0, d1, d2 = (pools.add(r) for r in ("prefill", "decode", "decode", "decode"))
    assert (p0.bundle, d0.bundle, d1.bundle, d2.bundle) == (0, 1, 2, None)
    pools.mark_draining("decode-0")
    pools.remove("decode-0")
    assert pools.add("decode").bundle == 1  # the freed bundle, not the prefill one
    assert pools.add("prefill").bundle is None
    pools.check_integrity()


@pytest.mark.parametrize(
    ("mode", "targets", "message"),
    [
        ("disaggregated", {"decode": 0}, "at least 1"),
        ("disaggregated", {"coupled": 2}, "no coupled pool"),
        ("coupled", {"prefill": 1}, "no prefill pool"),
    ],
)
def test_bad_targets_are_clear_errors(mode, targets, message):
    pools = Pools(mode)
    with pytest.raises(HalfmoonError, match=message):
        pools.plan(targets)


def test_unknown_names_and_modes():
    pools = _pools()
    with pytest.raises(HalfmoonError, match="unknown worker"):
        pools.remove("decode-9")
    with pytest.raises(HalfmoonError, match="unknown worker"):
        pools.mark_draining("decode-9")
    with pytest.raises(HalfmoonError, match="unknown mode"):
        Pools("both")


def test_the_record_round_trips_through_json_and_indexes_stay_unique():
    import json

    pools = Pools("disaggregated")
    pools.give_bundles("decode", [0, 1])
    for role in ("prefill", "decode", "decode", "decode"):
        pools.add(role)
    pools.mark_draining("decode-2")
    pools.remove("decode-0")  # frees bundle 0
    restored = Pools.from_dict(json.loads(json.dumps(pools.to_dict())))
    assert restored.to_dict() == pools.to_dict()
    assert restored.workers["decode-2"].state == DRAINING
    assert restored.counts() == {"prefill": 1, "decode": 1}
    # a restarted controller keeps issuing new indexes and reusing freed bundles
    newcomer = restored.add("decode")
    assert (newcomer.name, newcomer.bundle) == ("decode-3", 0)
    restored.check_integrity()


def test_an_adopted_worker_keeps_its_index_and_it_is_never_issued_again():
    pools = _pools(1, 1)
    assert pools.adopt("decode", 5).name == "decode-5"
    assert pools.add("decode").name == "decode-6"
    assert pools.adopt("prefill", 0).name == "prefill-0"  # already known: same record
    assert pools.counts() == {"prefill": 1, "decode": 3}
    pools.check_integrity()
    with pytest.raises(HalfmoonError, match="no coupled pool"):
        pools.adopt("coupled", 0)
