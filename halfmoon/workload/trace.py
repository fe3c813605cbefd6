"""Mooncake JSONL traces: a streaming reader and a writer.

One JSON object per line (blank lines are skipped, unknown fields ignored)::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

- ``timestamp``: arrival in milliseconds from the start of the trace (int or float, >= 0,
  never decreasing from one line to the next);
- ``input_length`` / ``output_length``: prompt and generated tokens (integers >= 1);
- ``hash_ids``: the prompt's chained prefix-block hashes remapped to integers, one per
  512-token block, the last one possibly covering a partial block, so
  ``len(hash_ids) == ceil(input_length / 512)``.

Any malformed line raises :class:`TraceFormatError` with the one-line message
``FILE:LINE: what is wrong``; nothing is read beyond the failing line.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.ids import IdGenerator
from halfmoon.core.request import Request

#: Tokens covered by one ``hash_ids`` entry in Mooncake traces.
TRACE_BLOCK_SIZE_TOKENS = 512
REQUIRED_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceFormatError(HalfmoonError):
    """A trace file is missing or malformed; the message is ``FILE:LINE: what is wrong``."""


def _is_int(value: Any) -> bool:
    # JSON booleans decode to bool, a subclass of int: they are not lengths or hash ids.
    return isinstance(value, int) and not isinstance(value, bool)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _check_length(obj: dict[str, Any], key: str) -> int:
    value = obj[key]
    if not _is_int(value):
        raise ValueError(f"{key} must be an integer, got {_type_name(value)} {value!r}")
    if value < 1:
        raise ValueError(f"{key} must be >= 1, got {value}")
    return value


def _check_timestamp(value: Any) -> float:
    if not (_is_int(value) or isinstance(value, float)):
        raise ValueError(f"timestamp must be a number, got {_type_name(value)} {value!r}")
    try:
        value_ms = float(value)
    except OverflowError:  # an integer beyond float range: don't echo all its digits
        raise ValueError(f"timestamp is too large ({len(str(value))} digits)") from None
    if not math.isfinite(value_ms) or value_ms < 0:
        raise ValueError(f"timestamp must be a finite number >= 0, got {value!r}")
    return value_ms


def _check_hash_ids(value: Any, input_length: int) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ValueError(f"hash_ids must be a list of integers, got {_type_name(value)}")
    for index, item in enumerate(value):
        if not _is_int(item):
            raise ValueError(f"hash_ids[{index}] must be an integer, got {_type_name(item)}")
        if item < 0:
            raise ValueError(f"hash_ids[{index}] must be >= 0, got {item}")
    expected = -(-input_length // TRACE_BLOCK_SIZE_TOKENS)
    if len(value) != expected:
        raise ValueError(
            f"len(hash_ids) is {len(value)} but input_length {input_length} needs "
            f"ceil({input_length}/{TRACE_BLOCK_SIZE_TOKENS}) = {expected}"
        )
    return tuple(value)


def parse_line(text: str | bytes) -> tuple[float, int, int, tuple[int, ...]]:
    """Validate one trace line; returns ``(timestamp_ms, input_length, output_length, hash_ids)``.

    Raises ``ValueError`` naming the problem (without file or line: the reader adds them).
    """
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {_type_name(obj)}")
    for key in REQUIRED_FIELDS:
        if key not in obj:
            raise ValueError(f"missing field {key!r}")
    timestamp_ms = _check_timestamp(obj["timestamp"])
    input_length = _check_length(obj, "input_length")
    output_length = _check_length(obj, "output_length")
    hash_ids = _check_hash_ids(obj["hash_ids"], input_length)
    return timestamp_ms, input_length, output_length, hash_ids


def _open_trace(path: Path) -> IO[bytes]:
    try:
        return path.open("rb")
    except FileNotFoundError:
        raise TraceFormatError(f"{path}: no such trace file") from None
    except IsADirectoryError:
        raise TraceFormatError(f"{path}: is a directory, not a trace file") from None
    except OSError as exc:
        raise TraceFormatError(f"{path}: cannot read ({exc.strerror})") from None


def iter_trace(path: str | Path, ids: IdGenerator | None = None) -> Iterator[Request]:
    """Stream the requests of a Mooncake JSONL trace, one line at a time.

    Request ids come from ``ids`` when given, else ``req-LINE`` (the 1-based line number,
    so an id points back into the file). The file is checked at once (a missing file fails
    here, not at the first ``next``); it is closed when the iterator is exhausted or closed.
    """
    path = Path(path)
    # Fail now on a missing file; the generator reopens it so that an iterator that is
    # never started holds no open file.
    _open_trace(path).close()
    return _iter_lines(path, ids)


def _format_ms(value: float) -> str:
    return str(int(value)) if value.is_integer() else repr(value)


def _iter_lines(path: Path, ids: IdGenerator | None) -> Iterator[Request]:
    previous_ms = -math.inf
    previous_line = 0
    with _open_trace(path) as handle:
        for line_no, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                timestamp_ms, input_length, output_length, hash_ids = parse_line(
                    raw.decode("utf-8").strip()
                )
            except UnicodeDecodeError:
                raise TraceFormatError(f"{path}:{line_no}: not valid UTF-8") from None
            except ValueError as exc:
                raise TraceFormatError(f"{path}:{line_no}: {exc}") from None
            if timestamp_ms < previous_ms:
                raise TraceFormatError(
                    f"{path}:{line_no}: timestamp {_format_ms(timestamp_ms)} goes backwards "
                    f"(line {previous_line} has {_format_ms(previous_ms)})"
                )
            previous_ms, previous_line = timestamp_ms, line_no
            yield Request(
                request_id=ids.next() if ids is not None else f"req-{line_no}",
                arrival_time_s=timestamp_ms / 1000.0,
                input_length=input_length,
                output_length=output_length,
                block_hashes=hash_ids,
                block_size_tokens=TRACE_BLOCK_SIZE_TOKENS,
            )


def read_trace(path: str | Path, ids: IdGenerator | None = None) -> list[Request]:
    """All requests of a trace as a list (use :func:`iter_trace` to stream)."""
    return list(iter_trace(path, ids))


def count_lines(path: str | Path) -> int:
    """Number of non-blank lines (a progress bar's total), without parsing them."""
    path = Path(path)
    num_lines = 0
    with _open_trace(path) as handle:
        for raw in handle:
            if raw.strip():
                num_lines += 1
    return num_lines


def _timestamp_ms(arrival_time_s: float) -> int | float:
    # Microsecond resolution; integral values are written as JSON integers, as the
    # released traces do.
    value = round(arrival_time_s * 1000.0, 3)
    return int(value) if value == int(value) else value


def format_line(request: Request) -> str:
    """One trace line for ``request`` (no newline).

    The request must carry trace-style block ids at 512 tokens per block.
    """
    if request.block_size_tokens != TRACE_BLOCK_SIZE_TOKENS:
        raise ValueError(
            f"request {request.request_id} has {request.block_size_tokens}-token blocks; "
            f"Mooncake traces use {TRACE_BLOCK_SIZE_TOKENS}"
        )
    if not request.block_hashes:
        raise ValueError(f"request {request.request_id} has no block hashes to write")
    record = {
        "timestamp": _timestamp_ms(request.arrival_time_s),
        "input_length": request.input_length,
        "output_length": request.output_length,
        "hash_ids": list(request.block_hashes),
    }
    return json.dumps(record)


def write_trace(requests: Iterable[Request], path: str | Path) -> int:
    """Write ``requests`` (in arrival order) as Mooncake JSONL; returns how many were written.

    Raises ``ValueError`` for a request that cannot be written (arrival going backwards,
    non-512-token blocks, no block ids) and :class:`HalfmoonError` when the file cannot be
    created.
    """
    path = Path(path)
    try:
        handle = path.open("w", encoding="utf-8")
    except OSError as exc:
        raise HalfmoonError(f"{path}: cannot write ({exc.strerror})") from None
    num_written = 0
    previous_s = -math.inf
    with handle:
        for request in requests:
            if request.arrival_time_s < previous_s:
                raise ValueError(
                    f"request {request.request_id} arrives at {request.arrival_time_s} s, "
                    f"before the previous one ({previous_s} s): sort requests by arrival"
                )
            previous_s = request.arrival_time_s
            handle.write(format_line(request) + "\n")
            num_written += 1
    return num_written


def block_tokens_for_scale(length_scale: float) -> int:
    """Tokens per 512-token trace block at ``length_scale`` (a whole number, so ``halfmoon
    bench`` and ``halfmoon simulate`` replay the same shrunken workload)."""
    if not (math.isfinite(length_scale) and 0 < length_scale <= 1):
        raise ValueError(f"--length-scale must be in (0, 1], got {length_scale}")
    tokens = TRACE_BLOCK_SIZE_TOKENS * length_scale
    if abs(tokens - round(tokens)) > 1e-9 or round(tokens) < 1:
        raise ValueError(
            f"--length-scale {length_scale:g} gives {tokens:g} tokens per 512-token block; "
            "pick a scale that gives a whole number (e.g. 0.5, 0.25, 0.0625)"
        )
    return int(round(tokens))
