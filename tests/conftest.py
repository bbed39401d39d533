"""Shared fixtures: a real Redis on a free port, the real demo model, and a running fleet
(one Celery worker process and the gateway under gunicorn), reached over real HTTP."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import requests

from fleet import commands
from fleet.processes import Process, free_port, wait_until
from shared.states import TERMINAL_STATUSES
from tests.webhook_receiver import Receiver, serve_receiver
from workers import demo_model

ROOT = commands.ROOT


@pytest.fixture(scope="session")
def demo_model_path() -> Path:
    return demo_model.build()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> Iterator[str]:
    port = free_port()
    data = tmp_path_factory.mktemp("redis")
    proc = Process("redis", commands.redis_server(port, data), os.environ.copy(), data / "log")
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    wait_until(lambda: _pings(client), 20, "redis did not start", proc)
    yield url
    proc.stop()


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def fleet_env(redis_url: str, **overrides: object) -> dict[str, str]:
    """Environment of a fleet process under test: offline, demo model, given settings.

    The result cache is off: the tests of batching, scaling and faults send the same greedy
    prompts again and need each one computed. tests/test_cache.py turns it on."""
    env = os.environ.copy()
    env.update(
        PYTHONPATH=str(ROOT),
        REDIS_URL=redis_url,
        HF_HUB_OFFLINE="1",
        MAX_BATCH_SIZE="8",
        MAX_BATCH_WAIT_MS="50",
        GATEWAY_HOST="127.0.0.1",
        GATEWAY_PROCESSES="2",
        WORKER_HEARTBEAT_S="1",
        WORKER_METRICS_PORT="0",
        CACHE_ENABLED="0",
    )
    env.pop("MODEL", None)
    env.update({k.upper(): str(v) for k, v in overrides.items()})
    return env


class Fleet:
    """A running gateway and worker, and helpers to talk to them the way a client does."""

    def __init__(self, base_url: str, redis_url: str, prefix: str, worker: str) -> None:
        self.base_url = base_url
        self.redis = redis.Redis.from_url(redis_url, decode_responses=True)
        self.prefix = prefix
        self.worker = worker
        self.http = requests.Session()

    def url(self, path: str) -> str:
        return self.base_url + path

    def submit(
        self, body: dict, wait: int | None = None, headers: dict | None = None, **kwargs
    ) -> requests.Response:
        headers = dict(headers or {}) | ({"Prefer": f"wait={wait}"} if wait else {})
        return self.http.post(
            self.url("/v1/jobs"), json=body, headers=headers, timeout=90, **kwargs
        )

    def get(self, job_id: str) -> dict:
        response = self.http.get(self.url(f"/v1/jobs/{job_id}"), timeout=30)
        response.raise_for_status()
        return response.json()

    def wait_done(self, job_id: str, timeout_s: float = 120) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            job = self.get(job_id)
            if job["status"] in TERMINAL_STATUSES:
                return job
            time.sleep(0.1)
        raise AssertionError(f"job {job_id} did not finish in {timeout_s}s: {job}")

    def run(self, body: dict) -> dict:
        response = self.submit(body)
        assert response.status_code == 202, response.text
        return self.wait_done(response.json()["id"])


def start_fleet(redis_url: str, logs: Path, prefix: str, **settings: object):
    """Start a worker and a gateway sharing one Redis under their own key prefix."""
    port, metrics_port = free_port(), free_port()
    env = fleet_env(
        redis_url,
        key_prefix=prefix,
        gateway_port=port,
        worker_metrics_port=metrics_port,
        **settings,
    )
    name = f"test-{prefix}@localhost"
    argv = commands.worker(name, engine=str(settings.get("engine", "transformers")))
    worker = Process("worker", argv, env, logs / f"{prefix}-worker.log")
    gateway = Process("gateway", commands.gateway(), env, logs / f"{prefix}-gateway.log")
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return requests.get(base + "/readyz", timeout=2).status_code == 200
        except requests.RequestException:  # refused, or a read timeout while workers boot
            return False

    wait_until(ready, 300, "fleet did not become ready", worker, gateway)
    running = Fleet(base, redis_url, prefix, name)
    running.worker_metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    return running, worker, gateway


@pytest.fixture(scope="session")
def fleet(redis_url, demo_model_path, tmp_path_factory) -> Iterator[Fleet]:
    logs = tmp_path_factory.mktemp("logs")
    running, worker, gateway = start_fleet(redis_url, logs, "main")
    running.worker_process = worker
    yield running
    gateway.stop()
    worker.stop()


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    """A webhook receiver on loopback (see :mod:`tests.webhook_receiver`)."""
    state, server = serve_receiver()
    yield state
    server.shutdown()
    server.server_close()
