"""The served comparison's table (benchmarks/eval/served_vs_vllm.py): medians per server
and the ratio of each round's pair, every round listed."""

from __future__ import annotations

from benchmarks.eval.served_vs_vllm import FIGURES, table


def test_the_table_pairs_each_rounds_servers() -> None:
    runs = []
    for rnd, (hm, vl) in enumerate([(10.0, 20.0), (30.0, 20.0), (12.0, 10.0)]):
        for server, value in (("halfmoon", hm), ("vllm", vl)):
            runs.append({"round": rnd, "server": server, "point": "p",
                         **dict.fromkeys(FIGURES, value)})  # fmt: skip
    runs.append({"round": 3, "server": "vllm", "point": "p", **dict.fromkeys(FIGURES, 1.0)})
    text = table({"config": {"points": [["p", 8, 32, 512, 64]]}, "runs": runs})
    line = next(row for row in text.splitlines() if "output_throughput" in row)
    # (round 3 has no halfmoon run: left out)
    assert line == "| p | output_throughput | 12.0 | 20.0 | 1.20 [0.50, 1.20, 1.50] |"
