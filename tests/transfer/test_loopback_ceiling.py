"""benchmarks.dataplane.loopback_ceiling: the bare loopback-tcp ceiling quoted against our tcp."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs a script in a subprocess

ROOT = Path(__file__).resolve().parents[2]
#: Run as the benchmark is, from the repository root.
SCRIPT = [sys.executable, "-m", "benchmarks.dataplane.loopback_ceiling"]


def test_ceiling_script_measures_both_variants(tmp_path):
    out = tmp_path / "ceiling.json"
    run = subprocess.run(
        [*SCRIPT, "--seconds", "0.3", "--rounds", "1", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    medians = json.loads(out.read_text())["median_gib_s"]
    assert set(medians) == {"2 pairs, no checksum", "2 pairs, xxh3 both sides"}
    assert all(value > 0.05 for value in medians.values())  # GiB/s; loopback moves far more
    assert "put+get bound" in run.stdout


def test_ceiling_script_rejects_bad_arguments():
    run = subprocess.run(
        [*SCRIPT, "--seconds", "0"], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert run.returncode == 2
    assert "--seconds must be positive" in run.stderr
