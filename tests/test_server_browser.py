"""The chat page in a real browser: Debian's headless Chromium, driven by Selenium and chromedriver.

Skipped (with the reason) where Chromium, chromedriver or selenium is missing; `.ci/run`
installs Chromium. No browser is ever downloaded: the binaries are the system's.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
ARGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage", "--window-size=1400,900")

if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
    pytest.skip("no Chromium here (apt-get install chromium chromium-driver)", allow_module_level=True)
pytest.importorskip("fastapi", reason="ddspec serve needs the 'serve' extra")
webdriver = pytest.importorskip("selenium.webdriver", reason="the page test drives Chromium with selenium")

from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from ddspec.config import StopConfig, TreeConfig  # noqa: E402
from ddspec.engine import Engine  # noqa: E402
from ddspec.models.loading import load_target  # noqa: E402
from ddspec.prompts import chat_prompt_ids  # noqa: E402
from ddspec.server.build import LiveServer, make_service  # noqa: E402

TREE = TreeConfig(top_k=4, depth=4, total_tokens=12)


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ARGS:
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def test_page_streams_an_answer_and_draws_the_tree(browser, tiny_dirs, tmp_path):
    target = load_target(str(tiny_dirs["llama"]), impl="native")
    service = make_service(target, method="eagle2", head="random:1", tree=TREE, max_tokens=40)
    prompt = "Tell me a story."
    reference = load_target(str(tiny_dirs["llama"]), impl="native")
    expected = Engine(reference).generate(chat_prompt_ids(reference.tokenizer, [{"role": "user", "content": prompt}]),
                                          StopConfig(max_new_tokens=40)).text
    with LiveServer(service) as url:
        browser.get(url + "/")
        wait = WebDriverWait(browser, 30)
        wait.until(lambda d: d.execute_script("return document.body.dataset.ready") == "1")
        assert service.config.model_name in browser.find_element(By.ID, "model").text
        browser.find_element(By.ID, "max-tokens").clear()
        browser.find_element(By.ID, "max-tokens").send_keys("40")
        browser.execute_script("""
            window.__updates = 0;
            new MutationObserver(() => window.__updates++).observe(document.getElementById('transcript'),
                {subtree: true, childList: true, characterData: true});""")
        browser.find_element(By.ID, "prompt").send_keys(prompt)
        browser.find_element(By.ID, "send").click()
        wait.until(lambda d: d.execute_script("return document.body.dataset.done") == "1")

        answer = browser.find_element(By.CSS_SELECTOR, ".msg.assistant .body").get_property("textContent")
        assert answer == expected  # greedy: the page shows the engine's own output
        assert browser.execute_script("return window.__updates") > 5  # it arrived piece by piece
        nodes = browser.find_elements(By.CSS_SELECTOR, "#tree g.node")
        roots = browser.find_elements(By.CSS_SELECTOR, "#tree g.node.root")
        assert len(roots) == 1 and len(nodes) >= TREE.total_tokens  # the tree's nodes (+ the bonus token)
        assert browser.find_elements(By.CSS_SELECTOR, "#tree path.edge")
        caption = browser.find_element(By.ID, "tree-caption").text
        assert "nodes" in caption and "depth" in caption
        assert browser.find_element(By.ID, "stat-tau").text not in ("", "–")
        assert float(browser.find_element(By.ID, "stat-rate").text) > 0
        meta = browser.find_element(By.CSS_SELECTOR, ".msg.assistant .meta").text
        assert "tokens/s" in meta and "eagle2" in meta

        shot = tmp_path / "ddspec-page.png"
        browser.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
        out = os.environ.get("DDSPEC_SCREENSHOT_DIR")
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            shutil.copy(shot, Path(out) / shot.name)
