"""Errors of the transfer engine; all are :class:`HalfmoonError` with one-line messages."""

from __future__ import annotations

from halfmoon.core.errors import HalfmoonError


class TransferError(HalfmoonError):
    """A transfer failed; the message says which peer and why."""


class AuthenticationError(TransferError):
    """The peer refused our shared secret, or could not prove it knows it."""


class ProtocolError(TransferError):
    """A malformed frame: bad magic, version, length or checksum."""


class ChecksumError(ProtocolError):
    """A payload arrived with bytes that do not match its xxh3 checksum."""


class PeerClosedError(TransferError):
    """The peer closed the connection (or died) in the middle of an exchange."""


class TransferTimeout(TransferError):
    """No progress within the timeout."""


class TransferCancelled(TransferError):
    """The transfer was cancelled by either side."""


class RemoteError(TransferError):
    """The peer received the request but reported an error (bad region, full store, ...)."""
