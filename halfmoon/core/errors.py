"""User-facing errors: the CLI prints their message on one line, servers turn them into 4xx."""

from __future__ import annotations


class HalfmoonError(Exception):
    """A problem with the user's input or environment, explained in the message."""


class Unsupported(HalfmoonError):
    """A request the engine serving it cannot do at all (not a failure: another try
    there fails the same way); a server answers it with a 400."""
