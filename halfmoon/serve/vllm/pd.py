"""The contract between halfmoon and its KV connector inside vLLM (#19 item 2), torch-free.

:func:`kv_transfer_config` is what a vLLM server is started with so that vLLM loads
:class:`halfmoon.vllm_kv.connector.HalfmoonConnector`; the ``kv_transfer_params`` helpers
build and read what a request carries under the ``halfmoon`` key of vLLM's
``kv_transfer_params`` (vLLM passes the dict to the connector and returns the connector's
answer in the response). One disaggregated request, as the gateway (vLLM's "proxy") runs it::

    -> P  prompt, max_tokens=1, prefill_params(session, decode=D's transfer endpoint,
          source=a peer's transfer endpoint, cached_tokens=n)
          P may first pull n tokens' blocks from the source's store (remote prefix reuse),
          computes the rest, streams each layer's blocks to D's inbox as it is computed
          and saves the full blocks to its own store
    <- P  kv_transfer_params = {"do_remote_prefill": True, "halfmoon": {session, num_tokens, ...}}
    -> D  the whole request with those params: D loads the prompt's KV from its inbox
          (recomputing only the last token) and decodes every output token

Nothing here imports vLLM or torch; ``serve`` builds these dicts, the connector reads them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

#: The connector's class and module (what vLLM imports).
CONNECTOR_CLASS = "HalfmoonConnector"
CONNECTOR_MODULE = "halfmoon.vllm_kv.connector"
#: The key of halfmoon's own entries inside vLLM's ``kv_transfer_params``.
KEY = "halfmoon"


@dataclass(frozen=True)
class ConnectorSettings:
    """The connector's ``kv_connector_extra_config``: where its transfer engine listens
    (``host:port``, fixed so halfmoon can tell peers before vLLM is up), the transport to
    peers, the sizes of its inbox (KV streams arriving for decode) and block store (full
    prompt blocks saved by prefills, which peers pull), halfmoon's hash block size, and an
    optional JSON-lines file of per-request transfer timings."""

    host: str
    port: int
    transport: str = "auto"
    inbox_mb: float = 256.0
    store_mb: float = 256.0
    hash_block_size: int = 16
    stats_path: str = ""
    timeout_s: float = 30.0
    checksum: bool = True

    @property
    def endpoint(self) -> str:
        """The connector's transfer endpoint, ``host:port``."""
        return f"{self.host}:{self.port}"

    def to_extra(self) -> dict[str, Any]:
        """As ``kv_connector_extra_config``."""
        return {
            "host": self.host, "port": self.port, "transport": self.transport,
            "inbox_mb": self.inbox_mb, "store_mb": self.store_mb,
            "hash_block_size": self.hash_block_size, "stats_path": self.stats_path,
            "timeout_s": self.timeout_s, "checksum": self.checksum,
        }  # fmt: skip

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorSettings:
        """From ``kv_connector_extra_config``; ValueError naming a missing or bad entry."""
        try:
            settings = cls(
                host=str(extra.get("host", "127.0.0.1")), port=int(extra["port"]),
                transport=str(extra.get("transport", "auto")),
                inbox_mb=float(extra.get("inbox_mb", 256.0)),
                store_mb=float(extra.get("store_mb", 256.0)),
                hash_block_size=int(extra.get("hash_block_size", 16)),
                stats_path=str(extra.get("stats_path", "")),
                timeout_s=float(extra.get("timeout_s", 30.0)),
                checksum=bool(extra.get("checksum", True)),
            )  # fmt: skip
        except KeyError as exc:
            raise ValueError(
                f"halfmoon's connector needs kv_connector_extra_config[{exc}]"
            ) from None
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"halfmoon's connector: bad kv_connector_extra_config ({exc})"
            ) from None
        if not 0 < settings.port < 65536:
            raise ValueError(f"halfmoon's connector: port {settings.port} out of range")
        if settings.hash_block_size <= 0 or settings.inbox_mb <= 0 or settings.store_mb <= 0:
            raise ValueError("halfmoon's connector: sizes must be positive")
        return settings


def kv_transfer_config(settings: ConnectorSettings) -> str:
    """The ``--kv-transfer-config`` JSON that loads halfmoon's connector. Every instance is
    ``kv_both`` (the Conductor decides per request who prefills and who decodes), and a
    block that fails to load is recomputed, not fatal."""
    return json.dumps({
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": settings.to_extra(),
    })  # fmt: skip


def prefill_params(
    session: str, decode: str, source: str | None = None, cached_tokens: int = 0
) -> dict[str, Any]:
    """``kv_transfer_params`` of the prefill request: stream the KV to ``decode`` (a
    connector's ``host:port``) as session ``session``; first pull up to ``cached_tokens``
    of the prompt's blocks from ``source``'s store, if given."""
    if not session or not decode:
        raise ValueError("a prefill needs a session id and a decode endpoint")
    entry: dict[str, Any] = {"session": session, "decode": decode}
    if source and cached_tokens > 0:
        entry.update(source=source, cached_tokens=int(cached_tokens))
    return {"do_remote_decode": True, "do_remote_prefill": False, KEY: entry}


def prefix_params(source: str, cached_tokens: int) -> dict[str, Any]:
    """``kv_transfer_params`` of a request that only pulls a cached prefix from ``source``."""
    return {KEY: {"source": source, "cached_tokens": int(cached_tokens)}}


@dataclass(frozen=True)
class PrefillResult:
    """What a prefill's response says for its decode request (``kv_transfer_params``)."""

    session: str
    num_tokens: int
    streamed: bool
    loaded_tokens: int = 0

    @classmethod
    def from_params(cls, params: Any) -> PrefillResult:
        """From the prefill response's ``kv_transfer_params``; ValueError when absent."""
        entry = params.get(KEY) if isinstance(params, dict) else None
        if not isinstance(entry, dict) or "session" not in entry:
            raise ValueError(
                f"the prefill answered without halfmoon's kv_transfer_params ({params!r}): "
                "is the vLLM server running halfmoon's connector?"
            )
        return cls(
            str(entry["session"]), int(entry.get("num_tokens", 0)),
            bool(entry.get("streamed", False)), int(entry.get("loaded_tokens", 0)),
        )  # fmt: skip

    def decode_params(self) -> dict[str, Any]:
        """``kv_transfer_params`` of the decode request."""
        entry = {"session": self.session, "num_tokens": self.num_tokens}
        return {"do_remote_prefill": self.streamed, "do_remote_decode": False, KEY: entry}
