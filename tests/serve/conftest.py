import os
import subprocess
import sys
import time

import pytest

from halfmoon.serve.runtime import SECRET_ENV, free_port

SECRET = "test-secret"


@pytest.fixture
def spawn():
    """Start real halfmoon processes; kill them all at the end, even on failure."""
    procs: list[subprocess.Popen] = []

    def start(*argv: str, secret: str = SECRET) -> subprocess.Popen:
        env = {**os.environ, SECRET_ENV: secret}
        proc = subprocess.Popen(
            [sys.executable, "-m", "halfmoon.cli", *argv],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + 10
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def port():
    return free_port()


class GatewayFactory:
    """Gateway apps over test backends, with the preset byte-level tokenizer (no files)
    and, unless given, a 256-token context."""

    def __init__(self) -> None:
        from halfmoon.engine.tokenizer import (
            Tokenizer,
            build_preset_tokenizer,
            preset_tokenizer_config,
        )

        self.tokenizer = Tokenizer(build_preset_tokenizer(512), preset_tokenizer_config(256))

    def app(self, backend, model: str = "echo", **config):
        """``create_app(backend, ...)`` serving ``model`` with ``GatewayConfig(**config)``."""
        from halfmoon.serve.gateway.app import GatewayConfig, create_app

        config.setdefault("max_model_len", 256)
        return create_app(backend, self.tokenizer, GatewayConfig(model, **config))


@pytest.fixture(scope="session")
def gateways() -> GatewayFactory:
    """Builds in-process gateway apps (see :class:`GatewayFactory`)."""
    return GatewayFactory()
