import json

import pytest

from halfmoon.cli import main


def test_microbench_transfer_prints_json(capsys):
    assert main(["microbench", "transfer", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    rows = {(r["system"], r["transport"], r["block_bytes"]) for r in payload["results"]}
    for size in (64 << 10, 1 << 20, 16 << 20):
        assert {("memcpy", "-", size), ("halfmoon", "tcp", size), ("halfmoon", "shm", size)} <= rows
    assert all(r["gib_per_s"] > 0 for r in payload["results"])


@pytest.mark.slow  # ~6 s here
def test_microbench_store_prints_a_table(capsys):
    assert main(["microbench", "store"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["system", "op", "transport"]
    assert {"local", "tcp", "shm"} <= {line.split()[2] for line in out.splitlines()[1:]}


def test_microbench_rejects_unknown_targets(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["microbench", "gpu"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
