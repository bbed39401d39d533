"""Fault injection on real processes: killed workers, poison jobs, a killed Redis, drains.

Each test runs its own gateway and worker processes with short claim and heartbeat times,
and counts how often each job's terminal state is stored (every store publishes the job
id once on the job-finished channel), so "exactly once" is observed, not assumed.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
import requests
from celery import Celery

from fleet import commands
from fleet.processes import Process, free_port, wait_until
from shared.keys import Keys
from tests.conftest import ROOT, fleet_env

POISON = "__poison__"


class FaultFleet:
    def __init__(self, redis_url: str, logs, **settings) -> None:
        self.prefix = f"f{uuid.uuid4().hex[:8]}"
        self.redis_url = redis_url
        self.logs = logs
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        defaults = dict(worker_heartbeat_s=0.5, claim_idle_s=3, max_deliveries=3)
        self.env = fleet_env(
            redis_url, key_prefix=self.prefix, gateway_port=self.port, fault_crash_marker=POISON,
            **(defaults | settings),
        )  # fmt: skip
        self.gateway = Process("gateway", commands.gateway(), self.env, logs / "gateway.log")
        self.workers: dict[str, Process] = {}
        self.redis = redis.Redis.from_url(redis_url, decode_responses=True)
        self.finished: Counter[str] = Counter()
        self._listen()
        wait_until(self._gateway_up, 60, "gateway did not start", self.gateway)

    def _gateway_up(self) -> bool:
        try:
            return requests.get(self.base + "/healthz", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False

    def _listen(self) -> None:
        client = redis.Redis.from_url(self.redis_url, decode_responses=True)
        channel = f"{self.prefix}:job-finished"
        subscribed = threading.Event()

        def run():
            while True:
                try:
                    with client.pubsub() as pubsub:  # closed: see gateway/waiting.py
                        pubsub.subscribe(channel)
                        subscribed.set()
                        for message in pubsub.listen():
                            if message["type"] == "message":
                                self.finished[message["data"]] += 1
                except redis.RedisError:
                    time.sleep(0.2)  # Redis is restarting; subscribe again

        threading.Thread(target=run, daemon=True).start()
        subscribed.wait(10)

    def start_worker(self, name: str) -> Process:
        argv = commands.worker(name, engine=self.env.get("ENGINE", "transformers"))
        proc = Process(name, argv, self.env, self.logs / f"{name}-{time.time()}.log")
        self.workers[name] = proc
        return proc

    def wait_loaded(self, name: str) -> None:
        key = Keys(self.prefix).worker("demo/qwen3.5-tiny-awq", name)
        wait_until(lambda: self._exists(key), 120, f"{name} did not load", self.workers[name])

    def _exists(self, key: str) -> bool:
        try:
            return bool(self.redis.exists(key))
        except redis.ConnectionError:
            return False

    def submit(self, body: dict) -> str:
        response = requests.post(self.base + "/v1/jobs", json=body, timeout=30)
        assert response.status_code == 202, response.text
        return response.json()["id"]

    def job(self, job_id: str) -> dict:
        return requests.get(f"{self.base}/v1/jobs/{job_id}", timeout=30).json()

    def wait_running(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        stream = Keys(self.prefix).stream("demo/qwen3.5-tiny-awq")
        while time.monotonic() < deadline:
            if self.redis.xpending(stream, "workers")["pending"]:
                time.sleep(0.3)  # well inside the batch
                return
            time.sleep(0.02)
        raise AssertionError("no batch started")

    def wait_all_done(self, ids: list[str], timeout_s: float = 300) -> dict[str, dict]:
        deadline = time.monotonic() + timeout_s
        jobs: dict[str, dict] = {}
        while time.monotonic() < deadline:
            jobs = {i: self.job(i) for i in ids}
            if all(j["status"] not in ("queued", "running") for j in jobs.values()):
                time.sleep(0.5)  # let the last publishes arrive
                return jobs
            time.sleep(0.5)
        left = [i for i, j in jobs.items() if j["status"] in ("queued", "running")]
        raise AssertionError(f"{len(left)} jobs never ended\n" + self._tails())

    def _tails(self) -> str:
        return "\n".join(p.tail(40) for p in [self.gateway, *self.workers.values()])

    def close(self) -> None:
        for proc in [*self.workers.values(), self.gateway]:
            proc.stop(10)


@pytest.fixture
def faults(redis_url, demo_model_path, tmp_path):
    fleet = FaultFleet(redis_url, tmp_path)
    yield fleet
    fleet.close()


def test_workers_killed_mid_batch_lose_nothing_and_finish_each_job_once(faults):
    faults.start_worker("a@test")
    faults.wait_loaded("a@test")
    body = {"prompt": "Crash test", "max_new_tokens": 8}
    with ThreadPoolExecutor(32) as pool:
        ids = list(pool.map(lambda _: faults.submit(body), range(200)))

    # Kill 1: SIGKILL mid-batch; the same worker restarts and re-runs its own pending entries.
    faults.wait_running()
    faults.workers["a@test"].signal(signal.SIGKILL)
    faults.workers["a@test"].stop()
    faults.start_worker("a@test")
    faults.wait_loaded("a@test")
    # Kill 2: SIGKILL mid-batch, never restarted: another worker claims what it held.
    faults.wait_running()
    stream = Keys(faults.prefix).stream("demo/qwen3.5-tiny-awq")
    faults.workers["a@test"].signal(signal.SIGKILL)
    held = faults.redis.xpending_range(stream, "workers", "-", "+", 100, consumername="a@test")
    held_jobs = {
        faults.redis.xrange(stream, r["message_id"], r["message_id"])[0][1]["job"] for r in held
    }
    faults.workers["a@test"].stop()
    faults.start_worker("b@test")

    jobs = faults.wait_all_done(ids)
    assert [j["status"] for j in jobs.values()] == ["succeeded"] * 200
    assert {faults.finished[i] for i in ids} == {1}, "each job's result is stored exactly once"
    assert held_jobs and {jobs[j]["worker"] for j in held_jobs} == {"b@test"}
    assert not faults.redis.xlen(Keys(faults.prefix).dead_letters("demo/qwen3.5-tiny-awq"))


def test_a_live_workers_long_batch_is_never_claimed(redis_url, demo_model_path, tmp_path):
    """Claims are refreshed every heartbeat: a batch longer than CLAIM_IDLE_S stays put."""
    faults = FaultFleet(redis_url, tmp_path, worker_heartbeat_s=0.3, claim_idle_s=1)
    try:
        _long_batch_stays_with_its_worker(faults)
    finally:
        faults.close()


def _long_batch_stays_with_its_worker(faults: FaultFleet) -> None:
    for name in ("a@test", "b@test"):
        faults.start_worker(name)
    for name in ("a@test", "b@test"):
        faults.wait_loaded(name)
    # Several prompts in one micro-batch: it lasts as long as its longest row, and the
    # random demo model ends some rows early (EOS), so one prompt alone may be short.
    prompts = ["Long", "Long batch", "Count to a thousand", "x", "once upon a time", "y z"]
    job_ids = [faults.submit({"prompt": p, "max_new_tokens": 512}) for p in prompts]
    jobs = faults.wait_all_done(job_ids)
    assert {job["status"] for job in jobs.values()} == {"succeeded"}
    longest = max(job["metrics"]["inference_seconds"] for job in jobs.values())
    assert longest > 2, "a batch must outlast CLAIM_IDLE_S (1 s)"
    assert all(faults.finished[j] == 1 for j in job_ids)
    stream = Keys(faults.prefix).stream("demo/qwen3.5-tiny-awq")
    assert faults.redis.xinfo_groups(stream)[0]["entries-read"] == len(job_ids)  # once each


def test_poison_job_is_dead_lettered_and_others_succeed(faults):
    ids = [faults.submit({"prompt": f"fine {i}", "max_new_tokens": 8}) for i in range(6)]
    poison = faults.submit({"prompt": f"bad {POISON}", "max_new_tokens": 8})
    ids += [faults.submit({"prompt": f"fine {i}", "max_new_tokens": 8}) for i in range(6, 10)]
    crashes = 0
    deadline = time.monotonic() + 300
    while faults.job(poison)["status"] in ("queued", "running"):  # restart it, as `make up` does
        assert time.monotonic() < deadline, faults._tails()
        worker = faults.workers.get("p@test")
        if worker is None or not worker.alive():
            crashes += worker is not None
            faults.start_worker("p@test")
        time.sleep(0.3)
    jobs = faults.wait_all_done(ids)
    assert all(j["status"] == "succeeded" for j in jobs.values())
    failed = faults.job(poison)
    assert failed["status"] == "failed" and failed["error"]["code"] == "worker_crashed"
    assert crashes == 3  # MAX_DELIVERIES

    cli = [sys.executable, "-m", "fleet.deadletters"]
    listed = subprocess.run(
        [*cli, "list"], cwd=ROOT, env=faults.env, capture_output=True, text=True
    )
    [letter] = [json.loads(line) for line in listed.stdout.splitlines()]
    assert letter["job"] == poison and int(letter["deliveries"]) == 4
    faults.workers["p@test"].stop()
    requeued = subprocess.run([*cli, "requeue", letter["id"]], cwd=ROOT, env=faults.env,
                              capture_output=True, text=True)  # fmt: skip
    assert requeued.returncode == 0 and "queued again" in requeued.stdout
    assert faults.job(poison)["status"] == "queued"
    assert subprocess.run([*cli, "list"], cwd=ROOT, env=faults.env, capture_output=True,
                          text=True).stdout == ""  # fmt: skip


def test_sigterm_and_drain_finish_the_current_batch_first(faults):
    worker = faults.start_worker("d@test")
    faults.wait_loaded("d@test")
    job_id = faults.submit({"prompt": "Drain me", "max_new_tokens": 150})
    faults.wait_running()
    worker.signal(signal.SIGTERM)
    assert worker.popen.wait(120) == 0
    assert faults.job(job_id)["status"] == "succeeded"

    worker = faults.start_worker("e@test")
    faults.wait_loaded("e@test")
    job_id = faults.submit({"prompt": "Drain me", "max_new_tokens": 150})
    faults.wait_running()
    app = Celery(broker=faults.redis_url)
    reply = app.control.broadcast("fleet_drain", destination=["e@test"], reply=True, timeout=5)
    assert reply == [{"e@test": {"ok": "draining"}}]
    assert worker.popen.wait(120) == 0
    assert faults.job(job_id)["status"] == "succeeded"
    assert faults.finished[job_id] == 1


def test_redis_killed_and_restarted_loses_nothing_accepted(tmp_path, demo_model_path):
    port = free_port()
    data = tmp_path / "redis"
    url = f"redis://127.0.0.1:{port}/0"
    server = Process("redis", commands.redis_server(port, data), fleet_env(url), tmp_path / "r.log")
    wait_until(lambda: _pings(url), 20, "redis did not start", server)
    faults = FaultFleet(url, tmp_path)
    try:
        faults.start_worker("r@test")
        faults.wait_loaded("r@test")
        ids = [faults.submit({"prompt": f"keep {i}", "max_new_tokens": 16}) for i in range(60)]
        faults.wait_running()
        server.signal(signal.SIGKILL)
        server.stop()
        down = requests.post(faults.base + "/v1/jobs", json={"prompt": "x"}, timeout=30)
        assert down.status_code == 503 and down.json()["error"]["code"] == "queue_unavailable"
        time.sleep(2)
        server = Process(
            "redis", commands.redis_server(port, data), fleet_env(url), tmp_path / "r2.log"
        )
        wait_until(lambda: _pings(url), 30, "redis did not restart", server)
        ids.append(faults.submit({"prompt": "after", "max_new_tokens": 4}))  # gateway recovered
        jobs = faults.wait_all_done(ids)
        assert all(j["status"] == "succeeded" for j in jobs.values()), Counter(
            j["status"] for j in jobs.values()
        )
    finally:
        faults.close()
        server.stop()


def _pings(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url).ping())
    except redis.RedisError:
        return False
