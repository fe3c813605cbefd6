"""Block allocator, reference counts and prefix cache, with exact block ids (16-token blocks)."""

from __future__ import annotations

import pytest

from halfmoon.core.errors import HalfmoonError
from halfmoon.engine.block_manager import BlockManager

B = 16


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_allocate_grow_free_exact_ids() -> None:
    bm = BlockManager(num_blocks=8, block_size=B)
    assert bm.admit("a", tokens(0, 40), 40) == 0
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.grow("a", 49)
    assert bm.block_table("a") == [0, 1, 2, 3]
    assert bm.num_free_blocks == 4
    assert not bm.grow("a", 9 * B)  # needs 5 more, 4 free: nothing changes
    assert bm.block_table("a") == [0, 1, 2, 3]
    bm.free("a")
    assert bm.num_free_blocks == 8
    bm.check_integrity()


def test_prefix_hit_shares_blocks_and_counts_refs() -> None:
    bm = BlockManager(num_blocks=8, block_size=B)
    prompt = tokens(100, 50)
    bm.admit("a", prompt, 50)
    bm.commit("a", prompt, 50)  # blocks 0..2 full, block 3 partial
    assert bm.num_cached_blocks == 3
    # Same 48-token prefix, different tail: three blocks shared while "a" still runs.
    other = prompt[:48] + [7, 8, 9]
    assert bm.admit("b", other, len(other)) == 48
    assert bm.block_table("b") == [0, 1, 2, 4]
    bm.check_integrity()
    bm.free("a")
    assert bm.num_free_blocks == 8 - 4  # b holds 0, 1, 2, 4
    bm.free("b")
    bm.check_integrity()


def test_last_prompt_block_is_never_matched() -> None:
    bm = BlockManager(num_blocks=8, block_size=B)
    prompt = tokens(0, 32)
    bm.admit("a", prompt, 32)
    bm.commit("a", prompt, 32)
    bm.free("a")
    # All 32 tokens are cached, but the block of the last token must be recomputed.
    assert bm.admit("b", prompt, 32) == 16
    bm.free("b")
    bm.check_integrity()


def test_cached_free_blocks_evicted_lru_and_uncached_reused_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=B)
    first = tokens(0, 40)  # blocks 0, 1 full + block 2 partial
    bm.admit("a", first, 40)
    bm.commit("a", first, 40)
    bm.free("a")
    # Reuse order: uncached 2 (partial), never-used 3, then cached tails before heads: 1, 0.
    assert bm.admit("b", tokens(1000, 17), 17) == 0
    assert bm.block_table("b") == [2, 3]
    assert bm.num_cached_blocks == 2
    assert bm.grow("b", 3 * B)
    assert bm.block_table("b") == [2, 3, 1]  # evicts first's second block
    assert bm.num_cached_blocks == 1
    bm.free("b")
    # The head block survived: a prompt sharing it hits 16 tokens.
    assert bm.admit("c", first, 40) == 16
    assert bm.block_table("c")[0] == 0
    bm.free("c")
    bm.check_integrity()


def test_admit_counts_free_cached_hits_against_capacity() -> None:
    bm = BlockManager(num_blocks=3, block_size=B)
    prompt = tokens(0, 33)
    bm.admit("a", prompt, 33)
    bm.commit("a", prompt, 33)
    bm.free("a")
    # 2 cached blocks hit + 2 new blocks needed > 3 blocks: refused without side effects.
    assert bm.admit("b", prompt[:32] + tokens(500, 20), 52) is None
    assert bm.num_free_blocks == 3 and bm.num_cached_blocks == 2
    bm.check_integrity()


def test_prefix_caching_disabled_never_hits() -> None:
    bm = BlockManager(num_blocks=8, block_size=B, enable_prefix_caching=False)
    prompt = tokens(0, 40)
    bm.admit("a", prompt, 40)
    bm.commit("a", prompt, 40)
    bm.free("a")
    assert bm.num_cached_blocks == 0
    assert bm.admit("b", prompt, 40) == 0
    bm.free("b")
    bm.check_integrity()


def test_integrity_catches_double_free_and_duplicate_admit() -> None:
    bm = BlockManager(num_blocks=4, block_size=B)
    bm.admit("a", tokens(0, 5), 5)
    with pytest.raises(HalfmoonError):
        bm.admit("a", tokens(0, 5), 5)
    bm.free("a")
    with pytest.raises(KeyError):
        bm.free("a")
    bm._ref_counts[0] = 1  # simulate a leak: a referenced block no table holds
    with pytest.raises(AssertionError):
        bm.check_integrity()


