import os
import signal
import stat
import struct
import subprocess
import sys

import pytest
import xxhash
from store_testing import BLOCK_BYTES, meta, payload

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.hashing import hash_blocks
from halfmoon.store import BlockEvicted, BlockStored, StoreConfig, TieredStore
from halfmoon.store.journal import HEADER_BYTES, OP_PUT, RECORD_BYTES, JournalRecord

H = hash_blocks(list(range(16 * 8)), 16).hashes


def ssd_only(tmp_path, num_slots=4, **overrides):
    fields = {
        "block_bytes": BLOCK_BYTES,
        "dram_capacity_bytes": 0,
        "ssd_dir": str(tmp_path),
        "ssd_capacity_bytes": num_slots * BLOCK_BYTES,
        **overrides,
    }
    return fields


def flip_bytes(path, offset, num_bytes=8):
    with open(path, "r+b") as f:
        f.seek(offset)
        data = bytearray(f.read(num_bytes))
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def test_data_file_is_preallocated(make_store, tmp_path):
    make_store(**ssd_only(tmp_path, num_slots=5))
    assert os.path.getsize(tmp_path / "blocks.dat") == 5 * BLOCK_BYTES


def test_corrupt_block_is_a_miss_never_garbage(make_store, events, tmp_path, caplog):
    store = make_store(**ssd_only(tmp_path))
    for i in (0, 1):
        assert store.put(H[i], payload(i), meta(i)) == "ssd"
    flip_bytes(tmp_path / "blocks.dat", store.ssd_file_offset(H[0]) + 100)
    with caplog.at_level("WARNING", logger="halfmoon.store.tiering"):
        assert store.get(H[0]) is None
        assert store.get(H[0]) is None  # dropped: a plain miss, not logged again
    assert [r.getMessage() for r in caplog.records] == [
        f"SSD block {H[0]:032x} failed its checksum: dropped, treated as a miss (its tokens "
        "are recomputed); 1 corrupt so far"
    ]
    assert store.get(H[1]) == (meta(1), payload(1))
    stats = store.stats()
    assert (stats.num_corrupt, stats.num_misses, stats.ssd.num_blocks) == (1, 2, 1)
    assert events.of(BlockEvicted, "ssd") == [H[0]]
    assert not store.contains(H[0])


def test_restart_recovers_the_ssd_index(make_store, events, tmp_path):
    config = {
        "dram_capacity_bytes": 2 * BLOCK_BYTES,
        **{k: v for k, v in ssd_only(tmp_path, 8).items() if k != "dram_capacity_bytes"},
    }
    store = make_store(**config)
    for i in range(6):
        store.put(H[i], payload(i), meta(i), position=i)
    on_ssd = [h for h in H[:6] if "ssd" in store.tiers(h)]
    assert len(on_ssd) == 4  # the other two only ever lived in DRAM
    store.close()
    events.clear()
    reopened = make_store(**config)
    assert sorted(events.of(BlockStored, "ssd")) == sorted(on_ssd)
    for i, h in enumerate(H[:6]):
        expected = (meta(i), payload(i)) if h in on_ssd else None
        assert reopened.get(h) == expected
    reopened.check_integrity()


