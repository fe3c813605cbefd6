"""halfmoon.serve.runtime.free_port: ports drawn below the kernel's ephemeral range."""

import json
import socket
import time

import pytest

from halfmoon.serve import runtime


@pytest.fixture(autouse=True)
def own_registry(tmp_path, monkeypatch):
    """A machine registry of this test's own (the suite's other worker draws ports too)."""
    path = tmp_path / "ports.json"
    monkeypatch.setattr(runtime, "_REGISTRY", path)
    return path


def test_free_port_is_below_the_ephemeral_range_and_bindable_everywhere():
    port = runtime.free_port()
    assert runtime._LOWEST_DRAWN_PORT <= port < runtime._ephemeral_start()
    with socket.socket() as s:
        s.bind(("0.0.0.0", port))  # free on every interface, not only 127.0.0.1


def test_a_taken_port_is_skipped(monkeypatch):
    # Isolated from the ports this process handed out before, and from other processes
    # (the suite's other worker starts clusters): the second draw is a port free now.
    monkeypatch.setattr(runtime, "_TAKEN", set())
    low = runtime._LOWEST_DRAWN_PORT
    free = next(k for k in range(7, 1000) if runtime._bindable("127.0.0.1", low + k))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        busy = taken.getsockname()[1]
        draws = iter([busy - low, free])
        monkeypatch.setattr(runtime, "_ephemeral_start", lambda: 65535)
        monkeypatch.setattr(runtime.secrets, "randbelow", lambda n: next(draws))
        assert runtime.free_port() == low + free


def test_without_room_below_the_ephemeral_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(runtime, "_ephemeral_start", lambda: runtime._LOWEST_DRAWN_PORT + 10)
    port = runtime.free_port()
    assert port > 0


def test_a_port_is_never_handed_out_twice_in_one_process(monkeypatch):
    """A port handed out is free until its owner binds it, seconds later: the launcher once
    gave a worker the port it had just given the Conductor. The same draw again, or a
    port the process was told of (the gateway's), is skipped."""
    monkeypatch.setattr(runtime, "_TAKEN", set())
    monkeypatch.setattr(runtime, "_ephemeral_start", lambda: 65535)
    # Every port counts as bindable: this is about the process's own record (CI once had
    # another test's cluster listening on low + 11).
    monkeypatch.setattr(runtime, "_bindable", lambda host, port: True)
    draws = iter([11, 11, 12, 12, 13])
    monkeypatch.setattr(runtime.secrets, "randbelow", lambda n: next(draws))
    low = runtime._LOWEST_DRAWN_PORT
    assert runtime.free_port() == low + 11
    assert runtime.free_port() == low + 12  # 11 again: skipped although still unbound
    runtime.reserve_port(low + 13)
    draws = iter([12, 13, 14])
    assert runtime.free_port() == low + 14


def test_a_port_another_process_drew_lately_is_skipped(monkeypatch, own_registry):
    """The machine-wide record: another process's draw of the last ``_HOLD_S`` is skipped,
    an older one is drawn again, and every draw is recorded for the others."""
    monkeypatch.setattr(runtime, "_TAKEN", set())
    monkeypatch.setattr(runtime, "_ephemeral_start", lambda: 65535)
    low = runtime._LOWEST_DRAWN_PORT
    now = time.time()
    own_registry.write_text(json.dumps({str(low + 21): now - 5, str(low + 22): now - 3600}))
    draws = iter([21, 22])
    monkeypatch.setattr(runtime.secrets, "randbelow", lambda n: next(draws))
    assert runtime.free_port() == low + 22
    recorded = json.loads(own_registry.read_text())
    assert sorted(int(p) for p in recorded) == [low + 21, low + 22]  # the stale one renewed
    own_registry.write_text("not json")  # a damaged registry starts over
    draws = iter([23])
    assert runtime.free_port() == low + 23
    assert list(json.loads(own_registry.read_text())) == [str(low + 23)]
