"""The fleet under load: its own Redis, one worker and the gateway, driven over real HTTP.

Each client is a thread that submits with ``Prefer: wait=60`` and sends its next job as soon
as the previous one returns (a closed loop), so the concurrency is the number of clients.
"""

from __future__ import annotations

import math
import os
import re
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import redis
import requests

from bench.model import job_input
from fleet import commands
from fleet.processes import Process, free_port, wait_until
from shared.protocol import JobInput

WAIT_S = 60
TIMEOUT_S = WAIT_S + 30  # one HTTP request
JOB_LIMIT_S = 600  # one job, polling included: past this the fleet is stuck, not slow
READY_TIMEOUT_S = 300
T = TypeVar("T")
LOG_ERROR = re.compile(r"\b(ERROR|CRITICAL|Traceback)\b")
LOG_WARNING = re.compile(r"\bWARNING(?:/\w+)?\]?(.*)")


@dataclass
class RunningFleet:
    base_url: str
    processes: list[Process]

    def problems(self, limit: int = 20) -> list[str]:
        """Error and traceback lines from the processes' logs, and distinct warnings.

        Celery logs whatever a library prints as a WARNING, so empty and repeated warning
        lines are dropped; errors are kept as they are.
        """
        errors, warnings = [], {}
        for proc in self.processes:
            text = proc.log.read_text(errors="replace") if proc.log.exists() else ""
            for line in text.splitlines():
                if LOG_ERROR.search(line):
                    errors.append(f"{proc.name}: {line.strip()}")
                elif (match := LOG_WARNING.search(line)) and match.group(1).strip():
                    warnings.setdefault(f"{proc.name}: {match.group(1).strip()[:200]}", None)
        return (errors + list(warnings))[:limit]


def _env(redis_url: str, gateway_port: int, settings: dict[str, str]) -> dict[str, str]:
    """Like the tests' fleet env: offline, the demo model, a key prefix of this run's own."""
    env = os.environ.copy()
    env.pop("MODEL", None)
    env.update(
        PYTHONPATH=str(commands.ROOT),
        REDIS_URL=redis_url,
        KEY_PREFIX=f"bench-{uuid.uuid4().hex[:8]}",
        HF_HUB_OFFLINE="1",
        GATEWAY_HOST="127.0.0.1",
        GATEWAY_PORT=str(gateway_port),
        WORKER_HEARTBEAT_S="1",
        # The benches repeat greedy prompts: with the cache on, the fleet would answer them
        # without the model, and a ratio against the bare model would mean nothing.
        # bench.cache measures the cache itself.
        CACHE_ENABLED="0",
    )
    env.update(settings)
    return env


def _answers(check: Callable[[], object]) -> bool:
    try:
        return bool(check())
    except (redis.ConnectionError, requests.RequestException):
        return False


def start_redis(procs: list[Process], data_dir: Path, logs: Path) -> str:
    """A redis-server on a free port, added to ``procs``; its URL once it answers."""
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    argv = commands.redis_server(port, data_dir)
    procs.append(Process("redis", argv, os.environ.copy(), logs / "redis.log"))
    with redis.Redis.from_url(url) as client:
        wait_until(lambda: _answers(client.ping), 20, "redis did not start", *procs)
    return url


@contextmanager
def running_fleet(
    settings: dict[str, str], logs: Path | None = None, engine: str = "transformers"
) -> Iterator[RunningFleet]:
    """Start redis-server, a worker and the gateway with ``settings`` (env overrides) added.
    The worker runs ``engine`` (a vllm worker runs on .venv-vllm's Python).

    Every process is stopped on the way out, also when startup or the benchmark fails.
    """
    procs: list[Process] = []
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        logs = logs or Path(tmp) / "logs"
        try:
            redis_url = start_redis(procs, Path(tmp) / "redis", logs)
            port = free_port()
            env = _env(redis_url, port, {**settings, "ENGINE": engine})
            name = f"{env['KEY_PREFIX']}@localhost"
            argv = commands.worker(name, engine=engine)
            procs.append(Process("worker", argv, env, logs / "worker.log"))
            procs.append(Process("gateway", commands.gateway(), env, logs / "gateway.log"))
            base = f"http://127.0.0.1:{port}"

            def ready() -> bool:
                return requests.get(base + "/readyz", timeout=2).status_code == 200

            wait_until(lambda: _answers(ready), READY_TIMEOUT_S, "fleet not ready", *procs)
            yield RunningFleet(base, procs)
        finally:
            for proc in reversed(procs):
                proc.stop()


