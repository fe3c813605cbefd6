"""How the gateway faces clients beyond its own machine: CORS for browser pages and TLS.

vLLM's ``--allowed-origins``, ``--allowed-methods``, ``--allowed-headers``,
``--allow-credentials`` and ``--ssl-keyfile``, ``--ssl-certfile``, ``--ssl-ca-certs``,
``--ssl-cert-reqs``, with one difference: vLLM answers every origin by default, while
halfmoon sends no CORS headers until ``--allowed-origins`` names some (a page on any
site a user visits could otherwise read a local server's answers). :class:`CorsPolicy`
installs Starlette's CORS middleware outermost, so that preflight requests are answered
before the API-key check (browsers send them without the key) and refusals carry the
headers a page needs to read them. :class:`TlsOptions` checks the files at start and
gives uvicorn its ``ssl_*`` settings.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from halfmoon.core.errors import HalfmoonError


def app_path(scope: dict[str, Any]) -> str:
    """A request's path within the app: without the prefix a proxy serves the app under
    (``--root-path``; the server puts it before every path), so that what needs an API key
    is judged by the same paths with a root path as without."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root) :] or "/"
    return path


ALL = ("*",)


def _names(value: str | Sequence[str] | None, flag: str) -> tuple[str, ...]:
    """A flag's list: vLLM's JSON form (``'["https://a.example", "*"]'``), or
    comma-separated names, or a list already."""
    if value is None:
        return ()
    if not isinstance(value, str):
        items = list(value)
    elif value.strip().startswith("["):
        try:
            items = json.loads(value)
        except ValueError:
            raise HalfmoonError(f"{flag} {value!r}: not a JSON list of strings") from None
    else:
        items = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(items, list) or not all(isinstance(v, str) and v for v in items):
        raise HalfmoonError(f"{flag} {value!r}: expected a list of non-empty strings")
    return tuple(items)


@dataclass(frozen=True)
class CorsPolicy:
    """Which browser origins may call the API, with which methods and request headers,
    and whether their credentials (cookies, ``Authorization``) go along."""

    origins: tuple[str, ...]
    methods: tuple[str, ...] = ALL
    headers: tuple[str, ...] = ALL
    credentials: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> CorsPolicy | None:
        """The policy of the parsed flags, or None without ``--allowed-origins``."""
        origins = _names(getattr(args, "allowed_origins", None), "--allowed-origins")
        if not origins:
            return None
        return cls(
            origins,
            _names(getattr(args, "allowed_methods", None), "--allowed-methods") or ALL,
            _names(getattr(args, "allowed_headers", None), "--allowed-headers") or ALL,
            bool(getattr(args, "allow_credentials", False)),
        )

    def install(self, app: Any) -> None:
        """Add the CORS middleware to ``app``, outermost (call after every other one)."""
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware, allow_origins=list(self.origins), allow_methods=list(self.methods),
            allow_headers=list(self.headers), allow_credentials=self.credentials,
        )  # fmt: skip


@dataclass(frozen=True)
class TlsOptions:
    """The gateway's certificate and key (PEM files), and optionally the CA bundle that
    client certificates must chain to with ``cert_reqs`` (``ssl.CERT_NONE`` 0,
    ``CERT_OPTIONAL`` 1, ``CERT_REQUIRED`` 2: mutual TLS)."""

    keyfile: str
    certfile: str
    ca_certs: str | None = None
    cert_reqs: int = int(ssl.CERT_NONE)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TlsOptions | None:
        """The options of the parsed flags, checked (HalfmoonError naming the problem), or
        None without ``--ssl-keyfile`` / ``--ssl-certfile``."""
        key, cert = getattr(args, "ssl_keyfile", None), getattr(args, "ssl_certfile", None)
        ca, reqs = getattr(args, "ssl_ca_certs", None), getattr(args, "ssl_cert_reqs", 0)
        if not key and not cert:
            if ca or reqs:
                raise HalfmoonError("--ssl-ca-certs / --ssl-cert-reqs need --ssl-keyfile "
                                    "and --ssl-certfile")  # fmt: skip
            return None
        if not key or not cert:
            raise HalfmoonError("TLS needs both --ssl-keyfile and --ssl-certfile")
        if reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
            raise HalfmoonError(f"--ssl-cert-reqs {reqs}: use 0 (none), 1 (optional) or "
                                "2 (required)")  # fmt: skip
        if reqs and not ca:
            raise HalfmoonError("--ssl-cert-reqs 1 or 2 checks client certificates against "
                                "--ssl-ca-certs: name the CA bundle")  # fmt: skip
        options = cls(key, cert, ca, int(reqs))
        options.check()
        return options

    def check(self) -> None:
        """HalfmoonError unless the files load as a certificate and key (and CA bundle)."""
        for flag, path in (("--ssl-keyfile", self.keyfile), ("--ssl-certfile", self.certfile),
                           ("--ssl-ca-certs", self.ca_certs)):  # fmt: skip
            if path is not None and not os.path.isfile(path):
                raise HalfmoonError(f"{flag} {path}: no such file")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            # (no password: an encrypted key fails here rather than prompting on a terminal)
            context.load_cert_chain(self.certfile, self.keyfile, password=lambda: b"")
            if self.ca_certs:
                context.load_verify_locations(self.ca_certs)
        except (ssl.SSLError, OSError) as exc:
            raise HalfmoonError(
                f"TLS: cannot load --ssl-certfile {self.certfile} with --ssl-keyfile "
                f"{self.keyfile}{' and --ssl-ca-certs ' + self.ca_certs if self.ca_certs else ''}"
                f": {exc}"
            ) from None

    def uvicorn_settings(self) -> dict[str, Any]:
        """``uvicorn.Config``'s keyword arguments for these options."""
        return {"ssl_keyfile": self.keyfile, "ssl_certfile": self.certfile,
                "ssl_ca_certs": self.ca_certs, "ssl_cert_reqs": self.cert_reqs}  # fmt: skip


def add_exposure_options(parser: argparse.ArgumentParser) -> None:
    """The CORS and TLS flags (vLLM's names)."""
    parser.add_argument(
        "--allowed-origins", default=None, metavar="ORIGINS",
        help="browser origins allowed to call the API (CORS): a JSON list as vLLM takes it "
        "('[\"https://app.example\"]', '[\"*\"]' for any) or comma-separated; default none "
        "(vLLM's default is any)",
    )  # fmt: skip
    parser.add_argument("--allowed-methods", default=None, metavar="METHODS",
                        help="with --allowed-origins: the methods allowed (default any)")  # fmt: skip
    parser.add_argument("--allowed-headers", default=None, metavar="HEADERS",
                        help="with --allowed-origins: the request headers allowed (default any)")  # fmt: skip
    parser.add_argument("--allow-credentials", action="store_true",
                        help="with --allowed-origins: let browsers send credentials")  # fmt: skip
    parser.add_argument("--ssl-keyfile", default=None, metavar="PEM",
                        help="serve HTTPS with this private key (with --ssl-certfile)")  # fmt: skip
    parser.add_argument("--ssl-certfile", default=None, metavar="PEM",
                        help="serve HTTPS with this certificate (chain)")  # fmt: skip
    parser.add_argument("--ssl-ca-certs", default=None, metavar="PEM",
                        help="CA bundle that client certificates must chain to")  # fmt: skip
    parser.add_argument(
        "--ssl-cert-reqs", type=int, default=0, metavar="N",
        help="client certificates: 0 not asked (default), 1 optional, 2 required (mutual TLS; "
        "with --ssl-ca-certs)",
    )  # fmt: skip
