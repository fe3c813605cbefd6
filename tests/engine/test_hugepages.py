"""Huge pages for torch's CPU memory: the CLI's default, and that torch honours it here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from halfmoon import cli
from halfmoon.engine import hugepages

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_enable_by_default_keeps_a_value_already_set() -> None:
    env: dict[str, str] = {}
    assert hugepages.enable_by_default(env) is True
    assert env == {hugepages.ENV: "1"}
    off = {hugepages.ENV: "0"}
    assert hugepages.enable_by_default(off) is False
    assert off == {hugepages.ENV: "0"}
    assert hugepages.requested({hugepages.ENV: " 1 "}) is True
    assert hugepages.requested({hugepages.ENV: ""}) is False


def test_every_halfmoon_command_asks_for_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(hugepages.ENV, raising=False)
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert hugepages.requested()
    monkeypatch.setenv(hugepages.ENV, "0")
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert not hugepages.requested()


@pytest.mark.skipif(
    not THP_MODE.exists() or "[never]" in THP_MODE.read_text(),
    reason="the kernel has no transparent huge pages",
)
@pytest.mark.parametrize("value", ["1", "0"])
def test_torch_backs_large_tensors_with_huge_pages_when_asked(value: str) -> None:
    if value == "0" and "[always]" in THP_MODE.read_text():
        pytest.skip("the kernel backs every large mapping with huge pages")
    code = (
        "import torch\n"
        "from halfmoon.engine import hugepages\n"
        "pool = torch.zeros(64 << 18)\n"  # 64 MiB, every page touched
        "print(hugepages.resident_mib())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, hugepages.ENV: value},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    mib = float(out.stdout.strip())
    assert (mib >= 32) if value == "1" else (mib < 32), out.stdout
