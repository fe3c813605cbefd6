"""halfmoon.serve.runtime.free_port: ports drawn below the kernel's ephemeral range."""

import socket

from halfmoon.serve import runtime


def test_free_port_is_below_the_ephemeral_range_and_bindable_everywhere():
    port = runtime.free_port()
    assert runtime._LOWEST_DRAWN_PORT <= port < runtime._ephemeral_start()
    with socket.socket() as s:
        s.bind(("0.0.0.0", port))  # free on every interface, not only 127.0.0.1


def test_a_taken_port_is_skipped(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        busy = taken.getsockname()[1]
        draws = iter([busy - runtime._LOWEST_DRAWN_PORT, 7])
        monkeypatch.setattr(runtime, "_ephemeral_start", lambda: 65535)
        monkeypatch.setattr(runtime.secrets, "randbelow", lambda n: next(draws))
        assert runtime.free_port() == runtime._LOWEST_DRAWN_PORT + 7


def test_without_room_below_the_ephemeral_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(runtime, "_ephemeral_start", lambda: runtime._LOWEST_DRAWN_PORT + 10)
    port = runtime.free_port()
    assert port > 0
