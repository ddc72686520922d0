"""Screenshot of the `ddspec serve` chat page (README): the default model answers one prompt in
headless Chromium (Debian's, driven by selenium); the shown tree is the step that accepted most.

    .venv/bin/python scripts/page_screenshot.py --out docs/server-page.png
"""

from __future__ import annotations

import argparse

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from ddspec.config import TreeConfig
from ddspec.models.loading import load_target
from ddspec.server.build import LiveServer, make_service

ARGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage", "--window-size=1400,860")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/server-page.png")
    p.add_argument("--prompt", default="Explain in three sentences why the sky is blue.")
    p.add_argument("--method", default="eagle2", help="the server's default method (the page's choice)")
    p.add_argument("--max-tokens", default="96")
    args = p.parse_args()
    target = load_target("default")
    tree = TreeConfig(top_k=4, depth=5, total_tokens=20)  # a tree small enough to read in a screenshot
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ARGS:
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path="/usr/bin/chromedriver"), options=options)
    try:
        with LiveServer(make_service(target, method=args.method, tree=tree)) as url:
            driver.get(url + "/")
            wait = WebDriverWait(driver, 300)
            wait.until(lambda d: d.execute_script("return document.body.dataset.ready") == "1")
            driver.find_element(By.ID, "max-tokens").clear()
            driver.find_element(By.ID, "max-tokens").send_keys(args.max_tokens)
            driver.find_element(By.ID, "prompt").send_keys(args.prompt)
            driver.find_element(By.ID, "send").click()
            wait.until(lambda d: d.execute_script("return document.body.dataset.done") == "1")
            driver.execute_script("""
                let best = 0;
                state.trees.forEach((e, i) => { if (e.step.accepted > state.trees[best].step.accepted) best = i; });
                document.getElementById('follow').checked = false;
                document.getElementById('step-slider').value = best;
                drawTree(state.trees[best]);""")
            driver.save_screenshot(args.out)
    finally:
        driver.quit()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
