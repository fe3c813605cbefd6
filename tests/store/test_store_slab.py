import subprocess
import sys

import pytest

from halfmoon.store.errors import IntegrityError
from halfmoon.store.slab import SlabArena, SlotAllocator


def test_allocator_hands_out_every_slot_once_then_none():
    alloc = SlotAllocator(3)
    slots = [alloc.alloc() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2]
    assert alloc.alloc() is None
    alloc.free(1)
    assert alloc.alloc() == 1
    alloc.check_integrity(used_slots=[0, 1, 2])


def test_allocator_rejects_double_free_and_out_of_range():
    alloc = SlotAllocator(2)
    slot = alloc.alloc()
    alloc.free(slot)
    with pytest.raises(IntegrityError, match="freed twice"):
        alloc.free(slot)
    with pytest.raises(IntegrityError, match="outside"):
        alloc.free(7)
    alloc.check_integrity(used_slots=[])


def test_integrity_detects_leak_and_sharing():
    alloc = SlotAllocator(4)
    a, b = alloc.alloc(), alloc.alloc()
    with pytest.raises(IntegrityError, match="leaked"):
        alloc.check_integrity(used_slots=[a])
    with pytest.raises(IntegrityError, match="share a slot"):
        alloc.check_integrity(used_slots=[a, a])
    with pytest.raises(IntegrityError, match="both free and in use"):
        alloc.check_integrity(used_slots=[a, b, 3])
    alloc.check_integrity(used_slots=[a, b])


def test_claim_takes_a_specific_slot():
    alloc = SlotAllocator(3)
    alloc.claim(2)
    with pytest.raises(IntegrityError, match="claimed twice"):
        alloc.claim(2)
    assert sorted([alloc.alloc(), alloc.alloc()]) == [0, 1]
    alloc.check_integrity(used_slots=[0, 1, 2])


def test_private_arena_slots_are_disjoint_views():
    arena = SlabArena(3, 8)
    arena.view(1)[:] = b"abcdefgh"
    assert bytes(arena.buffer[8:16]) == b"abcdefgh"
    assert bytes(arena.view(0)) == bytes(8)
    assert arena.offset(2) == 16 and arena.segment_name is None
    with pytest.raises(IndexError):
        arena.view(3)
    arena.close()


@pytest.mark.slow  # a subprocess
def test_shared_arena_is_readable_from_another_process():
    arena = SlabArena(4, 16, shared=True)
    try:
        arena.view(2)[:] = b"0123456789abcdef"
        code = (
            "import sys; from halfmoon.store.slab import SlabArena; "
            "a = SlabArena.attach(sys.argv[1], 4, 16); v = a.view(2); "
            "sys.stdout.write(bytes(v).decode()); v.release(); a.view(3)[:] = b'x' * 16; a.close()"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, arena.segment_name],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout == "0123456789abcdef"
        assert bytes(arena.view(3)) == b"x" * 16  # the child wrote into our memory
    finally:
        arena.close()
