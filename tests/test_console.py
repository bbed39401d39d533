"""The web console (/console) in a real browser: Debian's headless Chromium driven by
Selenium through Debian's chromedriver (never a downloaded browser or driver), against a
running fleet that requires API keys.

``CONSOLE_SCREENSHOTS=docs`` also writes each page's screenshot there (the README's)."""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path

import pytest
import redis
import requests

from shared.api_keys import ApiKeyStore
from shared.keys import Keys
from tests.conftest import start_fleet

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.common.exceptions import NoAlertPresentException, TimeoutException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

PREFIX = "console"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM = "/usr/bin/chromium"
XSS = "<img src=x onerror=alert(1)>"
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'"
)

pytestmark = pytest.mark.skipif(
    not (shutil.which(CHROMEDRIVER) and shutil.which(CHROMIUM)),
    reason="needs Debian's chromium and chromium-driver (make test installs them)",
)


@pytest.fixture(scope="module")
def console(redis_url, demo_model_path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("console-logs")
    running, worker, gateway = start_fleet(redis_url, logs, PREFIX, require_api_keys=1)
    store = ApiKeyStore(redis.Redis.from_url(redis_url, decode_responses=True), Keys(PREFIX), 60)
    running.key = store.create("console", ("jobs", "batches", "admin")).secret
    running.http.headers["Authorization"] = f"Bearer {running.key}"
    yield running
    gateway.stop()
    worker.stop()


@pytest.fixture(scope="module")
def browser(console, tmp_path_factory):
    os.environ["SE_OFFLINE"] = "true"  # never let Selenium Manager download a driver
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument("--window-size=1280,900")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.downloads = tmp_path_factory.mktemp("downloads")
    driver.execute_cdp_cmd(
        "Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(driver.downloads)}
    )
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def page(browser, console):
    """The console, after it asked for the key (its first API call is a 401) and got it."""
    browser.get(console.url("/console"))
    dialog = wait(browser, lambda d: d.find_element(By.ID, "key-dialog"))
    wait(browser, lambda d: dialog.is_displayed())
    assert "API key" in dialog.text
    browser.find_element(By.ID, "key-input").send_keys(console.key)
    browser.find_element(By.ID, "key-save").click()
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#play-model option"))
    return browser


def wait(driver, condition, timeout_s: float = 60):
    try:
        return WebDriverWait(driver, timeout_s, poll_frequency=0.1).until(condition)
    except TimeoutException:
        shown = {i: text(driver, i) for i in ("play-status", "play-error", "batch-error")}
        log = driver.get_log("browser")
        raise AssertionError(f"timed out; page: {shown}; log: {log}") from None


def text(driver, element_id: str) -> str:
    return driver.find_element(By.ID, element_id).text


def live_text(driver, element_id: str) -> str | None:
    """The text of an element the page redraws every second (read in one step: no stale
    element between finding it and reading it)."""
    script = "const e = document.getElementById(arguments[0]); return e && e.textContent;"
    return driver.execute_script(script, element_id)


def tab(driver, name: str) -> None:
    driver.find_element(By.CSS_SELECTOR, f"#tabs button[data-tab={name}]").click()


def screenshot(driver, name: str) -> None:
    folder = os.environ.get("CONSOLE_SCREENSHOTS")
    if folder:
        driver.save_screenshot(str(Path(folder) / f"console-{name}.png"))


def play(driver, prompt: str, max_tokens: int) -> None:
    tab(driver, "playground")
    box = driver.find_element(By.ID, "play-prompt")
    box.clear()
    box.send_keys(prompt)
    tokens = driver.find_element(By.ID, "play-max-tokens")
    tokens.clear()
    tokens.send_keys(str(max_tokens))
    driver.find_element(By.ID, "play-submit").click()


def test_console_is_open_with_a_strict_content_security_policy(console):
    for path in ("/console", "/console/", "/console/console.js", "/console/console.css"):
        response = requests.get(console.url(path), timeout=10)
        assert response.status_code == 200, path
        assert response.headers["Content-Security-Policy"] == CSP
    page_html = requests.get(console.url("/console"), timeout=10).text
    assert "<script>" not in page_html and " on" + "click=" not in page_html
    assert requests.get(console.url("/v1/fleet"), timeout=10).status_code == 401


def test_fleet_json(console):
    view = console.http.get(console.url("/v1/fleet"), timeout=10).json()
    (model,) = view["models"]
    assert model["ready_workers"] == 1
    assert set(model["lanes"]) == {"interactive", "batch"}
    assert set(model["recent"]) >= {"jobs_per_second", "latency_p50_s", "window_s"}


def test_the_key_is_kept_in_the_tab(page, console):
    assert page.execute_script("return sessionStorage.getItem('fleet.apiKey')") == console.key
    assert text(page, "key-label").endswith(console.key[-4:])


def test_playground_streams_the_text_then_the_timings(page, console):
    play(page, "Once upon a time", 24)
    wait(page, lambda d: text(d, "play-status") == "succeeded")
    job = console.get(text(page, "play-job-id"))
    assert job["stream"] and job["output"]["text"]
    shown = page.find_element(By.ID, "play-output").get_attribute("textContent")
    assert shown == job["output"]["text"]
    timings = text(page, "play-timings")
    assert "batch size" in timings and console.worker in timings and "inference" in timings
    screenshot(page, "playground")


def test_cancel_while_it_generates(page, console):
    play(page, "A long story", 400)
    wait(page, lambda d: d.find_element(By.ID, "play-output").get_attribute("textContent"))
    page.find_element(By.ID, "play-cancel").click()
    wait(page, lambda d: text(d, "play-status") == "canceled")
    job = console.get(text(page, "play-job-id"))
    assert job["status"] == "canceled"
    assert job["output"] is None or job["output"]["usage"]["completion_tokens"] < 400


def test_an_echoed_prompt_is_text_not_html(page, console):
    play(page, XSS, 4)
    wait(page, lambda d: text(d, "play-status") == "succeeded")
    job_id = text(page, "play-job-id")
    # The key's recent jobs come from the server (GET /v1/jobs), not from this tab alone.
    elsewhere = console.submit({"prompt": "from another client", "max_new_tokens": 2})
    tab(page, "jobs")
    wait(page, lambda d: d.find_elements(By.LINK_TEXT, elsewhere.json()["id"]))
    page.find_element(By.LINK_TEXT, job_id).click()
    wait(page, lambda d: XSS in text(d, "job-input"))
    assert "succeeded" in text(page, "job-facts")
    assert "none" in text(page, "job-deliveries")
    assert page.find_elements(By.TAG_NAME, "img") == []
    with pytest.raises(NoAlertPresentException):
        page.switch_to.alert  # noqa: B018
    screenshot(page, "jobs")


def test_a_batch_from_a_file_runs_to_completion(page, console, tmp_path):
    path = tmp_path / "requests.jsonl"
    lines = [{"custom_id": f"r{i}", "prompt": f"item {i}", "max_new_tokens": 4} for i in range(12)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    tab(page, "batches")
    page.find_element(By.ID, "batch-file").send_keys(str(path))
    wait(page, lambda d: text(d, "batch-message").startswith("created batch_"))
    batch_id = text(page, "batch-message").split()[1]
    row = page.find_element(By.CSS_SELECTOR, f"tr[data-batch='{batch_id}']")
    wait(page, lambda d: row.find_element(By.CLASS_NAME, "batch-status").text == "completed")
    assert row.find_element(By.CLASS_NAME, "batch-counts").text == (
        "12 completed / 0 failed / 12 total"
    )
    ids = page.execute_script("return JSON.parse(sessionStorage.getItem('fleet.batches'))")
    assert batch_id in ids
    row.find_element(By.CLASS_NAME, "batch-download").click()
    results = page.downloads / f"{batch_id}-results.jsonl"
    wait(page, lambda d: results.exists() and results.read_text().count("\n") == 12, 20)
    assert {json.loads(line)["custom_id"] for line in results.read_text().splitlines()} == {
        f"r{i}" for i in range(12)
    }
    screenshot(page, "batches")


def test_a_bad_line_shows_the_servers_message(page, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"custom_id": "a", "prompt": "ok"}\n{"custom_id": "b"}\n')
    tab(page, "batches")
    page.find_element(By.ID, "batch-file").send_keys(str(path))
    wait(page, lambda d: "line 2" in text(d, "batch-error"))
    assert "bad.jsonl was refused" in text(page, "batch-error")


def test_the_fleet_page_shows_a_worker_and_a_moving_backlog(page, console):
    tab(page, "fleet")
    wait(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#workers-table .worker-row"))
    assert console.worker in text(page, "workers-table")
    assert "idle" in text(page, "workers-table") or "busy" in text(page, "workers-table")
    wait(page, lambda d: live_text(d, "fleet-ready-workers") == "1")
    body = "".join(
        json.dumps({"custom_id": f"f{i}", "prompt": f"fleet {uuid.uuid4().hex}",
                    "max_new_tokens": 24}) + "\n"
        for i in range(160)
    )  # fmt: skip
    created = console.http.post(
        console.url("/v1/batches"),
        data=body,
        headers={"Content-Type": "application/x-ndjson"},
        timeout=30,
    )
    assert created.status_code == 202, created.text
    batch_url = console.url(f"/v1/batches/{created.json()['id']}")
    seen = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        seen.append(int(live_text(page, "fleet-backlog-batch")))
        if console.http.get(batch_url, timeout=10).json()["status"] == "completed":
            break
        time.sleep(0.2)
    waiting = [n for n in seen if n > 0]
    assert len(set(waiting)) >= 2, seen  # it went down as workers took requests
    screenshot(page, "fleet")
