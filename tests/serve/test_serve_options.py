"""``halfmoon serve`` refuses contradictory options before it starts any process."""

import pytest

from halfmoon.cli import main


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--cpp-stages", "2"], "at least 2 prefill workers"),
        (["--cpp-stages", "2", "--prefill", "2", "--mode", "coupled"], "--mode disaggregated"),
        (["--cpp-stages", "0"], "--cpp-stages and --cpp-chunk-tokens must be >= 1"),
        (["--cpp-chunk-tokens", "0"], "--cpp-stages and --cpp-chunk-tokens must be >= 1"),
        (["--cpp-min-tokens", "-1"], "--cpp-min-tokens >= 0"),
    ],
)
def test_bad_cpp_options_are_named(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HALFMOON_CACHE", str(tmp_path))
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("halfmoon: error:") and message in err
    assert not any(tmp_path.iterdir())  # nothing was prepared or started
