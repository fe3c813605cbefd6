"""Mooncake JSONL reader and writer: valid input, every malformed case, round trips."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.ids import IdGenerator
from halfmoon.core.request import Request
from halfmoon.workload.trace import (
    TraceFormatError,
    format_line,
    iter_trace,
    read_trace,
    write_trace,
)


def _line(timestamp=0, input_length=1000, output_length=10, hash_ids=(1, 2), **extra) -> str:
    return json.dumps(
        {
            "timestamp": timestamp,
            "input_length": input_length,
            "output_length": output_length,
            "hash_ids": list(hash_ids),
            **extra,
        }
    )


def _write(tmp_path: Path, lines: list[str], name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _error(path: Path) -> str:
    with pytest.raises(TraceFormatError) as info:
        read_trace(path)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_reads_fields_and_skips_blank_lines(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        [
            _line(0, 512, 5, [7]),
            "",
            "   ",
            _line(1500.5, 513, 6, [7, 8], extra_field="ignored"),
        ],
    )
    first, second = read_trace(path)
    assert first == Request("req-1", 0.0, 512, 5, (7,), 512)
    assert second.request_id == "req-4"  # ids follow file line numbers, blank lines included
    assert second.arrival_time_s == pytest.approx(1.5005)
    assert (second.input_length, second.output_length) == (513, 6)
    assert second.block_hashes == (7, 8)
    assert second.block_size_tokens == 512


def test_id_generator_names_requests(tmp_path: Path) -> None:
    path = _write(tmp_path, [_line(0), _line(1)])
    ids = [r.request_id for r in iter_trace(path, IdGenerator("trace"))]
    assert ids == ["trace-0", "trace-1"]


def test_empty_file_has_no_requests(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n", encoding="utf-8")
    assert read_trace(path) == []


def test_reader_streams_up_to_the_bad_line(tmp_path: Path) -> None:
    path = _write(tmp_path, [_line(0), _line(1), "{broken"])
    requests = iter_trace(path)
    assert next(requests).request_id == "req-1"
    assert next(requests).request_id == "req-2"
    with pytest.raises(TraceFormatError, match=r":3: invalid JSON"):
        next(requests)


def test_missing_file_fails_at_call(tmp_path: Path) -> None:
    path = tmp_path / "absent.jsonl"
    with pytest.raises(TraceFormatError, match=re.escape(f"{path}: no such trace file")):
        iter_trace(path)


def test_directory_is_not_a_trace(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="is a directory"):
        iter_trace(tmp_path)


def test_invalid_json(tmp_path: Path) -> None:
    path = _write(tmp_path, [_line(0), '{"timestamp": 1,'])
    assert _error(path) == (
        f"{path}:2: invalid JSON (Expecting property name enclosed in double quotes at column 17)"
    )


def test_line_that_is_not_an_object(tmp_path: Path) -> None:
    path = _write(tmp_path, ["[1, 2, 3]"])
    assert _error(path) == f"{path}:1: expected a JSON object, got list"


def test_invalid_utf8(tmp_path: Path) -> None:
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(_line(0).encode() + b"\n\xff\xfe\n")
    assert _error(path) == f"{path}:2: not valid UTF-8"


@pytest.mark.parametrize("field", ["timestamp", "input_length", "output_length", "hash_ids"])
def test_missing_field(tmp_path: Path, field: str) -> None:
    record = json.loads(_line(0))
    del record[field]
    path = _write(tmp_path, [_line(0), json.dumps(record)])
    assert _error(path) == f"{path}:2: missing field '{field}'"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"timestamp": "5"}, "timestamp must be a number, got str '5'"),
        ({"timestamp": True}, "timestamp must be a number, got bool True"),
        ({"input_length": 1000.5}, "input_length must be an integer, got float 1000.5"),
        ({"input_length": True}, "input_length must be an integer, got bool True"),
        ({"output_length": None}, "output_length must be an integer, got null None"),
        ({"hash_ids": "1,2"}, "hash_ids must be a list of integers, got str"),
        ({"hash_ids": [1, "2"]}, "hash_ids[1] must be an integer, got str"),
        ({"hash_ids": [1, 2.0]}, "hash_ids[1] must be an integer, got float"),
    ],
)
def test_wrong_type(tmp_path: Path, overrides: dict, expected: str) -> None:
    record = {**json.loads(_line(0)), **overrides}
    path = _write(tmp_path, [json.dumps(record)])
    assert _error(path) == f"{path}:1: {expected}"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"input_length": 0, "hash_ids": []}, "input_length must be >= 1, got 0"),
        ({"input_length": -512, "hash_ids": []}, "input_length must be >= 1, got -512"),
        ({"output_length": 0}, "output_length must be >= 1, got 0"),
        ({"output_length": -3}, "output_length must be >= 1, got -3"),
        ({"timestamp": -1}, "timestamp must be a finite number >= 0, got -1"),
        ({"hash_ids": [1, -2]}, "hash_ids[1] must be >= 0, got -2"),
        ({"timestamp": float("nan")}, "timestamp must be a finite number >= 0, got nan"),
        ({"timestamp": 10**400}, "timestamp is too large (401 digits)"),
    ],
)
def test_negative_or_zero_values(tmp_path: Path, overrides: dict, expected: str) -> None:
    record = {**json.loads(_line(0)), **overrides}
    path = _write(tmp_path, [_line(0), json.dumps(record)])
    assert _error(path) == f"{path}:2: {expected}"


@pytest.mark.parametrize(
    ("input_length", "hash_ids", "expected"),
    [
        (1025, [1, 2], "len(hash_ids) is 2 but input_length 1025 needs ceil(1025/512) = 3"),
        (512, [1, 2], "len(hash_ids) is 2 but input_length 512 needs ceil(512/512) = 1"),
    ],
)
def test_hash_ids_inconsistent_with_length(
    tmp_path: Path, input_length: int, hash_ids: list[int], expected: str
) -> None:
    path = _write(tmp_path, [_line(0, input_length, 1, hash_ids)])
    assert _error(path) == f"{path}:1: {expected}"


def test_timestamps_going_backwards(tmp_path: Path) -> None:
    path = _write(tmp_path, [_line(100), _line(200), "", _line(150)])
    assert _error(path) == f"{path}:4: timestamp 150 goes backwards (line 2 has 200)"


def test_large_and_fractional_timestamps_in_backwards_message(tmp_path: Path) -> None:
    path = _write(tmp_path, [_line(1022025), _line(1022024.5)])
    assert _error(path) == f"{path}:2: timestamp 1022024.5 goes backwards (line 1 has 1022025)"


def test_equal_timestamps_are_fine(tmp_path: Path) -> None:
    path = _write(tmp_path, [_line(100), _line(100)])
    assert len(read_trace(path)) == 2


def test_write_then_read_round_trips(tmp_path: Path) -> None:
    requests = [
        Request("a", 0.0, 1024, 3, (0, 1)),
        Request("b", 0.25, 1025, 4, (0, 1, 2)),
        Request("c", 1.0000005, 7, 1, (3,)),
    ]
    path = tmp_path / "out.jsonl"
    assert write_trace(requests, path) == 3
    back = read_trace(path)
    for original, read in zip(requests, back, strict=True):
        assert read.arrival_time_s == pytest.approx(original.arrival_time_s, abs=1e-6)
        assert (read.input_length, read.output_length) == (
            original.input_length,
            original.output_length,
        )
        assert read.block_hashes == original.block_hashes


def test_integral_timestamps_are_written_as_integers() -> None:
    line = json.loads(format_line(Request("a", 2.0, 10, 1, (5,))))
    assert line == {"timestamp": 2000, "input_length": 10, "output_length": 1, "hash_ids": [5]}
    assert isinstance(line["timestamp"], int)
    assert json.loads(format_line(Request("b", 0.0015, 10, 1, (5,))))["timestamp"] == 1.5


def test_writer_rejects_what_a_trace_cannot_hold(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="32-token blocks"):
        format_line(Request("a", 0.0, 64, 1, (1, 2), block_size_tokens=32))
    with pytest.raises(ValueError, match="no block hashes"):
        format_line(Request("a", 0.0, 64, 1))
    backwards = [Request("a", 1.0, 10, 1, (1,)), Request("b", 0.5, 10, 1, (2,))]
    with pytest.raises(ValueError, match="sort requests by arrival"):
        write_trace(backwards, tmp_path / "x.jsonl")


def test_writer_reports_unwritable_path(tmp_path: Path) -> None:
    with pytest.raises(HalfmoonError, match="cannot write"):
        write_trace([], tmp_path / "no" / "such" / "dir.jsonl")