def test_listener_hears_cached_and_evicted_hashes():
    from halfmoon.core.events import BlockStored
    from halfmoon.core.hashing import hash_blocks
    from halfmoon.engine.block_manager import BlockManager

    bm = BlockManager(num_blocks=4, block_size=2)
    heard: list[tuple[str, int]] = []
    bm.listener = lambda e: heard.append(
        ("stored" if isinstance(e, BlockStored) else "evicted", e.block_hash)
    )
    tokens = [1, 2, 3, 4, 5]
    assert bm.admit("a", tokens, 5) == 0
    bm.commit("a", tokens, 5)
    chain = hash_blocks(tokens, 2).full
    assert heard == [("stored", chain[0]), ("stored", chain[1])]
    bm.free("a")
    assert bm.admit("b", [9] * 8, 8) == 0  # needs all 4 blocks: both cached ones evicted
    assert sorted(heard[2:]) == sorted([("evicted", chain[0]), ("evicted", chain[1])])
    bm.free("b")
    bm.check_integrity()


def test_evict_hook_sees_each_cached_block_before_its_reuse():
    """Demotion: the hook gets hash, parent, position and the block id while the block
    still holds its KV (before the listener hears the eviction); read_cached sees it until
    then and never after."""
    from halfmoon.core.events import BlockEvicted
    from halfmoon.core.hashing import NONE_HASH, hash_blocks

    bm = BlockManager(num_blocks=4, block_size=2)
    order: list[tuple] = []
    bm.evict_hook = lambda h, parent, pos, block: order.append(("hook", h, parent, pos, block))
    bm.listener = lambda e: isinstance(e, BlockEvicted) and order.append(("evicted", e.block_hash))
    tokens = [1, 2, 3, 4, 5]
    bm.admit("a", tokens, 5)
    bm.commit("a", tokens, 5)
    table, chain = bm.block_table("a"), hash_blocks(tokens, 2).full
    bm.free("a")
    assert bm.read_cached(chain[1], lambda block: block * 10) == (chain[0], 1, table[1] * 10)
    assert bm.read_cached(12345, lambda block: block) is None
    assert bm.admit("b", [9] * 8, 8) == 0  # takes every block: both cached ones go
    hooks = sorted(o for o in order if o[0] == "hook")
    assert hooks == sorted(
        [("hook", chain[0], NONE_HASH, 0, table[0]), ("hook", chain[1], chain[0], 1, table[1])]
    )
    for h in chain:  # each hook call came before its eviction event
        assert order.index(("evicted", h)) > next(i for i, o in enumerate(order) if o[1] == h)
        assert bm.read_cached(h, lambda block: block) is None
    bm.free("b")
    bm.check_integrity()


def test_cache_salts_isolate_prefix_hits() -> None:
    from halfmoon.core.hashing import chain_root, hash_blocks

    bm = BlockManager(num_blocks=16, block_size=B)
    heard: list[int] = []
    bm.listener = lambda e: heard.append(e.block_hash)
    prompt = tokens(100, 50)
    bm.admit("a", prompt, 50, cache_salt="tenant-a")
    bm.commit("a", prompt, 50)
    assert heard == list(hash_blocks(prompt, B, chain_root("tenant-a")).full)
    bm.free("a")
    assert bm.match_prefix(prompt) == []  # unsalted: no hit
    assert bm.match_prefix(prompt, "tenant-b") == []  # another salt: no hit
    assert len(bm.match_prefix(prompt, "tenant-a")) == 3
    assert bm.admit("b", prompt, 50, cache_salt="tenant-b") == 0
    assert bm.admit("c", prompt, 50) == 0
    assert bm.admit("d", prompt, 50, cache_salt="tenant-a") == 48
    # An imported request's blocks register under its salt too.
    assert bm.allocate("e", 40, cache_salt="tenant-e") is not None
    bm.commit("e", tokens(500, 40), 40)
    assert heard[-2:] == list(hash_blocks(tokens(500, 40), B, chain_root("tenant-e")).full)
    for rid in "bcde":
        bm.free(rid)
    bm.check_integrity()


class FrontPopBlockManager(BlockManager):
    """The plain policy: every block popped from the free queue's front, in that order."""

    def _pop_free_run(self, count: int, after: int | None = None) -> list[int]:
        return [self._pop_free() for _ in range(count)]


def test_a_table_grows_into_its_free_successor() -> None:
    bm = BlockManager(num_blocks=8, block_size=B, enable_prefix_caching=False)
    for rid, start in (("a", 0), ("b", 100), ("c", 200)):
        bm.admit(rid, tokens(start, 32), 32)
    assert [bm.block_table(r) for r in "abc"] == [[0, 1], [2, 3], [4, 5]]
    bm.free("b")
    bm.free("a")  # the queue's front: 0, 1, 2, 3, then 6, 7
    assert bm.grow("c", 64)
    assert bm.block_table("c") == [4, 5, 6, 7]  # the plain policy gives [4, 5, 0, 1]
    assert bm.admit("d", tokens(300, 40), 40) == 0
    assert bm.block_table("d") == [0, 1, 2]
    bm.check_integrity()


