"""What a started ``halfmoon serve`` printed: each start-up phase in order, the ready line
with the URL it listens on, and then one access-log line per request."""

from __future__ import annotations

import re

import openai
import pytest

from .conftest import wait_for_log

pytestmark = pytest.mark.slow


def test_the_log_tells_each_phase_then_the_url_then_each_request(cluster_factory):
    cluster = cluster_factory("--kv-cache-mb", "64")
    url = re.escape(cluster.base_url)
    ready = wait_for_log(cluster, rf"serving 'tiny' at {url} \(OpenAI API {url}/v1\b.*\)$")
    log = cluster.log_path.read_text()
    phases = [
        "serve INFO model tiny",
        "serve INFO model directory ",
        "serve INFO starting the Conductor on tcp://127.0.0.1:",
        "serve INFO started conductor (pid ",
        "waiting for 2 workers to register",
        "serve INFO cluster ready in ",
    ]
    at = [log.index(phase) for phase in phases]
    assert at == sorted(at) and at[-1] < ready.start()
    assert re.search(r"started conductor \(pid \d+\), prefill-0 \(pid \d+\), decode-0 \(pid", log)

    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="none", max_retries=0)
    out = client.completions.create(model="tiny", prompt="Hello there", max_tokens=4,
                                    temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    line = wait_for_log(
        cluster,
        r'127\.0\.0\.1:\d+ "POST /v1/completions" 200 prompt_tokens=(\d+) '
        r"completion_tokens=4 ttft=([0-9.]+)s total=([0-9.]+)s id=(\S+)$",
    )
    assert int(line.group(1)) == out.usage.prompt_tokens
    assert line.group(4) == out.id  # the id the answer went out under
    assert 0 < float(line.group(2)) <= float(line.group(3))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=-1)
    wait_for_log(cluster, r'"POST /v1/completions" 400 prompt_tokens=- completion_tokens=- ttft=-')
