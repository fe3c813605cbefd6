"""Peer addresses: ``"host:port"`` strings."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_HOST = "127.0.0.1"


@dataclass(frozen=True)
class Endpoint:
    """A peer's listening address."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        """Parse ``host:port`` (``[v6addr]:port`` for IPv6); ``ValueError`` when malformed."""
        host, sep, port_text = text.rpartition(":")
        if not sep or not host or not port_text.isdigit():
            raise ValueError(f"peer endpoint must look like host:port, got {text!r}")
        port = int(port_text)
        if not 0 < port < 65536:
            raise ValueError(f"port {port} in {text!r} is outside 1..65535")
        return cls(host.strip("[]"), port)

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"
