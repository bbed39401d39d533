"""Autoscaling end to end under the launcher: a backlog brings MAX_WORKERS up, it drains,
and the fleet returns to MIN_WORKERS after the cooldown, with every job done exactly once."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import redis
import requests

from fleet.processes import wait_until
from shared.keys import Keys
from tests.test_launcher import Launcher, _cmd

JOBS = 300


def _workers(launcher: Launcher) -> int:
    children = psutil.Process(launcher.proc.pid).children(recursive=True)
    return sum("--pool=solo" in _cmd(c) and c.status() != "zombie" for c in children)


def test_backlog_scales_up_to_max_then_back_to_min(tmp_path, demo_model_path):
    launcher = Launcher(
        tmp_path, "scale", max_workers=3, min_workers=1, target_backlog_per_worker=20,
        scale_down_cooldown_s=8, autoscaler_interval_s=0.5, max_batch_size=8, auth="off",
    )  # fmt: skip
    timeline: list[tuple[float, str]] = []
    start = time.monotonic()

    def mark(what: str) -> None:
        timeline.append((round(time.monotonic() - start, 1), what))

    try:
        launcher.wait_up()
        assert _workers(launcher) == 1
        client = redis.Redis.from_url(launcher.redis_url, decode_responses=True)
        mark("fleet up, 1 worker")
        body = {"prompt": "Scale me", "max_new_tokens": 64}
        with ThreadPoolExecutor(16) as pool:
            responses = list(pool.map(
                lambda _: requests.post(f"{launcher.base}/v1/jobs", json=body, timeout=60),
                range(JOBS),
            ))  # fmt: skip
        ids = [r.json()["id"] for r in responses if r.status_code == 202]
        assert len(ids) == JOBS
        mark(f"{JOBS} jobs submitted")

        wait_until(lambda: _workers(launcher) == 3, 60, "did not scale up to 3 workers")
        mark("3 worker processes")

        def ready() -> int:
            return client.zcount(
                Keys("fleet").workers("demo/qwen3.5-tiny-awq"), time.time() - 6, "+inf"
            )

        wait_until(lambda: ready() == 3, 180, "3 workers never had their model loaded")
        mark("3 workers ready")

        def all_done() -> bool:
            stats = client.hgetall(Keys("fleet").stats("demo/qwen3.5-tiny-awq"))
            return int(stats.get("finished:succeeded", 0)) >= JOBS

        wait_until(all_done, 600, "backlog did not drain")
        mark("backlog drained")
        wait_until(lambda: _workers(launcher) == 1, 120, "did not scale back down to 1")
        mark("back to 1 worker")

        stats = client.hgetall(Keys("fleet").stats("demo/qwen3.5-tiny-awq"))
        assert int(stats["submitted"]) == JOBS
        assert int(stats["finished:succeeded"]) == JOBS  # each job stored once, none failed
        statuses = {requests.get(f"{launcher.base}/v1/jobs/{i}", timeout=30).json()["status"]
                    for i in ids}  # fmt: skip
        assert statuses == {"succeeded"}
        workers_used = {requests.get(f"{launcher.base}/v1/jobs/{i}", timeout=30).json()["worker"]
                        for i in ids}  # fmt: skip
        assert len(workers_used) == 3, workers_used
        out = launcher.output()
        assert re.search(r"workers 1 -> 3 \(scale up", out), out[-3000:]
        assert re.search(r"workers [23] -> 1 \(scale down", out), out[-3000:]
        print("\nscaling timeline (s):", timeline)
    finally:
        if launcher.proc.poll() is None:
            launcher.proc.terminate()
            launcher.proc.wait(180)
