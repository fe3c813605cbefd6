"""Per-tenant prefix-cache isolation at the gateway: API keys and cache salts.

``usage.prompt_tokens_details.cached_tokens`` (and the time to first token) tell a client
whether someone already sent its prompt's prefix. A request's ``cache_salt`` (vLLM's
field) roots the hash chain of its blocks (:func:`halfmoon.core.hashing.chain_root`), so
requests with different salts never share a cached block anywhere in the cluster.

With ``--cache-salt-from-api-key`` the gateway salts every request with its API key
(:func:`key_salt`; one tenant per key, ``--api-key`` given once per tenant), joined with
the request's own ``cache_salt`` if any: tenants never see each other's cache, while
requests under one key still share theirs.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Sequence

#: The environment variable holding the API key(s), comma-separated.
API_KEY_ENV = "HALFMOON_API_KEY"
#: Longest ``cache_salt`` a request may send (characters).
MAX_CACHE_SALT_CHARS = 256
#: HMAC key of :func:`key_salt` (a fixed label: the same key salts alike on every gateway).
_KEY_SALT_LABEL = b"halfmoon/cache-salt-from-api-key/v1"


def api_keys(given: str | Sequence[str] | None, env: str | None = None) -> tuple[str, ...]:
    """The accepted API keys: those ``given`` (``--api-key``, repeatable), else ``env``
    (``$HALFMOON_API_KEY``) split at commas; blanks dropped, each key once, order kept."""
    if isinstance(given, str):
        given = [given]
    items: Iterable[str] = given if given else (env or "").split(",")
    return tuple(dict.fromkeys(k.strip() for k in items if k.strip()))


def matching_key(authorization: str | None, keys: Sequence[str]) -> str | None:
    """The key of ``keys`` that an ``Authorization: Bearer KEY`` header carries, or None."""
    if authorization is None:
        return None
    got = authorization.encode("utf-8", "surrogatepass")
    found = None
    for key in keys:  # every key compared, in constant time each
        if hmac.compare_digest(got, f"Bearer {key}".encode()):
            found = key
    return found


def key_salt(api_key: str) -> str:
    """The cache salt of one API key: HMAC-SHA256 of the key under a fixed label, in hex
    (the key itself never leaves the gateway)."""
    return hmac.new(_KEY_SALT_LABEL, api_key.encode("utf-8"), hashlib.sha256).hexdigest()


def effective_salt(cache_salt: str | None, api_key: str | None) -> str | None:
    """The salt a request's blocks hash under: its own ``cache_salt`` alone, or, when
    salting by API key, the key's salt joined with it (the key's salt has a fixed length,
    so no request salt can imitate another tenant's)."""
    if api_key is None:
        return cache_salt
    tenant = key_salt(api_key)
    return tenant if cache_salt is None else f"{tenant}:{cache_salt}"
