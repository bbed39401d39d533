"""Flower and Prometheus against the real fleet: the worker shows online and its batches
show as tasks (a failed one with its error); metrics series exist and move with jobs."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from fleet import commands
from fleet.processes import Process, free_port, wait_until
from shared.settings import Settings
from tests.conftest import ROOT, fleet_env

GATEWAY_SERIES = [
    "fleet_http_request_duration_seconds_bucket", "fleet_jobs_submitted_total",
    "fleet_jobs_finished_total", "fleet_job_latency_seconds_bucket",
    "fleet_job_queue_wait_seconds_bucket", "fleet_queue_backlog",
    "fleet_queue_oldest_job_age_seconds", "fleet_workers_ready", "fleet_dead_letters",
]  # fmt: skip
WORKER_SERIES = [
    "fleet_worker_batch_size_bucket", "fleet_worker_inference_seconds_bucket",
    "fleet_worker_prompt_tokens_total", "fleet_worker_generated_tokens_total",
    "fleet_worker_jobs_total", "fleet_worker_busy", "fleet_worker_running_sequences",
]  # fmt: skip


def _scrape(url: str) -> dict[str, float]:
    """Sample name with labels -> value."""
    values = {}
    for line in requests.get(url, timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def _value(samples: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in samples.items() if k.startswith(prefix))


def test_metrics_exist_and_move_with_jobs(fleet):
    gateway_url, worker_url = fleet.url("/metrics"), fleet.worker_metrics_url
    before_gw, before_w = _scrape(gateway_url), _scrape(worker_url)
    for series in GATEWAY_SERIES:
        assert any(k.startswith(series) for k in before_gw), series

    with ThreadPoolExecutor(4) as pool:
        jobs = list(
            pool.map(lambda _: fleet.run({"prompt": "Count", "max_new_tokens": 5}), range(4))
        )
    assert all(j["status"] == "succeeded" for j in jobs)
    after_gw, after_w = _scrape(gateway_url), _scrape(worker_url)
    for series in WORKER_SERIES:
        assert any(k.startswith(series) for k in after_w), series
    model = 'model="demo/qwen3.5-tiny-awq"'
    submitted = f"fleet_jobs_submitted_total{{{model}}}"
    assert after_gw[submitted] >= before_gw[submitted] + 4
    succeeded = f'fleet_jobs_finished_total{{{model},status="succeeded"}}'
    assert after_gw[succeeded] >= before_gw[succeeded] + 4
    latency = f"fleet_job_latency_seconds_count{{{model}}}"
    assert after_gw[latency] >= before_gw[latency] + 4
    assert _value(after_gw, "fleet_http_request_duration_seconds_count") > _value(
        before_gw, "fleet_http_request_duration_seconds_count"
    )
    generated = "fleet_worker_generated_tokens_total"
    assert _value(after_w, generated) >= _value(before_w, generated) + 4
    assert _value(after_w, "fleet_worker_batch_size_count") > _value(
        before_w, "fleet_worker_batch_size_count"
    )


@pytest.fixture(scope="module")
def flower(fleet, redis_url, tmp_path_factory):
    port = free_port()
    env = fleet_env(redis_url, key_prefix=fleet.prefix, flower_port=port, gateway_host="127.0.0.1")
    env["FLOWER_UNAUTHENTICATED_API"] = "true"
    proc = Process(
        "flower", commands.flower(Settings(flower_port=port)), env,
        tmp_path_factory.mktemp("flower") / "flower.log",
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return requests.get(base + "/healthcheck", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False

    wait_until(up, 60, "flower did not start", proc)
    yield base
    proc.stop()


def test_flower_shows_the_worker_online_while_it_generates(fleet, flower):
    def online() -> bool:
        status = requests.get(f"{flower}/api/workers?status=true", timeout=10).json()
        return status.get(fleet.worker) is True

    wait_until(online, 60, "flower never saw the worker")
    # Two micro-batches of the longest jobs (MAX_BATCH_SIZE is 8): long enough to watch.
    body = {"max_new_tokens": 512}
    jobs = [fleet.submit(body | {"prompt": f"Busy {i}"}).json() for i in range(16)]
    checks_while_busy = 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and checks_while_busy < 6:
        if any(fleet.get(j["id"])["status"] == "running" for j in jobs):
            assert online(), "flower shows a generating worker offline"
            checks_while_busy += 1
        time.sleep(1)
    for job in jobs:  # the rest would only delay the next tests
        fleet.http.post(fleet.url(f"/v1/jobs/{job['id']}/cancel"), timeout=10)
    assert checks_while_busy >= 6, "the batch was too short to observe"
    for job in jobs:
        fleet.wait_done(job["id"])


def test_flower_lists_batches_as_tasks_including_a_failed_one(fleet, flower):
    good = fleet.run({"prompt": "Fine", "max_new_tokens": 3})
    bad = fleet.run({"prompt": "a " * 5000, "max_new_tokens": 8})  # longer than the context
    assert bad["status"] == "failed" and bad["error"]["code"] == "prompt_too_long"

    def tasks() -> dict:
        url = f"{flower}/api/tasks?taskname=workers.infer_batch&limit=1000"
        return requests.get(url, timeout=10).json()

    def seen() -> bool:
        found = tasks().values()
        return any(good["id"] in t.get("args", "") for t in found) and any(
            bad["id"] in t.get("args", "") for t in found
        )

    wait_until(seen, 30, "flower did not list both batches")
    by_job = {
        job: t for t in tasks().values() for job in (good["id"], bad["id"]) if job in t["args"]
    }
    ok, failed = by_job[good["id"]], by_job[bad["id"]]
    assert ok["state"] == "SUCCESS" and ok["worker"] == fleet.worker and ok["runtime"] > 0
    assert failed["state"] == "FAILURE" and "prompt_too_long" in failed["exception"]


def test_fleet_status_prints_the_fleet_at_a_glance(fleet, redis_url):
    for _ in range(3):
        fleet.run({"prompt": "Status", "max_new_tokens": 3})
    env = fleet_env(redis_url, key_prefix=fleet.prefix)
    out = subprocess.run(
        [sys.executable, "-m", "fleet.status"], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "model demo/qwen3.5-tiny-awq" in text and "1 ready" in text
    worker_line = next(line for line in text.splitlines() if fleet.worker in line)
    assert "cpu" in worker_line and ("idle" in worker_line or "busy" in worker_line)
    assert "interactive backlog: 0 waiting" in text and "batch backlog: 0 waiting" in text
    assert "jobs/s" in text and "p50" in text and "p95" in text
