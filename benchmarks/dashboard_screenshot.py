"""Screenshot the live cluster page of a tiny cluster with some traffic (docs/img/dashboard.png).

    .venv/bin/python -m benchmarks.dashboard_screenshot [--out docs/img/dashboard.png]

Starts ``halfmoon serve`` of the tiny random-weight model (1 prefill + 1 decode worker)
with a tight TTFT SLO, sends requests that share a prefix (prefix-cache hits) and a few
long ones (refused early), then opens ``/dashboard`` in headless Chromium (the Debian
packages ``chromium`` and ``chromium-driver``: ``make browser``) and saves the page.
:func:`chromium` and :func:`send_traffic` also serve tests/e2e/test_dashboard.py.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
#: Headless, nothing fetched from the network, no sandbox (containers run as root).
CHROMIUM_FLAGS = (
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
    "--no-first-run", "--disable-background-networking", "--disable-component-update",
    "--disable-sync",
)  # fmt: skip
#: The tiny cluster: its TTFT SLO refuses the long prompts of :func:`send_traffic` (their
#: prefill takes ~7 s by the measured profile on a 2-core VM, 20x the SLO) and admits the
#: short ones (~10-50 ms). The TTFT estimates are the profile's alone: with the prefill
#: calibration on, a host busy with other work (a test suite beside it) teaches the
#: Conductor a slowdown of up to 20x and refuses short prompts too, which is right for
#: serving but not what the page's picture (or its e2e test) is meant to show.
SERVE_ARGS = ("--kv-cache-mb", "64", "--ttft-slo", "0.3", "--early-reject", "snapshot",
              "--prefill-calibration", "off")  # fmt: skip
SHARED_PREFIX = "You are a helpful assistant. Answer briefly and precisely. " * 4


def chromium(profile_dir: Path, width: int = 1400, height: int = 1200) -> Any:
    """A headless Debian Chromium under Selenium, with a fresh profile in ``profile_dir``
    (the driver is named, so Selenium Manager downloads nothing)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile_dir}",
                 f"--window-size={width},{height}"):  # fmt: skip
        options.add_argument(flag)
    service = Service(CHROMEDRIVER, log_output=str(profile_dir.parent / "chromedriver.log"))
    return webdriver.Chrome(service=service, options=options)


def complete(base_url: str, prompt: str, max_tokens: int, api_key: str = "") -> int:
    """POST one completion; returns the HTTP status (429: refused)."""
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}).encode()  # fmt: skip
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(base_url + "/v1/completions", body, headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def send_traffic(
    base_url: str, num_requests: int = 12, num_long: int = 2, api_key: str = "",
    long_words: int = 3000,
) -> list[int]:  # fmt: skip
    """``num_requests`` short completions sharing a prefix (two at a time), then
    ``num_long`` long prompts meant to be refused; returns the statuses."""
    prompts = [f"{SHARED_PREFIX} Question {i}: what is {i} + {i}?" for i in range(num_requests)]
    with ThreadPoolExecutor(2) as pool:
        statuses = list(pool.map(lambda p: complete(base_url, p, 8, api_key), prompts))
    long_prompt = " ".join(f"word{i}" for i in range(long_words))
    statuses += [complete(base_url, f"{k} {long_prompt}", 4, api_key) for k in range(num_long)]
    return statuses


def main() -> None:
    """Start the cluster, send traffic for a while, save the screenshot."""
    from halfmoon.serve.launch.local import LocalCluster

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/img/dashboard.png"))
    parser.add_argument("--rounds", type=int, default=6, help="traffic rounds, ~5 s apart")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        cluster = LocalCluster(("--model", "tiny", *SERVE_ARGS), tmp_path / "cache",
                               "screenshot-secret-0123456789", tmp_path / "serve.log")  # fmt: skip
        with cluster:
            for round_ in range(args.rounds):
                print(f"round {round_}: statuses {send_traffic(cluster.base_url)}", flush=True)
                time.sleep(5)
            profile = tmp_path / "profile"
            profile.mkdir()
            driver = chromium(profile, 1400, 1700)
            try:
                driver.get(cluster.base_url + "/")
                time.sleep(5)  # two refreshes
                args.out.parent.mkdir(parents=True, exist_ok=True)
                driver.save_screenshot(str(args.out))
            finally:
                driver.quit()
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
