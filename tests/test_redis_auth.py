"""A Redis that requires a password: the fleet runs on it from REDIS_URL alone, and no log
line or message shows the password. The embedded Redis of `make up` gets one generated into
DATA_DIR (tests/test_launcher.py runs a whole fleet on it)."""

from __future__ import annotations

import os
import secrets
import stat
import subprocess

import pytest
import redis

from fleet import commands, embedded_redis
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
        redis.Redis.from_url(url.replace(password, "wrong"), retry=None).ping()  # no backoff
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


def test_the_embedded_redis_password_is_made_once_private_and_kept(tmp_path):
    settings = Settings(data_dir=tmp_path / "data", embedded_redis_port=6399)
    assert settings.embedded_redis_url == "redis://127.0.0.1:6399/0"  # none yet
    config = embedded_redis.prepare(settings)
    path = settings.embedded_redis_password_file
    password = path.read_text().strip()
    assert len(password) >= 40
    for made in (path, config):
        assert stat.S_IMODE(made.stat().st_mode) == 0o600, made
    assert config.read_text() == f"requirepass {password}\n"
    assert settings.embedded_redis_url == f"redis://:{password}@127.0.0.1:6399/0"
    assert settings.shown_redis_url == "redis://:***@127.0.0.1:6399/0"
    embedded_redis.prepare(settings)  # a later start keeps it
    assert path.read_text().strip() == password
    # redis-server gets it from the config file, never on its command line.
    argv = commands.redis_server(6399, tmp_path / "data" / "redis", config)
    assert argv[:2] == ["redis-server", str(config)]
    assert password not in " ".join(argv)


def test_a_password_file_others_may_read_or_an_empty_one_is_refused(tmp_path):
    path = tmp_path / "redis.password"
    path.write_text("pw\n")
    path.chmod(0o644)
    with pytest.raises(embedded_redis.PasswordFileError, match="chmod 600") as refused:
        embedded_redis.ensure_password(path)
    assert "pw" not in str(refused.value).replace(str(path), "")
    path.chmod(0o600)
    assert embedded_redis.ensure_password(path) == "pw"
    path.write_text("")
    with pytest.raises(embedded_redis.PasswordFileError, match="empty"):
        embedded_redis.ensure_password(path)


def test_a_data_dir_from_before_passwords_keeps_its_data_behind_one(tmp_path):
    """An embedded Redis's AOF written without a password loads under the new password."""
    settings = Settings(data_dir=tmp_path, embedded_redis_port=free_port())
    argv = commands.redis_server(settings.embedded_redis_port, tmp_path / "redis")
    before = _embedded(argv, tmp_path / "before.log", settings.embedded_redis_url)
    redis.Redis.from_url(settings.embedded_redis_url).set("kept", "1")
    before.stop()
    config = embedded_redis.prepare(settings)
    argv = commands.redis_server(settings.embedded_redis_port, tmp_path / "redis", config)
    after = _embedded(argv, tmp_path / "after.log", settings.embedded_redis_url)
    try:
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=settings.embedded_redis_port, password="wrong", retry=None).get("x")
        assert redis.Redis.from_url(settings.embedded_redis_url).get("kept") == b"1"
    finally:
        after.stop()
    password = settings.embedded_redis_password_file.read_text().strip()
    for log in (tmp_path / "before.log", tmp_path / "after.log"):
        assert password not in log.read_text(errors="replace")


def _embedded(argv: list[str], log, url: str) -> Process:
    proc = Process("redis", argv, os.environ.copy(), log)

    def answers() -> bool:
        try:
            return bool(redis.Redis.from_url(url).ping())
        except (redis.ConnectionError, redis.BusyLoadingError):
            return False

    wait_until(answers, 20, "redis did not start", proc)
    return proc
