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


def test_copy_blocks_joins_runs_adjacent_in_memory_and_at_the_destination(monkeypatch):
    from halfmoon.transfer import memcopy

    calls: list[tuple[int, int]] = []
    real = memcopy.copy_into
    monkeypatch.setattr(
        memcopy, "copy_into", lambda d, o, s: (calls.append((o, s.nbytes)), real(d, o, s))
    )
    rows = np.arange(8 * 100, dtype=np.uint8).reshape(8, 100) % 251  # back to back
    loose = [np.full(100, 200 + i, np.uint8) for i in range(2)]  # each its own buffer
    blocks = [
        (0, rows[0]), (100, rows[1]), (200, rows[2]),  # one run of three
        (400, rows[3]),  # adjacent in memory, not at the destination: a new run
        (500, rows[4]), (600, loose[0]), (700, loose[1]),
        (800, memoryview(bytes([9]) * 100)),  # read-only: alone
        (900, rows[6]), (1000, rows[5]),  # destination order against memory order
    ]  # fmt: skip
    dest = memoryview(bytearray(1100))
    memcopy.copy_blocks(dest, [(o, memoryview(b)) for o, b in blocks])
    for offset, src in blocks:
        assert bytes(dest[offset : offset + 100]) == bytes(memoryview(src))
    assert bytes(dest[300:400]) == bytes(100)  # untouched
    assert calls == [(0, 300), (400, 200), (600, 100), (700, 100), (800, 100), (900, 100),
                     (1000, 100)]  # fmt: skip


def test_copy_blocks_copies_a_strided_run_with_one_call(monkeypatch):
    from halfmoon.transfer import memcopy

    copies: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    real = np.copyto
    monkeypatch.setattr(
        memcopy.np,
        "copyto",
        lambda out, src: (copies.append((out.shape, out.strides)), real(out, src)),
    )
    monkeypatch.setattr(memcopy, "copy_into", lambda *a: pytest.fail("copied block by block"))
    pool = np.random.default_rng(3).integers(0, 256, (10, 2, 64), dtype=np.uint8)  # K, V
    keys = [pool[i, 0] for i in range(2, 7)]  # every other 64 B of the pool
    dest = memoryview(bytearray(5 * 96))
    memcopy.copy_blocks(dest, [(i * 96, memoryview(k)) for i, k in enumerate(keys)])
    assert copies == [((5, 64), (96, 1))]
    for i, k in enumerate(keys):
        assert bytes(dest[i * 96 : i * 96 + 64]) == k.tobytes()
        assert bytes(dest[i * 96 + 64 : (i + 1) * 96]) == bytes(32)  # the gaps untouched


@pytest.mark.parametrize("size", [4096, GIL_FREE_BYTES])
def test_copy_blocks_matches_a_block_by_block_copy_on_random_layouts(size):
    from halfmoon.transfer.memcopy import copy_blocks

    rng = np.random.default_rng(size)
    src = rng.integers(0, 256, (24, size), dtype=np.uint8)
    for _ in range(20):
        n = int(rng.integers(1, 12))
        rows = rng.choice(24, n, replace=False)
        if rng.random() < 0.5:  # often a stride in memory
            start, step = int(rng.integers(0, 6)), int(rng.integers(1, 4))
            rows = np.arange(start, start + step * n, step)[
                : min(n, (24 - start + step - 1) // step)
            ]
        slots = (
            rng.choice(16, len(rows), replace=False)
            if rng.random() < 0.5
            else np.arange(len(rows)) * 2
        )
        dest = bytearray(16 * 2 * size)
        want = bytearray(dest)
        blocks = [(int(s) * size, memoryview(src[r])) for s, r in zip(slots, rows, strict=True)]
        for offset, view in blocks:
            want[offset : offset + size] = view
        copy_blocks(memoryview(dest), blocks)
        assert dest == want


@pytest.mark.parametrize("size", [100, GIL_FREE_BYTES])
def test_copy_blocks_refuses_a_range_past_the_end_and_copies_nothing(size):
    from halfmoon.transfer.memcopy import copy_blocks

    src = np.ones((8, 2 * size), np.uint8)
    dest = memoryview(bytearray(4 * size))
    fits = [(0, memoryview(src[7, :size]))]  # a first run that fits: not copied either
    for blocks in (
        [(3 * size + 1, memoryview(src[0, :size]))],  # one block
        [(i * size, memoryview(src.reshape(-1)[i * size : (i + 1) * size])) for i in range(5)],
        [(i * size, memoryview(src[i, :size])) for i in range(5)],  # strided in memory
        [(-size, memoryview(src[0, :size]))],
    ):
        with pytest.raises(ValueError, match="outside the destination"):
            copy_blocks(dest, fits + blocks)
        assert not any(dest)


def test_copy_blocks_returns_the_bytes_copied():
    from halfmoon.transfer.memcopy import copy_blocks

    dest = memoryview(bytearray(1000))
    blocks = [(0, memoryview(bytes(10))), (100, memoryview(bytearray(300)))]
    assert copy_blocks(dest, blocks) == 310
    assert copy_blocks(dest, []) == 0


@pytest.mark.parametrize("size", [4096, GIL_FREE_BYTES])
def test_copy_out_blocks_matches_a_block_by_block_copy_on_random_layouts(size):
    from halfmoon.transfer.memcopy import copy_out_blocks

    rng = np.random.default_rng(size + 1)
    arena = rng.integers(0, 256, 16 * 2 * size, dtype=np.uint8)
    for _ in range(20):
        n = int(rng.integers(1, 12))
        dests = np.zeros((24, size), np.uint8)
        rows = rng.choice(24, n, replace=False)
        if rng.random() < 0.5:  # often a stride in memory
            start, step = int(rng.integers(0, 6)), int(rng.integers(1, 4))
            rows = np.arange(start, start + step * n, step)[
                : min(n, (24 - start + step - 1) // step)
            ]
        slots = (
            rng.choice(32, len(rows), replace=False)
            if rng.random() < 0.5
            else np.arange(len(rows)) * int(rng.integers(1, 3))
        )
        blocks = [(int(s) * size, memoryview(dests[r])) for s, r in zip(slots, rows, strict=True)]
        want = np.zeros_like(dests)
        for s, r in zip(slots, rows, strict=True):
            want[r] = arena[int(s) * size : (int(s) + 1) * size]
        assert copy_out_blocks(memoryview(arena), blocks) == len(blocks) * size
        assert (dests == want).all()


def test_copy_out_blocks_refuses_a_range_past_the_end_and_copies_nothing():
    from halfmoon.transfer.memcopy import copy_out_blocks

    arena = memoryview(bytes(range(256)) * 4)
    dests = np.zeros((5, 256), np.uint8)
    with pytest.raises(ValueError, match="outside the destination"):
        copy_out_blocks(arena, [(i * 256, memoryview(dests[i])) for i in range(5)])
    with pytest.raises(ValueError, match="outside the destination"):
        copy_out_blocks(arena, [(0, memoryview(dests[0])), (-256, memoryview(dests[1]))])
    assert not dests.any()
