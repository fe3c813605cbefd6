"""The prefix-pull benchmark (benchmarks/micro/prefix_pull.py) runs end to end on small
blocks: peer processes serve them, every round pulls and verifies them all, raw and
compressed."""

from __future__ import annotations

import json

import pytest

from benchmarks.micro import prefix_pull

pytestmark = pytest.mark.slow  # peer processes


def test_every_round_pulls_and_verifies_every_block(tmp_path, capsys) -> None:
    out = tmp_path / "pull.json"
    result = prefix_pull.main(
        ["--blocks", "6", "--block-bytes", "4096", "--rounds", "2", "--json", str(out)]
    )
    rounds = result["rounds"]["none"]
    assert [r["round"] for r in rounds] == [0, 1]
    assert all(r["verified"] and r["blocks"] == 6 for r in rounds)
    # the worker lives across rounds; each starts without the blocks, so each pulls them
    # (demote, the default: into the pool only)
    assert [(r["pulled"], r["stored"]) for r in rounds] == [(6, 0), (6, 0)]
    assert all(0 < r["loop_held_s"] <= r["pull_s"] for r in rounds)
    # both sides worked on it: the peer read and sent the blocks, this process took them
    assert all(r["peer_cpu_s"] > 0 and r["puller_cpu_s"] > 0 for r in rounds)
    assert json.loads(out.read_text())["rounds"]["none"] == rounds
    printed = capsys.readouterr().out
    assert "every block verified: True" in printed and "CPU ms of the pull" in printed


def test_int8_pulls_arrive_as_the_codec_decodes_them(capsys) -> None:
    """A compressed mode runs beside ``none`` (its wire ceiling), each round both; the
    seeded blocks are the int8 round trip of the peer's, not its exact bytes."""
    result = prefix_pull.main(
        ["--blocks", "5", "--block-bytes", "8192", "--rounds", "2", "--modes", "int8"]
    )
    assert result["modes"] == ["none", "int8"]
    for mode in ("none", "int8"):
        assert [r["verified"] for r in result["rounds"][mode]] == [True, True]
    assert len(result["summary"]["int8"]["rounds_vs_none"]) == 2
    blocks = prefix_pull.synthetic_blocks(5, 8192)
    codec = prefix_pull.codec_of("int8")
    decoded = prefix_pull.expected_blocks(blocks, codec)
    assert decoded[0] != blocks[0].tobytes()  # lossy: the check above was against these
    assert "vs none: median" in capsys.readouterr().out


def test_under_copy_the_pulled_blocks_are_stored_too() -> None:
    result = prefix_pull.main(
        ["--policy", "copy", "--blocks", "4", "--block-bytes", "4096", "--rounds", "2"]
    )
    rounds = result["rounds"]["none"]
    assert [(r["verified"], r["pulled"], r["stored"]) for r in rounds] == [(True, 4, 4)] * 2


def test_a_local_load_reads_the_workers_own_store() -> None:
    result = prefix_pull.main(
        ["--local", "--blocks", "6", "--block-bytes", "4096", "--rounds", "1"]
    )
    (only,) = result["rounds"]["none"]
    assert only["verified"] and only["blocks"] == 6 and only["pulled"] == 0


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit):
        prefix_pull.main(["--blocks", "0"])
    with pytest.raises(SystemExit):
        prefix_pull.main(["--modes", "int9"])
    with pytest.raises(SystemExit):
        prefix_pull.main(["--modes", "int8", "--transport", "shm"])
    with pytest.raises(SystemExit):
        prefix_pull.main(["--modes", "int8", "--block-bytes", "1000"])
    with pytest.raises(SystemExit):
        prefix_pull.main(["--local", "--modes", "int8"])
    with pytest.raises(SystemExit):
        prefix_pull.main(["--policy", "keep"])
