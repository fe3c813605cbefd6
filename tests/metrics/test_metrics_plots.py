import subprocess
import sys

import pytest

from halfmoon.metrics import plot_cdfs, plot_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path) -> tuple[int, int]:
    """Width and height from the PNG's IHDR chunk, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_plot_cdfs_writes_png(tmp_path):
    out = tmp_path / "ttft.png"
    written = plot_cdfs(
        {"8P8D": [0.5, 1.0, 2.0, 4.0], "16M": [1.0, 3.0, 9.0], "empty": []},
        out,
        xlabel="TTFT (s)",
        title="TTFT",
        limit_s=2.0,
    )
    assert written == out
    width, height = png_size(out)
    assert (width, height) == (720, 540)
    assert out.stat().st_size > 5_000


def test_plot_report_writes_two_panels(tmp_path, run, slo):
    out = tmp_path / "report.png"
    plot_report({"disaggregated": run, "coupled": run[:3]}, slo, str(out))
    width, height = png_size(out)
    assert (width, height) == (1440, 540)
    assert out.stat().st_size > 10_000


@pytest.mark.parametrize(
    "series,folder,msg",
    [
        ({}, "", "no series"),
        ({"a": [1.0, float("inf")]}, "", "series 'a' holds a value that is not finite"),
        ({"a": [1.0]}, "missing", "does not exist"),
    ],
)
def test_plot_cdfs_bad_input(tmp_path, series, folder, msg):
    with pytest.raises(ValueError, match=msg):
        plot_cdfs(series, tmp_path / folder / "x.png", xlabel="x", title="t")


def test_plot_report_needs_a_run(tmp_path, slo):
    with pytest.raises(ValueError, match="no runs"):
        plot_report({}, slo, tmp_path / "x.png")


@pytest.mark.slow  # a subprocess
def test_importing_metrics_does_not_import_matplotlib():
    code = "import sys, halfmoon.metrics; print('matplotlib' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "False"
