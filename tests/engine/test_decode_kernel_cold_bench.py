"""The cold-cache decode-kernel benchmark (benchmarks/micro/decode_kernel_cold.py) runs
end to end on a small shape and reports every round of its three variants."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.micro import decode_kernel_cold


def test_the_benchmark_times_each_variant_every_round(tmp_path, capsys) -> None:
    out = tmp_path / "cold.json"
    rounds = decode_kernel_cold.main([
        "--shape", "2x2x16", "--layers", "2", "--batches", "1,2", "--contexts", "40",
        "--rounds", "2", "--steps", "1", "--threads", "1", "--json", str(out),
    ])  # fmt: skip
    assert set(rounds) == {"b1x40", "b2x40"}
    for case in rounds.values():
        assert set(case) == {"cold", "hot", "stream"}
        assert all(len(ms) == 2 and all(t > 0 for t in ms) for ms in case.values())
    assert json.loads(out.read_text())["rounds_ms"] == rounds
    table = capsys.readouterr().out
    assert "b2x40" in table and "cold/stream" in table


def test_a_pool_too_small_for_the_case_is_refused() -> None:
    with pytest.raises(SystemExit, match="blocks"):
        decode_kernel_cold.step_ms(
            None, torch.zeros(1, 2, 3, 16, 2, 16), [None], 2, 1, 64,
            "cold", 1,
        )  # fmt: skip