def test_popped_blocks_are_sorted_not_reversed() -> None:
    bm = BlockManager(num_blocks=8, block_size=B)
    prompt = tokens(0, 64)
    bm.admit("a", prompt, 64)
    bm.commit("a", prompt, 64)
    bm.admit("x", tokens(500, 64), 64)  # takes the uncached 4..7
    bm.free("a")  # cached, queued tail first: 3, 2, 1, 0
    bm.admit("b", tokens(1000, 48), 48)
    # The plain policy hands out [3, 2, 1]; the same three, ascending.
    assert bm.block_table("b") == [1, 2, 3]
    # Block 0 (the head) is the one still cached, as under the plain policy.
    assert bm.match_prefix(prompt) == [0]
    bm.check_integrity()


@pytest.mark.parametrize("caching", [True, False])
def test_run_layout_evicts_exactly_what_the_plain_policy_evicts(caching: bool) -> None:
    """Same random workload through both policies: the same admits (cache hits), the
    same refusals and the same stored/evicted hashes in the same order."""
    import random

    rng = random.Random(7)
    managers = [
        cls(48, B, enable_prefix_caching=caching) for cls in (BlockManager, FrontPopBlockManager)
    ]
    events: list[list] = [[], []]
    for events_of, bm in zip(events, managers, strict=True):
        bm.listener = events_of.append
    prefixes = [tokens(10_000 * i, rng.choice([16, 32, 64])) for i in range(4)]
    live: dict[str, list[int]] = {}
    outcomes: list[list] = [[], []]
    for step in range(1500):
        action = rng.random()
        if action < 0.3 or not live:
            rid = f"r{step}"
            prompt = rng.choice(prefixes) + [
                rng.randrange(10**6) for _ in range(rng.randint(1, 60))
            ]
            results = [bm.admit(rid, prompt, len(prompt)) for bm in managers]
            if results[0] is not None:
                live[rid] = prompt
                for bm in managers:
                    bm.commit(rid, prompt, len(prompt))
            for out, res in zip(outcomes, results, strict=True):
                out.append(("admit", res))
        elif action < 0.8:
            rid = rng.choice(sorted(live))
            live[rid].extend(rng.randrange(10**6) for _ in range(rng.randint(1, 20)))
            grown = [bm.grow(rid, len(live[rid])) for bm in managers]
            if grown[0]:
                for bm in managers:
                    bm.commit(rid, live[rid], len(live[rid]))
            else:
                live[rid] = live[rid][: len(managers[0].block_table(rid)) * B]
            for out, res in zip(outcomes, grown, strict=True):
                out.append(("grow", res))
        else:
            rid = rng.choice(sorted(live))
            del live[rid]
            for bm in managers:
                bm.free(rid)
    assert outcomes[0] == outcomes[1]
    assert events[0] == events[1]
    assert len(events[0]) > 100 if caching else events[0] == []
    for bm in managers:
        bm.check_integrity()

    # And the layout differs: more of the new policy's tables run through consecutive ids.
    def consecutive_pairs(bm: BlockManager) -> int:
        return sum(
            b == a + 1
            for rid in live
            for a, b in zip(bm.block_table(rid), bm.block_table(rid)[1:], strict=False)
        )

    assert consecutive_pairs(managers[0]) > consecutive_pairs(managers[1])


def test_reset_prefix_cache_forgets_every_cached_block_only_when_none_is_in_use():
    from halfmoon.core.events import BlockEvicted

    bm = BlockManager(num_blocks=8, block_size=B)
    heard: list[object] = []
    bm.listener = heard.append
    bm.evict_hook = lambda *args: pytest.fail("a reset demotes nothing")
    prompt = tokens(100, 50)
    bm.admit("a", prompt, 50)
    bm.commit("a", prompt, 50)
    assert bm.num_cached_blocks == 3
    assert not bm.reset_prefix_cache()  # "a" still holds its blocks: nothing forgotten
    assert bm.num_cached_blocks == 3 and bm.match_prefix(prompt + [1])
    bm.free("a")
    heard.clear()
    assert bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 8
    assert bm.match_prefix(prompt + [1]) == []
    assert len(heard) == 3 and all(isinstance(e, BlockEvicted) for e in heard)
    assert bm.admit("b", prompt, 50) == 0  # computed afresh
    assert bm.block_table("b") == [0, 1, 2, 3]
    bm.free("b")
    bm.check_integrity()