@pytest.mark.slow  # a subprocess
def test_restart_after_kill_minus_9(make_store, tmp_path):
    config = ssd_only(tmp_path, 8)
    code = f"""
import sys, time
from halfmoon.store import StoreConfig, TieredStore, BlockMeta
store = TieredStore(StoreConfig(**{config!r}))
for i, h in enumerate({list(H[:5])!r}):
    store.put(h, bytes([i % 251 + 1]) * {BLOCK_BYTES}, BlockMeta(16, max(i - 1, 0)))
print("written", flush=True)
time.sleep(60)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "written"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    store = make_store(**config)
    assert [store.get(h) for h in H[:5]] == [(meta(i), payload(i)) for i in range(5)]


def test_torn_journal_tail_is_detected_and_dropped(make_store, tmp_path):
    store = make_store(**ssd_only(tmp_path))
    for i in range(3):
        store.put(H[i], payload(i), meta(i))
    store.close()
    with open(tmp_path / "journal.log", "ab") as f:
        f.write(b"\x01" + bytes(range(30)))  # half a record: the process died mid-append
    store = make_store(**ssd_only(tmp_path))
    assert store.stats().num_torn_records == 1
    assert [store.get(h) for h in H[:3]] == [(meta(i), payload(i)) for i in range(3)]
    assert os.path.getsize(tmp_path / "journal.log") == HEADER_BYTES + 3 * RECORD_BYTES


def test_torn_data_write_is_not_served_after_restart(make_store, tmp_path):
    store = make_store(**ssd_only(tmp_path))
    store.put(H[0], payload(0), meta(0))
    store.put(H[1], payload(1), meta(1))
    offset = store.ssd_file_offset(H[0])
    store.close()
    with open(tmp_path / "blocks.dat", "r+b") as f:  # only the first half reached the disk
        f.seek(offset + BLOCK_BYTES // 2)
        f.write(bytes(BLOCK_BYTES // 2))
    store = make_store(**ssd_only(tmp_path))
    assert store.get(H[0]) is None
    assert store.get(H[1]) == (meta(1), payload(1))
    assert store.stats().num_corrupt == 1


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(HalfmoonError, match="does not exist"):
        TieredStore(StoreConfig(**ssd_only(tmp_path / "nope")))


def test_file_instead_of_directory(tmp_path):
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(HalfmoonError, match="not a directory"):
        TieredStore(StoreConfig(**ssd_only(tmp_path / "f")))


def test_read_only_directory_is_a_clear_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        with pytest.raises(HalfmoonError, match="read-only"):
            TieredStore(StoreConfig(**ssd_only(ro)))
    finally:
        ro.chmod(stat.S_IRWXU)


def test_directory_in_use_and_geometry_mismatch(make_store, tmp_path):
    make_store(**ssd_only(tmp_path))
    with pytest.raises(HalfmoonError, match="in use by another store"):
        TieredStore(StoreConfig(**ssd_only(tmp_path)))
    other = tmp_path / "other"
    other.mkdir()
    TieredStore(StoreConfig(**ssd_only(other))).close()
    with pytest.raises(HalfmoonError, match="configured for 6 slots"):
        TieredStore(StoreConfig(**ssd_only(other, num_slots=6)))


def test_config_errors_are_clear():
    with pytest.raises(ValueError, match="unknown eviction policy"):
        StoreConfig(block_bytes=16, dram_capacity_bytes=64, policy="mru")
    with pytest.raises(ValueError, match="holds no block"):
        StoreConfig(block_bytes=16, dram_capacity_bytes=8)
    with pytest.raises(ValueError, match="needs an ssd_dir"):
        StoreConfig(block_bytes=16, dram_capacity_bytes=64, ssd_capacity_bytes=64)


A_MODEL, B_MODEL = b"A" * 16, b"B" * 16


def test_a_directory_of_another_namespace_opens_empty(make_store, events, tmp_path):
    """Blocks written for one model's fingerprint are never served under another's, though
    the token hashes match; the same namespace recovers them, and the slots are reused."""
    store = make_store(**ssd_only(tmp_path, ssd_namespace=A_MODEL))
    for i in range(3):
        store.put(H[i], payload(i), meta(i))
    store.delete(H[2])
    store.close()
    same = make_store(**ssd_only(tmp_path, ssd_namespace=A_MODEL))
    assert same.get(H[0]) == (meta(0), payload(0))
    assert same.stats().num_foreign_blocks == 0
    same.close()
    events.clear()
    other = make_store(**ssd_only(tmp_path, ssd_namespace=B_MODEL))
    assert events.of(BlockStored, "ssd") == []
    assert other.stats().num_foreign_blocks == 2  # H[2] was deleted before
    assert other.get(H[0]) is None and not other.contains(H[1])
    for i in range(4):  # every slot is free again
        assert other.put(H[4 + i], payload(4 + i), meta(4 + i)) == "ssd"
    other.check_integrity()
    other.close()
    back = make_store(**ssd_only(tmp_path, ssd_namespace=A_MODEL))  # the journal is B's now
    assert back.stats().num_foreign_blocks == 4 and back.get(H[0]) is None


def test_a_cleared_tier_takes_another_namespace(make_store, tmp_path):
    """New weights while serving: the emptied tier names them, so blocks written from then
    on are served under them after a restart, and never under the old weights."""
    store = make_store(**ssd_only(tmp_path, ssd_namespace=A_MODEL))
    store.put(H[0], payload(0), meta(0))
    with pytest.raises(ValueError, match="1 blocks of the old origin"):
        store.set_ssd_namespace(B_MODEL)
    assert store.clear()
    store.set_ssd_namespace(B_MODEL)
    store.put(H[1], payload(1), meta(1))
    store.close()
    new = make_store(**ssd_only(tmp_path, ssd_namespace=B_MODEL))
    assert new.get(H[1]) == (meta(1), payload(1)) and new.get(H[0]) is None
    new.close()
    old = make_store(**ssd_only(tmp_path, ssd_namespace=A_MODEL))  # (takes the directory)
    assert old.stats().num_foreign_blocks == 1 and old.get(H[1]) is None


def test_another_namespace_may_bring_another_geometry(make_store, tmp_path):
    """A geometry mismatch is an error only within one namespace: another namespace's
    directory holds nothing this store could use, so it is taken over."""
    make_store(**ssd_only(tmp_path, ssd_namespace=A_MODEL)).close()
    with pytest.raises(HalfmoonError, match="configured for 6 slots"):
        TieredStore(StoreConfig(**ssd_only(tmp_path, num_slots=6, ssd_namespace=A_MODEL)))
    store = make_store(**ssd_only(tmp_path, num_slots=6, ssd_namespace=B_MODEL))
    assert store.stats().ssd.capacity_blocks == 6


def test_a_journal_of_the_format_before_namespaces_is_not_served(make_store, tmp_path):
    """A directory written before namespaces (journal "HMSSDJ01") holds KV of unknown
    weights: opened empty, its blocks counted."""
    header = struct.pack("<8sQQ", b"HMSSDJ01", BLOCK_BYTES, 4)
    header += struct.pack("<Q", xxhash.xxh3_64_intdigest(header))
    records = b"".join(JournalRecord(OP_PUT, H[i], i, 0, meta(i)).encode() for i in range(3))
    (tmp_path / "journal.log").write_bytes(header + records)
    store = make_store(**ssd_only(tmp_path))
    assert store.stats().num_foreign_blocks == 3 and store.get(H[0]) is None
    with pytest.raises(ValueError, match="16 bytes"):
        StoreConfig(**ssd_only(tmp_path, ssd_namespace=b"short"))
