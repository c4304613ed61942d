"""The dashboard end to end in headless Chromium (selenium): charts, nodes, queue, quotas."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from tests.cluster.conftest import PYTHON, require, wait_for

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


@pytest.fixture
def browser():
    require(bool(CHROMIUM and DRIVER), "Chromium and chromedriver (Debian chromium, chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service as DriverService

    profile = tempfile.mkdtemp(prefix="luban-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
                 "--window-size=1400,1500"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=DriverService(executable_path=DRIVER), options=options)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def test_dashboard_shows_queue_nodes_quota_and_charts(service, browser, tmp_path):
    from selenium.webdriver.common.by import By

    svc = service("--nodes", "4", "--zones", "2", "--gpus", "8", "--tick", "0.2", "--sample-every", "0.3")
    admin = svc.admin()
    admin.add_group("vision")
    admin.set_quota("group:vision", "HIGH", 1)
    _, alice = svc.user("alice", {"NORMAL": 2}, group="vision")
    _, bob = svc.user("bob", {"LOW": 4})
    sleep = {"command": PYTHON, "args": ["-c", "import time; time.sleep(600)"]}
    running = alice.submit(dict(sleep, name="pretrain", nodes=2))["id"]
    team = alice.submit(dict(sleep, name="eval", nodes=1, group="vision", priority="HIGH"))["id"]
    waiting = bob.submit(dict(sleep, name="sweep", nodes=3, priority="LOW"))["id"]
    wait_for(lambda: alice.job(running)["state"] == "running" and alice.job(team)["state"] == "running", 60,
             what="jobs running")
    wait_for(lambda: len(admin.samples()) >= 5, 60, what="occupancy samples")

    browser.get(f"{svc.url}/?token={svc.admin_token}")
    wait_for(lambda: browser.execute_script("return document.body.dataset.ready") == "1", 30, what="dashboard")
    wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#occupancy polyline.occupancy")) == 1
             and browser.execute_script("return document.querySelector('#occupancy polyline.occupancy')"
                                        ".getAttribute('points').split(' ').length") >= 5, 30, what="chart")
    nodes = {e.get_attribute("data-node"): e.text for e in browser.find_elements(By.CSS_SELECTOR, ".node")}
    assert sorted(nodes) == ["node1", "node2", "node3", "node4"]
    assert sum(f"job {running} alice pretrain (running)" in t for t in nodes.values()) == 2
    assert sum(f"job {team} alice eval (running)" in t for t in nodes.values()) == 1
    queue = browser.find_element(By.ID, "queue").text
    assert f"{waiting} bob sweep LOW 3" in queue and "capacity" in queue
    assert f"{running} alice pretrain NORMAL running" in browser.find_element(By.ID, "running").text
    quota = browser.find_element(By.ID, "quota").text
    assert "group:vision · default · HIGH" in quota and "1 / 1 nodes" in quota and "2 / 2 nodes" in quota
    cards = browser.find_element(By.ID, "cards").text
    assert "3\nnodes held" in cards and "75%\noccupancy" in cards
    assert browser.find_element(By.ID, "error").text == ""
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert severe == []
    shot = tmp_path / "dashboard.png"
    assert browser.save_screenshot(str(shot))
    if os.environ.get("LUBAN_DASHBOARD_SCREENSHOT"):
        shutil.copy(shot, os.environ["LUBAN_DASHBOARD_SCREENSHOT"])
    # a wrong token shows the token form, not data
    browser.get(f"{svc.url}/?token=wrong")
    wait_for(lambda: browser.find_element(By.ID, "login").is_displayed(), 30, what="login form")
    for job in (running, team, waiting):
        admin.stop(job)
