import numpy as np
import pytest

from halfmoon.core.buffers import GIL_FREE_BYTES, copy_into
from halfmoon.store.shm import create_segment


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

    b = GIL_FREE_BYTES  # runs are looked for among blocks this large
    calls: list[tuple[int, int]] = []
    real = memcopy.copy_into
    monkeypatch.setattr(
        memcopy, "copy_into", lambda d, o, s: (calls.append((o, s.nbytes)), real(d, o, s))
    )
    rows = (np.arange(8 * b, dtype=np.int64) % 251).astype(np.uint8).reshape(8, b)
    loose = [np.full(b, 200 + i, np.uint8) for i in range(2)]  # each its own buffer
    blocks = [
        (0, rows[0]), (b, rows[1]), (2 * b, rows[2]),  # one run of three
        (4 * b, rows[3]),  # adjacent in memory, not at the destination: a new run
        (5 * b, rows[4]), (6 * b, loose[0]), (7 * b, loose[1]),
        (8 * b, memoryview(bytes([9]) * b)),  # read-only: alone
        (9 * b, rows[6]), (10 * b, rows[5]),  # destination order against memory order
    ]  # fmt: skip
    dest = memoryview(bytearray(11 * b))
    memcopy.copy_blocks(dest, [(o, memoryview(x)) for o, x in blocks])
    for offset, src in blocks:
        assert bytes(dest[offset : offset + b]) == bytes(memoryview(src))
    assert bytes(dest[3 * b : 4 * b]) == bytes(b)  # untouched
    assert calls == [(0, 3 * b), (4 * b, 2 * b), (6 * b, b), (7 * b, b), (8 * b, b), (9 * b, b),
                     (10 * b, b)]  # fmt: skip


def test_copy_blocks_copies_a_strided_run_with_one_call(monkeypatch):
    from halfmoon.transfer import memcopy

    b = GIL_FREE_BYTES
    copies: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    real = np.copyto
    monkeypatch.setattr(
        memcopy.np,
        "copyto",
        lambda out, src: (copies.append((out.shape, out.strides)), real(out, src)),
    )
    monkeypatch.setattr(memcopy, "copy_into", lambda *a: pytest.fail("copied block by block"))
    pool = np.random.default_rng(3).integers(0, 256, (10, 2, b), dtype=np.uint8)  # K, V
    keys = [pool[i, 0] for i in range(2, 7)]  # every other block of the pool
    stride = b + b // 2
    dest = memoryview(bytearray(5 * stride))
    memcopy.copy_blocks(dest, [(i * stride, memoryview(k)) for i, k in enumerate(keys)])
    assert copies == [((5, b), (stride, 1))]
    for i, k in enumerate(keys):
        assert bytes(dest[i * stride : i * stride + b]) == k.tobytes()
        assert bytes(dest[i * stride + b : (i + 1) * stride]) == bytes(b // 2)  # gaps untouched


def test_small_blocks_are_copied_one_by_one_without_looking_for_runs(monkeypatch):
    from halfmoon.transfer import memcopy

    monkeypatch.setattr(memcopy, "buffer_address", lambda v: pytest.fail("looked for runs"))
    rows = np.arange(4 * 4096, dtype=np.int64).astype(np.uint8).reshape(4, 4096)
    arena = memoryview(bytearray(8 * 4096))
    blocks = [(o * 4096, memoryview(rows[i])) for i, o in enumerate((3, 0, 5, 6))]
    assert memcopy.copy_blocks(arena, blocks) == 4 * 4096
    back = np.zeros_like(rows)
    outs = [(o, memoryview(back[i])) for i, (o, _) in enumerate(blocks)]
    assert memcopy.copy_out_blocks(arena, outs) == 4 * 4096
    assert (back == rows).all()


@pytest.mark.parametrize("size", [4096, GIL_FREE_BYTES])
def test_copy_blocks_matches_a_block_by_block_copy_on_random_layouts(size):
    from halfmoon.transfer.memcopy import copy_blocks

    rng = np.random.default_rng(size)
    src = rng.integers(0, 256, (24, size), dtype=np.uint8)
    for _ in range(20):
        rows, slots = _random_layout(rng, 16)
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
        dests = np.zeros((24, size), np.uint8)
        rows, slots = _random_layout(rng, 32)
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


def _random_layout(rng: np.random.Generator, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Up to 11 of 24 rows (often at a stride in memory) and a distinct slot for each of
    ``num_slots`` (often every other one or back to back)."""
    n = int(rng.integers(1, 12))
    rows = rng.choice(24, n, replace=False)
    if rng.random() < 0.5:  # often a stride in memory
        start, step = int(rng.integers(0, 6)), int(rng.integers(1, 4))
        rows = np.arange(start, start + step * n, step)[: min(n, (24 - start + step - 1) // step)]
    if rng.random() < 0.5:
        slots = rng.choice(num_slots, len(rows), replace=False)
    else:
        slots = np.arange(len(rows)) * int(rng.integers(1, 3))
    return rows, slots
