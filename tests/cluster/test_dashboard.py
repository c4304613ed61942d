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




def test_job_page_shows_events_log_and_training_curves(service, browser, tmp_path):
    """A luban train job reports its run; its page draws loss, tokens/s (with the planner's
    prediction) and MFU by step, lists its events and shows its log. Screenshot looked at."""
    from selenium.webdriver.common.by import By

    from tests.cluster.conftest import ROOT
    from tests.conftest import tiny_toml

    svc = service("--nodes", "1", "--tick", "0.2")
    token, alice = svc.user("alice", {"NORMAL": 1})
    cfg = tmp_path / "train.toml"
    cfg.write_text(tiny_toml(tmp_path / "run", {"steps": 30, "global_batch": 2, "log_every": 1, "checkpoint_every": 0,
                                                "eval_every": 10}, run_keys={"system": "dgx-a100-80g"}))
    out = svc.cli("submit", "--name", "tiny", "--workdir", str(ROOT), "--", PYTHON, "-m", "luban", "train",
                  str(cfg), "--parallel", "auto", token=token).stdout
    job = int(out.split("submitted job ")[1].split()[0])
    assert alice.wait(job, timeout=300)["state"] == "succeeded", alice.logs(job)["text"][-2000:]
    metrics = alice.call("GET", f"/jobs/{job}/metrics")
    assert metrics["dir"] == str((tmp_path / "run").resolve()) and len(metrics["points"]) == 30
    assert metrics["plan"]["step_time_s"] > 0 and all(p["loss"] > 0 for p in metrics["points"])
    assert sum("val_loss" in p for p in metrics["points"]) == 3

    browser.get(f"{svc.url}/?token={token}#job/{job}")
    wait_for(lambda: browser.execute_script("return document.body.dataset.ready") == "1", 30, what="job page")
    points = browser.execute_script(
        "return ['loss', 'val-loss', 'tokens-per-s', 'mfu'].map(c => "
        "(document.querySelector('#jobpage polyline.' + c).getAttribute('points').trim().split(' ')"
        ".filter(Boolean).length))")
    assert points == [30, 3, 30, 30], points
    # planned for an A100 while running on this CPU: the prediction is named, off the chart's scale
    note = browser.find_element(By.CSS_SELECTOR, "#chart-tps .predicted")
    assert "planner's prediction" in (note.text or note.get_attribute("textContent"))
    assert "tiny (alice)" in browser.find_element(By.ID, "job-title").text
    events = browser.find_element(By.ID, "job-events").text
    assert "start" in events and "succeeded" in events and "run" in events
    assert "step 30/30" in browser.find_element(By.ID, "job-log").text or "30/30" in browser.find_element(
        By.ID, "job-log").text
    axis = browser.execute_script("return [...document.querySelectorAll('#chart-loss text')].map(t => t.textContent)")
    assert "step" in axis and "30" in axis  # a named, labelled x axis
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
    shot = tmp_path / "job.png"
    assert browser.save_screenshot(str(shot))
    if os.environ.get("LUBAN_DASHBOARD_SCREENSHOT"):
        shutil.copy(shot, os.environ["LUBAN_DASHBOARD_SCREENSHOT"].replace(".png", "-job.png"))

    # back on the cluster page: the finished job is listed, and the day's node-hours are drawn
    browser.get(f"{svc.url}/#")
    wait_for(lambda: browser.execute_script("return document.body.dataset.ready") == "1", 30, what="board")
    wait_for(lambda: str(job) in browser.find_element(By.ID, "finished").text, 30, what="finished jobs")
    assert "exit code 0" in browser.find_element(By.ID, "finished").text
    assert browser.execute_script("return document.querySelectorAll('#usage rect.usage-bar').length") >= 1
    assert browser.find_element(By.CSS_SELECTOR, "#finished a.job-link").get_attribute("href").endswith(f"#job/{job}")


def test_a_reported_run_leaks_nothing_but_numbers(service, tmp_path):
    """The job chooses the path the service reads: a symlink to the admin token, or a report
    from a user's own token, yields nothing."""
    import httpx

    svc = service("--nodes", "1", "--tick", "0.2")
    token, alice = svc.user("alice", {"NORMAL": 1})
    run = tmp_path / "evil"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(svc.state / "admin.token")
    job = alice.submit({"name": "evil", "command": PYTHON, "args": ["-c", (
        "import os, luban.cluster as c; c.report_run_dir(%r)" % str(run))]})["id"]
    assert alice.wait(job, timeout=60)["state"] == "succeeded", alice.logs(job)["text"][-2000:]
    got = alice.call("GET", f"/jobs/{job}/metrics")
    assert got["points"] == [] and svc.admin_token not in str(got)
    r = httpx.put(f"{svc.url}/api/jobs/{job}/run", json={"dir": "/etc"}, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 403
