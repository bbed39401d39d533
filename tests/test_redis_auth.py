"""A Redis that requires a password: the fleet runs on it from REDIS_URL alone, and no log
line or message shows the password."""

from __future__ import annotations

import os
import secrets
import subprocess

import pytest
import redis

from fleet import commands
from fleet.processes import Process, free_port, wait_until
from shared.settings import Settings, masked_url
from tests.conftest import fleet_env, start_fleet


@pytest.fixture(scope="module")
def password_redis(tmp_path_factory):
    password = secrets.token_urlsafe(24)
    port, data = free_port(), tmp_path_factory.mktemp("redis-auth")
    argv = [*commands.redis_server(port, data), "--requirepass", password]
    proc = Process("redis-auth", argv, os.environ.copy(), data / "log")
    url = f"redis://:{password}@127.0.0.1:{port}/0"

    def answers() -> bool:
        try:
            return bool(redis.Redis.from_url(url).ping())
        except redis.ConnectionError:
            return False

    wait_until(answers, 20, "redis did not start", proc)
    yield url, password
    proc.stop()


def test_the_fleet_runs_on_a_password_redis_and_never_logs_it(
    password_redis, demo_model_path, tmp_path
):
    url, password = password_redis
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(url.replace(password, "wrong")).ping()
    running, worker, gateway = start_fleet(url, tmp_path, "auth")
    try:
        job = running.submit({"prompt": "locked", "max_new_tokens": 4}, wait=60).json()
        assert job["status"] == "succeeded", job
    finally:
        gateway.stop()
        worker.stop()
    for log in tmp_path.glob("*.log"):
        assert password not in log.read_text(errors="replace"), log.name
    # A message about an unreachable Redis names it without its password.
    unreachable = url.replace(url.rpartition(":")[2], f"{free_port()}/0")
    status = subprocess.run(
        [commands.PYTHON, "-m", "fleet.status"], cwd=commands.ROOT, capture_output=True,
        text=True, timeout=60, env=fleet_env(unreachable),
    )  # fmt: skip
    assert status.returncode == 1 and "cannot read the fleet" in status.stderr
    assert password not in status.stderr + status.stdout
    assert "***" in status.stderr


def test_urls_are_shown_with_their_password_masked():
    assert masked_url("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert masked_url("rediss://user:pw@h:6380/1") == "rediss://user:***@h:6380/1"
    assert masked_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert Settings(redis_url="rediss://u:pw@h:1/0").shown_redis_url == "rediss://u:***@h:1/0"
