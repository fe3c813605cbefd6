"""Mutual HMAC-SHA256 challenge-response on a fresh link, before any other frame.

::

    server -> CHALLENGE {nonce: Ns}
    client -> AUTH      {nonce: Nc, mac: HMAC(secret, "hm-client" | Ns | Nc), client_id}
    server -> AUTH_OK   {mac: HMAC(secret, "hm-server" | Nc | Ns), shm: namespace}
                                                                   or ERROR + close

The secret never crosses the wire; fresh nonces on both sides defeat replay; the
server's proof keeps a client from talking to an impostor. ``shm`` names the shared
memory the server sees (:func:`~halfmoon.store.shm.shm_namespace`), so a client with the
``auto`` transport knows whether it can copy blocks through shared memory.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from halfmoon.store.shm import shm_namespace
from halfmoon.transfer.errors import (
    AuthenticationError,
    PeerClosedError,
    TransferError,
    TransferTimeout,
)
from halfmoon.transfer.link import Link
from halfmoon.transfer.protocol import Kind

_NONCE_BYTES = 32
MIN_SECRET_BYTES = 16
#: The most meta bytes read from a peer before it proved it knows the secret.
HANDSHAKE_MAX_META_BYTES = 4096


def check_secret(secret: bytes) -> bytes:
    """Return ``secret`` if usable, else ``ValueError`` (too short or not bytes)."""
    if not isinstance(secret, bytes):
        raise ValueError("the transfer secret must be bytes")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the transfer secret must have at least {MIN_SECRET_BYTES} bytes")
    return secret


def _mac(secret: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, label + first + second, hashlib.sha256).digest()


@dataclass(frozen=True)
class PeerHello:
    """What the server learned about an authenticated client."""

    client_id: str


@dataclass(frozen=True)
class ServerHello:
    """What the client learned about an authenticated server."""

    shm_namespace: str  # "" when unknown (no /dev/shm there, or an older peer)

    def shares_memory(self) -> bool:
        """Whether this process can attach the server's shared-memory segments."""
        return bool(self.shm_namespace) and self.shm_namespace == shm_namespace()


def server_handshake(link: Link, secret: bytes, deadline: float) -> PeerHello:
    """Challenge a new client; raise :class:`AuthenticationError` (and close) on failure."""
    server_nonce = secrets.token_bytes(_NONCE_BYTES)
    link.send(Kind.CHALLENGE, {"nonce": server_nonce}, deadline=deadline)
    try:  # an AUTH frame is a few dozen bytes: nothing bigger is read from a stranger
        frame = link.recv(deadline, HANDSHAKE_MAX_META_BYTES, max_payload_bytes=0)
    except TransferError:
        link.close()
        raise AuthenticationError(f"client {link.peer} sent no valid AUTH frame") from None
    meta = frame.meta
    client_nonce, mac = meta.get("nonce"), meta.get("mac")
    valid_shape = (
        frame.kind == Kind.AUTH
        and isinstance(client_nonce, bytes)
        and len(client_nonce) == _NONCE_BYTES
        and isinstance(mac, bytes)
    )
    if not valid_shape or not hmac.compare_digest(
        mac, _mac(secret, b"hm-client", server_nonce, client_nonce)
    ):
        try:
            link.send(
                Kind.ERROR, {"code": "auth", "message": "wrong shared secret"}, deadline=deadline
            )
        finally:
            link.close()
        raise AuthenticationError(f"client {link.peer} failed authentication")
    link.send(
        Kind.AUTH_OK,
        {"mac": _mac(secret, b"hm-server", client_nonce, server_nonce), "shm": shm_namespace()},
        deadline=deadline,
    )
    return PeerHello(str(meta.get("client_id", "")))


def client_handshake(link: Link, secret: bytes, client_id: str, deadline: float) -> ServerHello:
    """Answer the server's challenge and check its proof; raise on any mismatch."""
    try:
        frame = link.recv(deadline)
        if frame.kind != Kind.CHALLENGE or not isinstance(frame.meta.get("nonce"), bytes):
            raise AuthenticationError(f"peer {link.peer} did not start the halfmoon handshake")
        server_nonce = frame.meta["nonce"]
        client_nonce = secrets.token_bytes(_NONCE_BYTES)
        mac = _mac(secret, b"hm-client", server_nonce, client_nonce)
        link.send(
            Kind.AUTH,
            {"nonce": client_nonce, "mac": mac, "client_id": client_id},
            deadline=deadline,
        )
        reply = link.recv(deadline)
    except (AuthenticationError, TransferTimeout, PeerClosedError):
        link.close()
        raise
    except TransferError as exc:
        link.close()
        raise AuthenticationError(
            f"peer {link.peer} did not complete the handshake: {exc}"
        ) from exc
    if reply.kind == Kind.ERROR:
        link.close()
        raise AuthenticationError(
            f"peer {link.peer} refused the connection: {reply.meta.get('message', 'authentication failed')}"
        )
    expected = _mac(secret, b"hm-server", client_nonce, server_nonce)
    proof = reply.meta.get("mac")
    if (
        reply.kind != Kind.AUTH_OK
        or not isinstance(proof, bytes)
        or not hmac.compare_digest(proof, expected)
    ):
        link.close()
        raise AuthenticationError(f"peer {link.peer} could not prove it knows the shared secret")
    namespace = reply.meta.get("shm")
    return ServerHello(namespace if isinstance(namespace, str) else "")
