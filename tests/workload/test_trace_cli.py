"""``halfmoon trace stats | cache | generate`` and ``halfmoon demo`` through the real CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from halfmoon.cli import main
from halfmoon.demo import capacity_curve
from halfmoon.workload.datasets import generate_dataset
from halfmoon.workload.trace import read_trace, write_trace


@pytest.fixture()
def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "leval.jsonl"
    write_trace(generate_dataset("leval", 2.0, 80, seed=4), path)
    return path


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_stats_json(capsys: pytest.CaptureFixture[str], trace_file: Path) -> None:
    code, out, err = _run(capsys, "trace", "stats", str(trace_file), "--json")
    assert code == 0 and err == ""  # no progress bar when stderr is not a terminal
    stats = json.loads(out)
    assert stats["num_requests"] == 80
    assert set(stats["input_tokens"]) == {"mean", "p50", "p90", "p99", "max"}
    assert stats["hit_ratio_infinite"] > 0.7


def test_stats_table(capsys: pytest.CaptureFixture[str], trace_file: Path) -> None:
    code, out, _ = _run(capsys, "trace", "stats", str(trace_file))
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["requests", "80"]
    assert any(line.startswith("hit_ratio_infinite") for line in lines)
    header = next(line for line in lines if line.startswith("tokens"))
    assert header.split() == ["tokens", "mean", "p50", "p90", "p99", "max"]
    input_row = next(line for line in lines if line.startswith("input"))
    assert len(input_row) == len(header)  # right-aligned columns end together


def test_cache_json_and_table(capsys: pytest.CaptureFixture[str], trace_file: Path) -> None:
    argv = ["trace", "cache", str(trace_file), "--policy", "lfu", "--capacity-blocks"]
    code, out, _ = _run(capsys, *argv, "10", "100", "inf", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["policy"] == "lfu"
    assert [item["capacity_blocks"] for item in result["results"]] == [10, 100, None]
    ratios = [item["hit_ratio"] for item in result["results"]]
    assert 0 <= ratios[0] < ratios[2] <= 1
    code, out, _ = _run(capsys, *argv, "10", "100", "inf")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "policy: lfu"
    assert lines[1].split() == ["capacity_blocks", "hit_ratio"]
    assert [line.split()[0] for line in lines[2:]] == ["10", "100", "inf"]
    assert float(lines[4].split()[1]) == pytest.approx(ratios[2], abs=1e-4)


def test_cache_progress_bar_on_a_terminal(
    capsys: pytest.CaptureFixture[str], trace_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, out, err = _run(capsys, "trace", "cache", str(trace_file), "--capacity-blocks", "50")
    assert code == 0 and out.startswith("policy: lru")
    assert "80/80" in err  # tqdm's final count, total from a line count of the file


def test_generate_round_trips(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_path = tmp_path / "gen.jsonl"
    argv = ["trace", "generate", "--dataset", "arxiv", "--rate", "3", "--num-requests", "40"]
    code, out, _ = _run(capsys, *argv, "--seed", "9", "--out", str(out_path))
    assert code == 0
    assert out.strip() == f"wrote 40 arxiv requests to {out_path}"
    expected = generate_dataset("arxiv", 3.0, 40, seed=9)
    back = read_trace(out_path)
    assert len(back) == 40
    for want, got in zip(expected, back, strict=True):
        assert got.arrival_time_s == pytest.approx(want.arrival_time_s, abs=1e-6)
        assert (got.input_length, got.output_length) == (want.input_length, want.output_length)
        assert got.block_hashes == want.block_hashes


_GENERATE = ["trace", "generate", "--dataset", "arxiv", "--rate", "1", "--num-requests", "5"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["trace", "cache", "{trace}", "--capacity-blocks", "-5"], "or 'inf', got '-5'"),
        (["trace", "cache", "{trace}", "--capacity-blocks", "lots"], "got 'lots'"),
        (["trace", "cache", "{trace}", "--policy", "mru", "--capacity-blocks", "5"], "'mru'"),
        (["trace", "stats", "{missing}"], "no such trace file"),
        (["trace", "stats", "{bad}"], "bad.jsonl:2: missing field 'hash_ids'"),
        ([*_GENERATE, "--out", "{nodir}"], "cannot write"),
        ([*_GENERATE, "--seed", "-1", "--out", "{out}"], "--seed must be >= 0"),
        ([*_GENERATE, "--dataset", "nope", "--out", "{out}"], "choose from arxiv, leval"),
        ([*_GENERATE, "--rate", "0", "--out", "{out}"], "rate must be a positive number"),
        ([*_GENERATE, "--num-requests", "0", "--out", "{out}"], "num_requests must be"),
    ],
)
def test_errors_are_one_line_exit_2(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    trace_file: Path,
    argv: list[str],
    message: str,
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}\n'
        '{"timestamp": 1, "input_length": 1, "output_length": 1}\n'
    )
    paths = {
        "trace": trace_file,
        "missing": tmp_path / "missing.jsonl",
        "bad": bad,
        "out": tmp_path / "out.jsonl",
        "nodir": tmp_path / "no" / "out.jsonl",
    }
    code, out, err = _run(capsys, *(arg.format(**paths) for arg in argv))
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("halfmoon: error: ")
    assert message in err


def test_trace_without_subcommand_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "trace")
    assert code == 2
    assert "stats" in out and "cache" in out and "generate" in out


def test_demo(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "demo", "--num-requests", "120")
    assert code == 0
    assert "120 'leval' requests" in out
    assert "hit_ratio_infinite" in out and "policy: lru" in out
    curve = [line.split() for line in out.split("policy: lru\n")[1].splitlines()[1:]]
    ratios = [float(hit) for _, hit in curve]
    assert curve[-1][0] == "inf"
    assert ratios == sorted(ratios) and ratios[0] < ratios[-1]


def test_capacity_curve() -> None:
    assert capacity_curve(1000) == [20, 50, 100, 250, 500, 1000, None]
    assert capacity_curve(10) == [1, 2, 5, 10, None]


@pytest.mark.slow  # a subprocess
def test_console_script(tmp_path: Path, trace_file: Path) -> None:
    script = Path(sys.executable).with_name("halfmoon")
    assert script.exists(), f"console script not installed at {script}"
    done = subprocess.run(
        [str(script), "trace", "stats", str(trace_file), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["num_requests"] == 80
    missing = subprocess.run(
        [str(script), "trace", "stats", str(tmp_path / "nope.jsonl")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert missing.returncode == 2
    assert missing.stderr == f"halfmoon: error: {tmp_path / 'nope.jsonl'}: no such trace file\n"
