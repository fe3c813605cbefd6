"""``interleave`` (halfmoon/serve/gateway/responses.py): streams merged as their items come,
each tagged with its stream's index; a stream ends when exhausted or after the item
``last`` accepts; an exception ends the whole; closing it closes every stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

import pytest

from halfmoon.serve.gateway.responses import interleave


class Stream:
    """Yields ``items`` with ``delay_s`` before each; ``fail`` raises after them."""

    def __init__(self, items: list[str], delay_s: float = 0.0, fail: bool = False) -> None:
        self.items, self.delay_s, self.fail = items, delay_s, fail
        self.closed = False

    async def run(self) -> AsyncIterator[str]:
        try:
            for item in self.items:
                await asyncio.sleep(self.delay_s)
                yield item
            if self.fail:
                raise RuntimeError("stream failed")
        finally:
            self.closed = True


async def _all(streams: list[Stream], last=lambda _: False) -> list[tuple[int, str]]:
    async with aclosing(interleave([s.run() for s in streams], last)) as items:
        return [item async for item in items]


def test_items_come_tagged_as_they_come_and_every_stream_is_read_to_its_end():
    slow, fast = Stream(["s1", "s2"], 0.05), Stream(["f1", "f2", "f3"], 0.001)
    got = asyncio.run(_all([slow, fast]))
    assert got[0] == (1, "f1") and sorted(got) == [(0, "s1"), (0, "s2"), (1, "f1"),
                                                    (1, "f2"), (1, "f3")]  # fmt: skip
    assert [i for i in got if i[0] == 0] == [(0, "s1"), (0, "s2")]  # each in its order
    assert slow.closed and fast.closed
    one = Stream(["a", "b"])
    assert asyncio.run(_all([one])) == [(0, "a"), (0, "b")]


def test_a_stream_ends_after_the_item_last_accepts():
    streams = [Stream(["a", "end", "never"]), Stream(["b", "end", "never"])]
    got = asyncio.run(_all(streams, lambda item: item == "end"))
    assert "never" not in {item for _, item in got} and len(got) == 4
    assert all(s.closed for s in streams)
    alone = Stream(["a", "end", "never"])
    assert asyncio.run(_all([alone], lambda item: item == "end")) == [(0, "a"), (0, "end")]


def test_an_exception_ends_the_whole_and_closes_every_stream():
    failing, long = Stream(["x"], 0.001, fail=True), Stream(["y"] * 50, 0.01)
    with pytest.raises(RuntimeError, match="stream failed"):
        asyncio.run(_all([failing, long]))
    assert long.closed


def test_closing_early_closes_every_stream():
    streams = [Stream(["a"] * 20, 0.001), Stream(["b"] * 20, 0.001)]

    async def first_three() -> list[tuple[int, str]]:
        got = []
        async with aclosing(interleave([s.run() for s in streams])) as items:
            async for item in items:
                got.append(item)
                if len(got) == 3:
                    break
        return got

    assert len(asyncio.run(first_three())) == 3
    assert all(s.closed for s in streams)
