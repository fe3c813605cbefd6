"""The live cluster page in a real headless browser (Debian Chromium under Selenium),
over ``halfmoon serve`` (1 prefill + 1 decode) behind an API key, after some traffic.

Without chromium, chromium-driver (``make browser``) or selenium this skips, unless
``HALFMOON_REQUIRE_BROWSER=1`` (``make test``), which makes it fail instead."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from benchmarks.dashboard_screenshot import (
    CHROMEDRIVER,
    CHROMIUM,
    SERVE_ARGS,
    chromium,
    send_traffic,
)

pytestmark = pytest.mark.slow
KEY = "sk-dashboard-e2e"


def _require_browser() -> None:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.path.exists(p)]
    if importlib.util.find_spec("selenium") is None:
        missing.append("the selenium package (pip install -e '.[dev]')")
    if missing:
        reason = f"no headless browser: {', '.join(missing)} missing (`make browser`)"
        if os.environ.get("HALFMOON_REQUIRE_BROWSER") == "1":
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.fixture
def driver(tmp_path: Path):
    _require_browser()
    profile = tmp_path / "chromium-profile"
    profile.mkdir()
    browser = chromium(profile)
    yield browser
    browser.quit()


#: What the page shows, read in one script run (the page redraws every 2 s: elements
#: found in one call and read in the next may be gone).
SNAPSHOT_JS = """
const q = (sel, root = document) => [...root.querySelectorAll(sel)];
const id = (name) => `[data-testid="${name}"]`;
return {
  keyForm: !document.querySelector(id("key-form")).hidden,
  workers: q(id("worker-tile")).map((t) => ({
    name: t.dataset.worker, role: t.dataset.role, state: t.dataset.state,
    roleText: t.querySelector(id("worker-role")).textContent, text: t.innerText})),
  conductor: q(id("conductor-tile")).map((t) => t.dataset.state)[0] || "",
  points: Object.fromEntries(q(".chart").map((c) => [c.dataset.testid, +c.dataset.points])),
  decisions: q(id("decision-row")).map((r) => ({
    id: r.dataset.request, accepted: r.dataset.accepted === "true",
    why: r.querySelector(id("decision-why")).textContent,
    explain: r.nextElementSibling.querySelector(id("decision-explain")).textContent,
    open: !r.nextElementSibling.hidden})),
};
"""


def _page(driver) -> dict:
    return driver.execute_script(SNAPSHOT_JS)


def test_page_shows_workers_charts_and_explained_decisions(cluster_factory, driver, tmp_path):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    cluster = cluster_factory(*SERVE_ARGS, "--api-key", KEY)
    statuses = send_traffic(cluster.base_url, num_requests=6, num_long=1, api_key=KEY)
    assert statuses == [200] * 6 + [429], statuses  # the long prompt is refused early
    wait = WebDriverWait(driver, 30, poll_frequency=0.2,
                         ignored_exceptions=[StaleElementReferenceException])  # fmt: skip

    driver.get(cluster.base_url + "/")
    assert driver.current_url == cluster.base_url + "/dashboard"
    wait.until(lambda d: _page(d)["keyForm"])  # the state answered 401: the page asks
    driver.find_element(By.ID, "key").send_keys(KEY)
    driver.find_element(By.CSS_SELECTOR, '[data-testid="key-form"] button').click()

    page = wait.until(lambda d: (p := _page(d))["workers"] and p["decisions"]
                      and p["points"].get("chart-ttft", 0) > 0 and p)  # fmt: skip
    assert not page["keyForm"]
    assert sorted((w["name"], w["role"], w["roleText"].lower(), w["state"])
                  for w in page["workers"]) == [
        ("decode-0", "decode", "decode", "healthy"), ("prefill-0", "prefill", "prefill", "healthy"),
    ]  # fmt: skip
    assert all("KV pool" in w["text"] for w in page["workers"])
    assert page["conductor"] == "ok"
    gateway = driver.find_element(By.CSS_SELECTOR, '[data-testid="gateway-tile"]').text
    assert "weights" in gateway and "as started" in gateway  # (no update while serving)
    assert page["points"]["chart-rate"] > 0 and page["points"]["chart-hit"] > 0  # shared prefix

    decisions = page["decisions"]
    assert len(decisions) == 7
    newest = decisions[0]
    assert not newest["accepted"] and "exceeds" in newest["why"]
    assert [d["open"] for d in decisions] == [True] + [False] * 6  # the newest opens at once
    assert "REJECTED" in newest["explain"]
    request_id = next(d["id"] for d in decisions if d["accepted"])
    row = f'tr[data-request="{request_id}"]'
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, row).click() or True)
    opened = wait.until(lambda d: [x for x in _page(d)["decisions"] if x["id"] == request_id
                                   and x["open"]])  # fmt: skip
    explain = opened[0]["explain"]
    assert explain.startswith(f"request {request_id} policy=")
    assert "*prefill-0" in explain and "*decode-0" in explain

    loaded = driver.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name)"
    )
    assert loaded and all(url.startswith(cluster.base_url) for url in loaded), loaded
    shot = tmp_path / "dashboard.png"
    assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
