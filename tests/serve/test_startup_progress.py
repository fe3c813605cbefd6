"""What ``halfmoon serve`` says while it starts (halfmoon.serve.launch.startup): the import
bar or lines, the wait for the workers, and the ready line with the URL the server really
listens on. No cluster is started here (tests/e2e/test_startup_log.py starts one)."""

from __future__ import annotations

import asyncio
import io
import logging
import urllib.request

import pytest
import uvicorn
from fastapi import APIRouter, FastAPI

from halfmoon.cli import build_parser
from halfmoon.serve.launch.startup import (
    WaitReport,
    announce_when_listening,
    has_page,
    ready_line,
    tensor_progress,
    waiting_line,
)

LOGGER = "startup-test"


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_without_a_terminal_the_import_says_lines_on_the_log(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    stream = io.StringIO()
    with tensor_progress(logging.getLogger(LOGGER), stream) as tick:
        for done in range(1, 121):
            tick(done, 120)
    assert [r.getMessage() for r in caplog.records] == [
        "dequantized 50/120 tensors", "dequantized 100/120 tensors", "dequantized 120/120 tensors"
    ]  # fmt: skip
    assert stream.getvalue() == ""


def test_on_a_terminal_the_import_draws_a_bar_and_closes_it(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    stream = Terminal()
    with tensor_progress(logging.getLogger(LOGGER), stream) as tick:
        for done in range(1, 31):
            tick(done, 30)
        drawn = stream.getvalue()  # closed at the last tensor: a log line starts afresh
        assert "dequantizing" in drawn and "30/30" in drawn and drawn.endswith("\n")
    failed = Terminal()
    with pytest.raises(OSError), tensor_progress(logging.getLogger(LOGGER), failed) as tick:
        tick(3, 8)
        raise OSError("disk full")  # an import that fails part-way: its bar is closed
    assert "3/8" in failed.getvalue() and failed.getvalue().endswith("\n")
    assert caplog.records == []


def test_quiet_log_levels_draw_nothing(caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    stream = Terminal()
    with tensor_progress(logging.getLogger(LOGGER), stream) as tick:
        for done in range(1, 101):
            tick(done, 100)
    assert stream.getvalue() == "" and caplog.records == []


def test_the_wait_speaks_on_change_and_every_heartbeat():
    wait = WaitReport(heartbeat_s=15)
    said = [
        wait.line(report, t)
        for report, t in [
            ("0 of 2 workers registered", 0.2), ("0 of 2 workers registered", 10),
            ("0 of 2 workers registered", 15.3), ("1 of 2 workers registered", 16),
            ("1 of 2 workers registered", 30.9), ("1 of 2 workers registered", 31.1),
        ]
    ]  # fmt: skip
    assert said == [
        "0 of 2 workers registered (0s)", None, "0 of 2 workers registered (15s)",
        "1 of 2 workers registered (16s)", None, "1 of 2 workers registered (31s)",
    ]  # fmt: skip
    assert "3 workers" in waiting_line(3) and "cost profile" in waiting_line(3)


def test_the_ready_line_names_the_urls():
    line = ready_line("smol", "http://127.0.0.1:8000", "disaggregated", 2, dashboard=True)
    assert line == (
        "serving 'smol' at http://127.0.0.1:8000 (OpenAI API http://127.0.0.1:8000/v1, "
        "live page http://127.0.0.1:8000/; disaggregated, 2 workers)"
    )
    bare = ready_line("smol", "http://h:1", "coupled", 1, dashboard=False)
    assert "live page" not in bare and "http://h:1/v1" in bare


def test_has_page_looks_for_a_root_route_in_included_routers_too():
    app = FastAPI()
    app.get("/health")(lambda: {})
    assert not has_page(app)
    router = APIRouter()
    router.get("/")(lambda: {})
    app.include_router(router)
    assert has_page(app)


def test_the_url_is_announced_once_the_server_listens_with_its_real_port(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    app = FastAPI()
    app.get("/ping")(lambda: {"pong": True})

    async def scenario() -> str:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve())
        await announce_when_listening(
            server, "127.0.0.1", 0, lambda url: f"up at {url}", logging.getLogger(LOGGER)
        )
        (record,) = caplog.records
        url = record.getMessage().removeprefix("up at ")
        loop = asyncio.get_running_loop()
        body = await loop.run_in_executor(
            None, lambda: urllib.request.urlopen(url + "/ping").read()
        )
        server.should_exit = True
        await serving
        return body.decode()

    assert asyncio.run(scenario()) == '{"pong":true}'
    assert not caplog.records[0].getMessage().endswith(":0")


def test_a_server_that_stops_before_listening_is_not_announced(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)

    class Stopped:
        started, should_exit = False, True

    asyncio.run(announce_when_listening(Stopped(), "h", 1, str, logging.getLogger(LOGGER)))
    assert caplog.records == []


@pytest.mark.parametrize("argv,expected", [([], False), (["--disable-access-log"], True)])
def test_serve_has_the_access_log_switch(argv, expected):
    args = build_parser().parse_args(["serve", *argv])
    assert args.disable_access_log is expected
