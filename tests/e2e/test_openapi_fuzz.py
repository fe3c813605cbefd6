"""An OpenAPI fuzzer (schemathesis) against a live tiny cluster: whatever it sends within
and around the published schema, the server answers no 5xx, only documented statuses
and content types, and bodies that match the schema.

The schema pins ``model`` to the served model and caps ``max_tokens`` at
``--max-tokens-limit``, so the fuzzer's budget goes to real generations, each short.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

CHECKS = (
    "not_a_server_error,status_code_conformance,content_type_conformance,"
    "response_schema_conformance"
)


@pytest.fixture(scope="module")
def cluster(cluster_factory):
    # (a generous start-up: other tests may share the CPUs while the kernels build)
    return cluster_factory(
        "--kv-cache-mb", "64", "--max-tokens-limit", "8", "--startup-timeout", "280"
    )


def test_schemathesis_finds_no_server_error_or_schema_violation(cluster, tmp_path):
    argv = [
        sys.executable, "-m", "schemathesis.cli", "run", f"{cluster.base_url}/openapi.json",
        "--checks", CHECKS, "--max-examples", "15", "--seed", "20240611", "--workers", "1",
        "--phases", "examples,coverage,fuzzing", "--no-shrink", "--request-timeout", "30",
        "--suppress-health-check", "all", "--max-failures", "5",
    ]  # fmt: skip
    # (run in tmp_path: schemathesis keeps a .schemathesis/ cache in its working directory)
    run = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    report = run.stdout[-6000:] + run.stderr[-2000:]
    assert run.returncode == 0, report
    assert "passed" in run.stdout and "failed" not in run.stdout, report


def test_docs_page_is_served_offline(cluster):
    """/docs's page and the assets it names come from the server itself."""
    import re

    import httpx

    page = httpx.get(f"{cluster.base_url}/docs", timeout=10).text
    assert not re.search(r"https?://", page)
    for asset in re.findall(r'(?:src|href)="(/[^"]+)"', page):
        assert httpx.get(f"{cluster.base_url}{asset}", timeout=10).status_code == 200, asset


def test_openai_client_sees_the_limits_the_server_enforces(cluster):
    """``models.retrieve`` works; ``max_model_len`` is one worker's KV pool (64 MiB of the
    tiny model: 16,384 tokens, below its 32,768-token context), as the log says."""
    import openai

    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="none", max_retries=0)
    card = client.models.retrieve("tiny")
    assert card.id == "tiny"
    assert (card.max_model_len, card.max_tokens_limit) == (16384, 8)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    with pytest.raises(openai.BadRequestError, match="limit of 8"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=9)
    assert "context limit 16384 tokens" in cluster.log_path.read_text()
