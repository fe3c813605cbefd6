"""CORS and TLS at the gateway (vLLM's --allowed-origins ... and --ssl-* flags): browser
preflights answered before the API-key check, no CORS headers unless asked, HTTPS from a
real uvicorn server, and clear errors for bad flags."""

from __future__ import annotations

import argparse
import json
import shutil
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from halfmoon.core.errors import HalfmoonError
from halfmoon.serve.gateway.exposure import CorsPolicy, TlsOptions, add_exposure_options
from halfmoon.serve.gateway.http_limits import ConnectionLimits, server_config
from halfmoon.serve.runtime import free_port

APP_ORIGIN = "https://app.example"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_exposure_options(parser)
    return parser.parse_args(list(argv))


def preflight(client: TestClient, origin: str, path: str = "/v1/completions"):
    return client.options(path, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    })  # fmt: skip


def test_cors_answers_named_origins_before_the_key_check(gateways) -> None:
    policy = CorsPolicy.from_args(parse("--allowed-origins", json.dumps([APP_ORIGIN])))
    app = gateways.app(object(), "m", cors=policy, api_keys=("sekret",))
    with TestClient(app) as client:
        ok = preflight(client, APP_ORIGIN)  # (a browser sends no key with a preflight)
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == APP_ORIGIN
        assert "POST" in ok.headers["access-control-allow-methods"]
        assert "access-control-allow-credentials" not in ok.headers
        other = preflight(client, "https://evil.example")
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        # A refusal a page can read: the 401 carries the CORS header too.
        refused = client.get("/v1/models", headers={"Origin": APP_ORIGIN})
        assert refused.status_code == 401
        assert refused.headers["access-control-allow-origin"] == APP_ORIGIN
        served = client.get("/v1/models", headers={"Origin": APP_ORIGIN,
                                                   "Authorization": "Bearer sekret"})  # fmt: skip
        assert served.status_code == 200
        assert served.headers["access-control-allow-origin"] == APP_ORIGIN


def test_no_cors_headers_unless_origins_are_named(gateways) -> None:
    assert CorsPolicy.from_args(parse()) is None
    with TestClient(gateways.app(object(), "m")) as client:
        got = client.get("/v1/models", headers={"Origin": APP_ORIGIN})
        assert got.status_code == 200 and "access-control-allow-origin" not in got.headers
        assert preflight(client, APP_ORIGIN).status_code == 405  # no CORS: no OPTIONS route


def test_any_origin_methods_and_credentials(gateways) -> None:
    policy = CorsPolicy.from_args(parse(
        "--allowed-origins", '["*"]', "--allowed-methods", "GET,POST",
        "--allowed-headers", "authorization", "--allow-credentials",
    ))  # fmt: skip
    assert policy == CorsPolicy(("*",), ("GET", "POST"), ("authorization",), True)
    with TestClient(gateways.app(object(), "m", cors=policy)) as client:
        got = client.options("/v1/completions", headers={
            "Origin": "https://any.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "x-custom",
        })  # fmt: skip
        assert got.status_code == 400  # a header not allowed
        got = client.options("/v1/completions", headers={
            "Origin": "https://any.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization",
        })  # fmt: skip
        # With credentials, the origin itself comes back (a browser refuses "*" then).
        assert got.status_code == 200
        assert got.headers["access-control-allow-origin"] == "https://any.example"
        assert got.headers["access-control-allow-credentials"] == "true"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--allowed-origins", "[not json"], "not a JSON list"),
        (["--allowed-origins", '[""]'], "non-empty strings"),
        (["--allowed-origins", '["a", 3]'], "non-empty strings"),
    ],
)
def test_bad_cors_flags_are_named(argv: list[str], message: str) -> None:
    with pytest.raises(HalfmoonError, match=message):
        CorsPolicy.from_args(parse(*argv))


def self_signed(directory: Path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key (``openssl``), as PEM files."""
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return str(key), str(cert)


needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl CLI")


@needs_openssl
def test_bad_tls_flags_are_named(tmp_path: Path) -> None:
    key, cert = self_signed(tmp_path)
    locked = str(tmp_path / "locked.pem")  # the key under a passphrase: no prompt, an error
    subprocess.run(["openssl", "pkey", "-in", key, "-aes256", "-passout", "pass:pw", "-out", locked],
                   check=True, capture_output=True)  # fmt: skip
    assert TlsOptions.from_args(parse()) is None
    cases = [
        (["--ssl-keyfile", key], "both --ssl-keyfile and --ssl-certfile"),
        (["--ssl-ca-certs", cert], "need --ssl-keyfile"),
        (["--ssl-keyfile", key, "--ssl-certfile", str(tmp_path / "no.pem")], "no such file"),
        (["--ssl-keyfile", cert, "--ssl-certfile", cert], "cannot load"),
        (["--ssl-keyfile", locked, "--ssl-certfile", cert], "cannot load"),
        (["--ssl-keyfile", key, "--ssl-certfile", cert, "--ssl-cert-reqs", "2"], "CA bundle"),
        (["--ssl-keyfile", key, "--ssl-certfile", cert, "--ssl-cert-reqs", "5"], "use 0"),
    ]
    for argv, message in cases:
        with pytest.raises(HalfmoonError, match=message):
            TlsOptions.from_args(parse(*argv))


@needs_openssl
def test_the_gateway_serves_https(gateways, tmp_path: Path) -> None:
    """A real uvicorn server with the certificate: HTTPS answers, plain HTTP does not."""
    import uvicorn

    key, cert = self_signed(tmp_path)
    tls = TlsOptions.from_args(parse("--ssl-keyfile", key, "--ssl-certfile", cert))
    port = free_port()
    server = uvicorn.Server(server_config(gateways.app(object(), "m"), "127.0.0.1", port,
                                          ConnectionLimits(), tls))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        trusted = ssl.create_default_context(cafile=cert)
        url = f"https://127.0.0.1:{port}/v1/models"
        with urllib.request.urlopen(url, context=trusted, timeout=10) as answer:
            assert json.loads(answer.read())["data"][0]["id"] == "m"
        with pytest.raises(urllib.error.URLError):  # a client that does not trust it
            urllib.request.urlopen(url, context=ssl.create_default_context(), timeout=10)
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10)
    finally:
        server.should_exit = True
        thread.join(10)
