"""The data-plane benchmarks' honesty rules (benchmarks/dataplane, halfmoon.transfer.microbench):
one block plan for both systems, fresh bytes every repetition, verified receivers, loud
misses, and every round's figures and ratios kept. No Mooncake needed."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import xxhash

from benchmarks.dataplane import mooncake_peer
from benchmarks.dataplane._common import (
    JsonProcess,
    Ratio,
    alternate_rounds,
    check_plan,
    figure,
    mooncake_env,
    ratio_report,
)
from halfmoon.store import BlockMeta, StoreConfig, TieredStore
from halfmoon.store.shm import attach_segment
from halfmoon.transfer.engine import TransferEngine
from halfmoon.transfer.microbench import (
    MAX_BATCH_BLOCKS,
    REGION_SEGMENT_PREFIX,
    BenchResult,
    VerificationError,
    aggregate,
    bench_transfer,
    check_digest,
    check_found,
    check_same,
    make_plan,
    peer_process,
    percentile,
    plan_arg,
    stamp_blocks,
)

KIB, MIB = 1 << 10, 1 << 20


def result(system: str, gib_s: float, p50_us: float = 10.0, reps=(0.1,)) -> BenchResult:
    """A 1 MiB tcp push row of ``system``."""
    return BenchResult(system, "push", "tcp", MIB, 16, gib_s, 0.01, p50_us, 2 * p50_us, reps)


def test_one_plan_caps_both_systems_alike():
    plan = make_plan([4 * KIB, 64 * KIB, MIB, 16 * MIB], 64 * MIB)
    assert [s.num_blocks for s in plan] == [MAX_BATCH_BLOCKS, MAX_BATCH_BLOCKS, 64, 4]
    assert [s.num_one_ops for s in plan] == [200, 200, 200, 20]  # large blocks: fewer
    # Mooncake's peer receives the very same numbers, never recomputes them.
    parsed = mooncake_peer.parse_plan(plan_arg(plan))
    assert parsed == [(s.block_bytes, s.num_blocks, s.num_one_ops) for s in plan]


def test_mooncake_rows_with_another_block_count_are_refused():
    plan = make_plan([4 * KIB], 64 * MIB)
    good = BenchResult("mooncake", "batch_write", "tcp", 4 * KIB, 1024, 1.0, 0.1, 1.0)
    single = BenchResult("mooncake", "write", "tcp", 4 * KIB, 1, 1.0, 0.1, 1.0)
    check_plan([good, single], plan)
    uncapped = BenchResult("mooncake", "batch_write", "tcp", 4 * KIB, 16384, 1.0, 0.1, 1.0)
    with pytest.raises(RuntimeError, match="16384 blocks"):
        check_plan([uncapped], plan)


def test_stamps_change_every_block_and_nothing_else():
    blocks = np.zeros((4, 64), np.uint8)
    stamp_blocks(blocks, 7)
    first = blocks.copy()
    stamp_blocks(blocks, 8)
    assert all((first[i, :8] != blocks[i, :8]).any() for i in range(4))  # each block changed
    assert len({bytes(row) for row in blocks}) == 4  # and the blocks differ from each other
    assert not blocks[:, 8:].any()  # only the stamp bytes are touched


def test_mooncake_side_stamps_alike():
    blocks = np.zeros((3, 32), np.uint8)
    stamp = mooncake_peer.stamper(blocks)
    stamp()
    before = blocks.copy()
    stamp(1)
    assert (blocks[0] != before[0]).any() and (blocks[1:] == before[1:]).all()


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 201)]
    assert percentile(values, 50) == 100.0
    assert percentile(values, 99) == 198.0
    assert percentile([5.0], 99) == 5.0


def test_checks_raise_on_wrong_or_missing_bytes():
    sent = np.arange(16, dtype=np.uint8).reshape(2, 8)
    check_same(sent.copy(), sent, "ok")
    check_digest(xxhash.xxh3_64_hexdigest(sent), sent, "ok")
    wrong = sent.copy()
    wrong[1, 3] ^= 1
    with pytest.raises(VerificationError):
        check_same(wrong, sent, "one flipped bit")
    with pytest.raises(VerificationError, match="1 of 2 blocks were missing"):
        check_found([BlockMeta(16, 0), None], "get")


def test_a_miss_in_our_store_raises_instead_of_timing():
    store = TieredStore(StoreConfig(block_bytes=64, dram_capacity_bytes=4 * 64))
    try:
        with pytest.raises(VerificationError):
            check_found([store.get_into(123, bytearray(64))], "get of an absent block")
    finally:
        store.close()


def test_a_short_or_missing_mooncake_read_raises():
    mooncake_peer.check_reads([b"x" * 4, 4], 4, "get")
    for bad in ([b"", b"x" * 4], [b"x" * 3], [-704], [3]):
        with pytest.raises(mooncake_peer.VerificationFailed):
            mooncake_peer.check_reads(bad, 4, "get")


def test_every_round_and_its_ratio_are_kept():
    rounds = [
        [result("halfmoon", 2.0, reps=(0.1, 0.2)), result("mooncake", 1.0)],
        [result("halfmoon", 3.0, reps=(0.3,)), result("mooncake", 2.0)],
    ]
    ratio = Ratio(
        "push 1M, tcp vs tcp: ours/Mooncake",
        figure("halfmoon", "push", "tcp", MIB),
        figure("mooncake", "push", "tcp", MIB),
    )
    lines, per_round = ratio_report([ratio], rounds)
    assert per_round == {ratio.label: [2.0, 1.5]}
    assert lines == [f"{ratio.label} = 1.75x  (per round: 2.00x, 1.50x)"]
    ours = aggregate(rounds)[0]
    assert ours.gib_per_s == 2.5 and ours.op_us_p99 == 20.0
    assert ours.batch_s_reps == (0.1, 0.2, 0.3)  # every repetition of every round


def test_wrong_bytes_are_never_skipped_past():
    def ours():
        return [result("halfmoon", 1.0)]

    def broken():
        raise RuntimeError("no libibverbs")

    def lying():
        raise VerificationError("target differs")

    rounds, error = alternate_rounds(2, ours, broken)
    assert error == "no libibverbs" and len(rounds) == 2
    with pytest.raises(VerificationError):
        alternate_rounds(1, ours, lying)


def test_mooncake_env_is_tuned_and_overridable():
    env = mooncake_env()
    assert env["MC_TCP_SLICE_SIZE"] == str(MIB)
    assert env["MC_TCP_ENABLE_CONNECTION_POOL"] == "1"
    env = mooncake_env(65536, ["MC_TCP_LANES_PER_PEER=8"])
    assert env["MC_TCP_SLICE_SIZE"] == "65536" and env["MC_TCP_LANES_PER_PEER"] == "8"
    with pytest.raises(ValueError):
        mooncake_env(extra=["MC_TCP_LANES_PER_PEER"])


@pytest.mark.slow  # a child process
def test_a_mooncake_verification_record_fails_the_run():
    line = '{"verification_error": "get returned different bytes"}'
    proc = JsonProcess([sys.executable, "-c", f"print({line!r})"])
    try:
        with pytest.raises(VerificationError, match="different bytes"):
            list(proc.records(timeout_s=30))
    finally:
        proc.stop()


@pytest.mark.slow  # a peer process
def test_a_corrupted_receiver_byte_fails_our_verification():
    src = np.random.default_rng(0).integers(0, 256, (4, 4096), dtype=np.uint8)
    with peer_process("--region", f"kv:{src.nbytes}:shared") as peer:
        engine = TransferEngine(peer.secret)
        try:
            client = engine.connect(peer.endpoint, "tcp")
            client.push("kv", [(i * 4096, src[i]) for i in range(4)])
        finally:
            engine.close()
        check_digest(peer.region_digest(src.nbytes), src, "push")
        with open(f"/proc/{peer.pid}/maps", encoding="utf-8") as maps:
            name = next(line for line in maps if REGION_SEGMENT_PREFIX in line).split("/")[-1]
        segment = attach_segment(name.strip())
        try:
            segment.buf[5000] ^= 0xFF  # one byte of the second block, flipped behind its back
        finally:
            segment.close()
        with pytest.raises(VerificationError):
            check_digest(peer.region_digest(src.nbytes), src, "push")


@pytest.mark.slow  # a peer process, ~1 s
def test_our_transfer_bench_reports_write_latency_with_p99():
    results = bench_transfer([64 * KIB], MIB, 1, latency_sizes=[4 * KIB], latency_ops=20)
    writes = [r for r in results if r.op == "write"]
    assert {(r.transport, r.block_bytes) for r in writes} == {("tcp", 4096), ("shm", 4096)}
    for r in results:
        assert 0 < r.op_us_p50 <= r.op_us_p99
    assert all(len(r.batch_s_reps) == 20 for r in writes)


@pytest.mark.slow  # a peer process, ~1 s
def test_the_unchecked_arm_pushes_verified_bytes_without_checksums(monkeypatch):
    """``--unchecked``: a second engine with ``checksum=False`` pushes in turn with ours
    and makes its own single writes; its receiver's bytes are verified like every arm's,
    and its rows are labelled."""
    from halfmoon.transfer import link as link_module
    from halfmoon.transfer.microbench import TCP_UNCHECKED

    unchecked_sends = []
    real_send = link_module.Link._send_unchecked

    def spy(self, *args):
        unchecked_sends.append(1)
        return real_send(self, *args)

    monkeypatch.setattr(link_module.Link, "_send_unchecked", spy)
    results = bench_transfer(
        [64 * KIB],
        MIB,
        1,
        transports=("tcp",),
        unchecked=True,
        latency_sizes=[4 * KIB],
        latency_ops=5,
    )
    pushes = {r.transport: r for r in results if r.op == "push"}
    assert set(pushes) == {"tcp", TCP_UNCHECKED}
    assert pushes[TCP_UNCHECKED].num_blocks == pushes["tcp"].num_blocks == 16
    assert unchecked_sends  # the unchecked engine's payloads went without a hash
    writes = {r.transport: r for r in results if r.op == "write"}
    assert set(writes) == {"tcp", TCP_UNCHECKED}  # its single writes too, labelled
    assert len(writes[TCP_UNCHECKED].batch_s_reps) == 5


def test_arms_take_turns_repetition_by_repetition():
    """Interleaving: every arm's batch in turn, so drift falls on all alike; a warm-up turn
    first; receivers checked after the last batch and after the one-block operations."""
    from halfmoon.transfer.microbench import Arm, Step, run_interleaved

    calls: list[str] = []

    def arm(name: str, with_one: bool) -> Arm:
        return Arm(
            name,
            "op",
            "-",
            lambda: calls.append(f"{name} batch"),
            (lambda: calls.append(f"{name} one")) if with_one else None,
            (lambda n: calls.append(f"{name} stamp {n}")) if with_one else None,
            (lambda n: calls.append(f"{name} verify {n}")) if with_one else None,
        )

    rows = run_interleaved([arm("a", True), arm("bare", False)], Step(MIB, 4, 2), reps=2)
    turn = ["a stamp 4", "a batch", "bare batch"]
    assert calls[:10] == turn + turn + turn[:2] + ["a verify 4"] + ["bare batch"]
    assert calls[10:] == ["a stamp 1", "a one"] * 3 + ["a verify 1"]  # warm-up + 2
    assert [(r.system, len(r.batch_s_reps)) for r in rows] == [("a", 2), ("bare", 2)]
    assert rows[1].op_us_p50 == 0.0  # no one-block operations for a batch-only baseline


@pytest.mark.slow  # spawns four processes, ~2 s
def test_bare_pairs_move_batch_after_batch():
    import time

    from benchmarks.dataplane.loopback_ceiling import BarePairs

    with pytest.raises(ValueError, match="multiple of 2"):
        BarePairs(3, checksum=False)
    with BarePairs(8 * MIB, checksum=True) as pairs:
        started = time.perf_counter()
        for _ in range(3):
            pairs.batch()
        assert time.perf_counter() - started < 30
    assert all(not proc.is_alive() for proc in pairs._procs)


class _FakeMooncake:
    """Stands in for Mooncake's te-target / te-writer processes (no Mooncake here): the
    writer answers each "write" with a row of made-up times and a digest; the target
    answers "digest" with ``target_digest`` (the writer's unless a test says otherwise)."""

    calls: list[str] = []
    target_digest: str | None = None
    writer_dies = False

    def __init__(self, argv, env=None) -> None:
        self.role = argv[2]
        self.pending: dict | None = None

    def first(self, key: str, timeout_s: float = 60.0) -> dict:
        if key == "segment":
            return {"segment": "127.0.0.1:1", "addr": 4096}
        if key == "ready":
            return {"ready": True}
        if self.role == "te-writer" and _FakeMooncake.writer_dies:
            raise RuntimeError("te-writer failed: killed")
        assert self.pending is not None
        record, self.pending = self.pending, None
        return record

    def send(self, line: str) -> None:
        word, *numbers = line.split()
        _FakeMooncake.calls.append(f"{self.role} {line}")
        if word == "write":
            size, _warmup, ops = (int(x) for x in numbers)
            times = [50e-6 + i * 1e-6 for i in range(ops)]
            row = mooncake_peer.row("write", "tcp", (size, 1, ops), times, times, num_blocks=1)
            self.pending = {**row, "digest": "abc"}
        else:
            self.pending = {"digest": _FakeMooncake.target_digest or "abc"}

    def stop(self) -> None:
        _FakeMooncake.calls.append(f"{self.role} stop")


@pytest.mark.slow  # a peer process, ~1 s
def test_single_writes_take_turns_with_mooncake_and_pool(monkeypatch):
    """--write-turns: per turn ours (checked and unchecked) and Mooncake's writes take
    turns, who goes first alternating; the pooled p50 / p99 cover every turn's writes."""
    from benchmarks.dataplane import transfer
    from halfmoon.transfer.microbench import TCP_UNCHECKED

    order: list[str] = []
    real_write_latency = transfer.write_latency

    def ours(*args, **kwargs):
        order.append("ours")
        return real_write_latency(*args, **kwargs)

    monkeypatch.setattr(transfer, "write_latency", ours)
    monkeypatch.setattr(transfer, "JsonProcess", _FakeMooncake)
    monkeypatch.setattr(transfer, "mooncake_python", lambda: "python")
    _FakeMooncake.calls = []
    turns, error = transfer.interleaved_writes([4 * KIB], 2, 5, 2, {}, unchecked=True)
    assert error == ""
    writer_calls = [c for c in _FakeMooncake.calls if c.startswith("te-writer")]
    assert writer_calls == ["te-writer write 4096 2 5"] * 2 + ["te-writer stop"]
    assert "te-target stop" in _FakeMooncake.calls  # both processes stopped at the end
    for rows, order in zip(turns, [("tcp", TCP_UNCHECKED), (TCP_UNCHECKED, "tcp")], strict=True):
        assert tuple(r.transport for r in rows if r.system == "halfmoon") == order
        assert all(len(r.batch_s_reps) == 5 for r in rows)
    assert [r.system for r in turns[0]][0] == "halfmoon"  # turn 0: ours first
    assert [r.system for r in turns[1]][0] == "mooncake"  # turn 1: Mooncake first
    pooled = {(p["system"], p["transport"]): p for p in transfer.pooled_writes(turns)}
    assert {k: p["writes"] for k, p in pooled.items()} == {
        ("halfmoon", "tcp"): 10,
        ("halfmoon", TCP_UNCHECKED): 10,
        ("mooncake", "tcp"): 10,
    }
    theirs = pooled[("mooncake", "tcp")]
    assert theirs["p50_us"] == pytest.approx(52.0) and theirs["p99_us"] == pytest.approx(54.0)
    lines = transfer.pooled_ratio_lines(list(pooled.values()))
    assert len(lines) == 2 and all("pooled" in line for line in lines)
    row = turns[0][0]
    assert "batch_s_reps" not in transfer.turn_row(row, samples=False)  # the JSON stays small
    assert len(transfer.turn_row(row, samples=True)["batch_s_reps"]) == 5


@pytest.mark.slow  # a peer process, ~1 s
def test_interleaved_mooncake_writes_are_verified(monkeypatch):
    """A Mooncake target whose bytes differ from what its writer sent fails the run."""
    from benchmarks.dataplane import transfer

    monkeypatch.setattr(transfer, "JsonProcess", _FakeMooncake)
    monkeypatch.setattr(transfer, "mooncake_python", lambda: "python")
    monkeypatch.setattr(_FakeMooncake, "target_digest", "something else")
    with pytest.raises(VerificationError, match="differ"):
        transfer.interleaved_writes([4 * KIB], 1, 3, 0, {}, unchecked=False)


@pytest.mark.slow  # a peer process, ~1 s
def test_ours_go_on_when_mooncake_dies_mid_run(monkeypatch):
    """A Mooncake side that stops answering is reported once; our turns still run."""
    from benchmarks.dataplane import transfer

    monkeypatch.setattr(transfer, "JsonProcess", _FakeMooncake)
    monkeypatch.setattr(transfer, "mooncake_python", lambda: "python")
    monkeypatch.setattr(_FakeMooncake, "writer_dies", True)
    turns, error = transfer.interleaved_writes([4 * KIB], 2, 3, 0, {}, unchecked=False)
    assert "killed" in error
    assert [[r.system for r in rows] for rows in turns] == [["halfmoon"], ["halfmoon"]]
