"""The status page in a real browser: headless Chromium (Debian's) against a running gateway
with authentication on. The viewer connects with an admin token, live figures appear, and
they change after traffic. A screenshot is saved with the test's output (and, with
$MEMKV_STATUS_SCREENSHOT set, there too: README's picture is made this way).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from memkv.storage.layout import KVLayout

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is a dev dependency")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER),
    reason="no Chromium here (make installs Debian's chromium and chromium-driver; "
    "where apt cannot, this test cannot run)",
)

TOKEN = "status-page-admin-token"
LAYOUT = KVLayout("status-page-test", num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4)
WAIT_S = 30


@pytest.fixture(scope="module")
def secured_gateway(cluster):
    from memkv.api.auth import Authenticator, TokenEntry, hash_token
    from memkv.api.server import GatewayServer

    auth = Authenticator(
        [TokenEntry(hash_token(TOKEN), "ops", frozenset({"write", "admin"}))], open_metrics=False
    )
    with GatewayServer.start(cluster, host="127.0.0.1", port=0, auth=auth) as gw:
        yield gw


@pytest.fixture()
def browser():
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                 "--disable-gpu", "--window-size=1400,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def traffic(url: str, sessions: int, seed: int) -> None:
    from memkv.client import Client

    g = torch.Generator().manual_seed(seed)
    with Client(url, token=TOKEN) as client:
        for i in range(sessions):
            sid = f"page-{seed}-{i}"
            client.create_session(sid, LAYOUT)
            shape = (LAYOUT.num_kv_heads, 8, LAYOUT.head_dim)
            keys = [torch.randn(shape, generator=g).half() for _ in range(LAYOUT.num_layers)]
            values = [torch.randn(shape, generator=g).half() for _ in range(LAYOUT.num_layers)]
            client.append_turn(sid, [seed * 100 + i * 10 + t for t in range(8)], keys, values)
            list(client.read_blocks(sid))


def test_the_status_page_shows_live_figures_that_follow_traffic(
    secured_gateway, browser, tmp_path
):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, WAIT_S, poll_frequency=0.2)

    def text(element_id: str) -> str:
        return browser.find_element(By.ID, element_id).text

    browser.get(secured_gateway.url + "/?interval=0.5")
    # Auth is on: without a token the page says so and shows no figures.
    wait.until(lambda _: text("state") == "token needed")
    assert text("sessions-total") == "–"
    browser.find_element(By.ID, "token").send_keys(TOKEN)
    browser.find_element(By.ID, "connect").click()
    wait.until(lambda _: text("state") == "live" and text("sessions-total").isdigit())
    sessions_before = int(text("sessions-total"))
    requests_before = int(text("requests-total"))

    traffic(secured_gateway.url, sessions=3, seed=7)

    wait.until(lambda _: int(text("sessions-total")) >= sessions_before + 3)
    wait.until(lambda _: int(text("requests-total")) > requests_before + 6)
    # The tiers table lists both devices' tiers, with the new blocks in hot.
    rows = browser.find_elements(By.CSS_SELECTOR, "#tiers tbody tr")
    assert len(rows) == 6  # 2 devices x (hot, warm, cold)
    # Charts drew a point per poll, and the hit ratio is a percentage.
    wait.until(lambda _: int(browser.find_element(By.ID, "chart-latency")
                             .get_attribute("data-points") or 0) >= 2)
    wait.until(lambda _: text("hit-ratio").endswith("%"))
    shot = tmp_path / "status-page.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    if os.environ.get("MEMKV_STATUS_SCREENSHOT"):
        shutil.copy(shot, Path(os.environ["MEMKV_STATUS_SCREENSHOT"]))


def test_the_status_page_shows_each_engine_and_what_was_routed_to_it(secured_gateway, browser):
    import httpx
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from .engines.test_front_door import MODEL, FakeEngine

    wait = WebDriverWait(browser, WAIT_S, poll_frequency=0.2)

    def engine_rows() -> list[list[str]]:
        # In one script: the page replaces the rows at every poll (elements go stale).
        return browser.execute_script(
            "return [...document.querySelectorAll('#engines tbody tr')]"
            ".map(tr => [...tr.cells].map(td => td.textContent))")

    browser.get(secured_gateway.url + "/?interval=0.5")
    browser.find_element(By.ID, "token").send_keys(TOKEN)
    browser.find_element(By.ID, "connect").click()
    wait.until(lambda _: engine_rows() and "no engines registered" in engine_rows()[0][0])
    engine = FakeEngine("page-engine")
    with httpx.Client(base_url=secured_gateway.url, timeout=30,
                      headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        try:
            made = http.post("/v1/engines", json={"url": engine.url, "engine_id": "page-engine",
                                                  "node": "node-p"})
            assert made.status_code == 201, made.text
            for _ in range(3):  # a session's first turn, then two that stick to the engine
                answer = http.post("/v1/chat/completions", headers={"X-Memkv-Session": "pg"},
                                   json={"model": MODEL, "messages": []})
                assert answer.status_code == 200, answer.text
            wait.until(lambda _: engine_rows()[0][0] == "page-engine")
            row = dict(zip(["engine", "model", "node", "state", "requests", "kv", "sticky",
                            "kv-node", "least-loaded", "spill", "failovers", "stream errors"],
                           engine_rows()[0], strict=True))
            assert row["model"] == MODEL and row["node"] == "node-p"
            assert row["state"] == "healthy" and row["kv"] == "25%"
            assert (row["least-loaded"], row["sticky"], row["failovers"]) == ("1", "2", "0")
            # The engine goes down: the page says so at the next check.
            engine.healthy = False
            wait.until(lambda _: engine_rows()[0][3].startswith("down"))
        finally:
            http.delete("/v1/engines/page-engine")
            engine.server.stop()
