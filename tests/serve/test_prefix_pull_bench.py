"""The prefix-pull benchmark (benchmarks/micro/prefix_pull.py) runs end to end on small
blocks: a peer process serves them, every round pulls and verifies them all."""

from __future__ import annotations

import json

import pytest

from benchmarks.micro import prefix_pull

pytestmark = pytest.mark.slow  # a peer process


def test_every_round_pulls_and_verifies_every_block(tmp_path, capsys) -> None:
    out = tmp_path / "pull.json"
    rounds = prefix_pull.main(
        ["--blocks", "6", "--block-bytes", "4096", "--rounds", "2", "--json", str(out)]
    )
    assert [r["round"] for r in rounds] == [0, 1]
    assert all(r["verified"] and r["blocks"] == 6 for r in rounds)
    assert all(0 < r["loop_held_s"] <= r["pull_s"] for r in rounds)
    assert json.loads(out.read_text())["rounds"] == rounds
    assert "every block verified: True" in capsys.readouterr().out


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(SystemExit):
        prefix_pull.main(["--blocks", "0"])