@dataclass(frozen=True)
class Sample:
    """One request as the client saw it."""

    seconds: float
    tokens: int
    batch_size: int
    queue_s: float  # created -> started by the worker (waiting for the batch and the model)
    inference_s: float  # the micro-batch's generate call


@dataclass(frozen=True)
class LevelResult:
    concurrency: int
    jobs: int
    errors: int
    wall_s: float
    jobs_per_s: float
    tokens_per_s: float
    p50_latency_s: float
    p99_latency_s: float
    mean_batch_size: float
    mean_queue_s: float
    mean_inference_s: float
    first_error: str | None = None

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def percentile(values: list[float], pct: float) -> float:
    """Nearest-rank percentile: with few samples p99 is the slowest one, not an interpolation."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(pct / 100 * len(ordered)) - 1)]


def _one_job(
    http: requests.Session,
    base_url: str,
    index: int,
    make_input: Callable[[int], JobInput] = job_input,
) -> Sample:
    body = make_input(index).model_dump(exclude_none=True)
    began = time.perf_counter()
    response = http.post(
        base_url + "/v1/jobs", json=body, headers={"Prefer": f"wait={WAIT_S}"}, timeout=TIMEOUT_S
    )
    job = response.json() if response.ok else {}
    while response.ok and job.get("status") in ("queued", "running"):
        if time.perf_counter() - began > JOB_LIMIT_S:
            raise RuntimeError(f"job {job['id']} not done after {JOB_LIMIT_S} s")
        time.sleep(0.1)  # not done within WAIT_S: poll, so the latency is still the true one
        response = http.get(base_url + job["urls"]["get"], timeout=TIMEOUT_S)
        job = response.json() if response.ok else {}
    seconds = time.perf_counter() - began
    if job.get("status") != "succeeded":
        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
    metrics = job["metrics"]
    return Sample(
        seconds=seconds,
        tokens=job["output"]["usage"]["completion_tokens"],
        batch_size=metrics["batch_size"],
        queue_s=metrics["queue_seconds"],
        inference_s=metrics["inference_seconds"],
    )


def closed_loop(
    concurrency: int, jobs: int, one: Callable[[requests.Session, int], T]
) -> tuple[list[T], list[str], float]:
    """``concurrency`` clients share ``jobs`` calls of ``one(session, index)``, each client
    one at a time (so the concurrency is the number of clients). Returns the results, the
    errors and the wall time."""
    counter = iter(range(jobs))
    lock = threading.Lock()
    results: list[T] = []
    errors: list[str] = []

    def client() -> None:
        with requests.Session() as http:
            while True:
                with lock:
                    index = next(counter, None)
                if index is None:
                    return
                try:
                    result = one(http, index)
                except (requests.RequestException, RuntimeError, KeyError, ValueError) as exc:
                    with lock:
                        errors.append(str(exc))
                    continue
                with lock:
                    results.append(result)

    began = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(client) for _ in range(concurrency)]:
            future.result()
    return results, errors, time.perf_counter() - began


def run_level(base_url: str, concurrency: int, jobs: int) -> LevelResult:
    """``concurrency`` clients share ``jobs`` requests, each client one at a time."""
    samples, errors, wall = closed_loop(
        concurrency, jobs, lambda http, index: _one_job(http, base_url, index)
    )
    if not samples:
        raise RuntimeError(f"every job failed at concurrency {concurrency}: {errors[:3]}")
    latencies = [s.seconds for s in samples]
    return LevelResult(
        concurrency=concurrency,
        jobs=len(samples),
        errors=len(errors),
        wall_s=wall,
        jobs_per_s=len(samples) / wall,
        tokens_per_s=sum(s.tokens for s in samples) / wall,
        p50_latency_s=percentile(latencies, 50),
        p99_latency_s=percentile(latencies, 99),
        mean_batch_size=statistics.mean(s.batch_size for s in samples),
        mean_queue_s=statistics.mean(s.queue_s for s in samples),
        mean_inference_s=statistics.mean(s.inference_s for s in samples),
        first_error=errors[0] if errors else None,
    )
