"""``make up``'s launcher: two fleets side by side, each serving (webhook worker included),
each stopping cleanly."""

from __future__ import annotations

import base64
import contextlib
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time

import psutil
import pytest
import redis
import requests

from fleet import commands, data_dir_lock
from fleet.processes import free_port, wait_until
from shared.settings import Settings
from tests.conftest import ROOT, fleet_env

GENERATED_SECRET = re.compile(
    r"WEBHOOK_SECRET was not set; generated for this run: (whsec_[A-Za-z0-9+/=]+); "
    r"set it to keep it across restarts"
)


class Launcher:
    def __init__(self, tmp_path, name: str, **settings: object) -> None:
        self.gateway_port, self.flower_port, self.redis_port = free_port(), free_port(), free_port()
        self.webhook_metrics_port = free_port()
        self.data_dir = tmp_path / name
        env = fleet_env(
            "",
            gateway_port=self.gateway_port,
            flower_port=self.flower_port,
            embedded_redis_port=self.redis_port,
            worker_metrics_port=free_port(),
            data_dir=self.data_dir,
            autoscaler_metrics_port=0,
            webhook_metrics_port=self.webhook_metrics_port,
            **settings,
        )
        env.pop("REDIS_URL")  # the launcher starts its own embedded Redis
        self.start_env = env
        for name in [n for n in env if n.upper() in ("WEBHOOK_SECRET", "WEBHOOK_ALLOW_PRIVATE")]:
            del env[name]  # make up's local defaults apply
        # Its clients: no REDIS_URL, so they find the embedded Redis and its password in
        # DATA_DIR, as `make status` does.
        self.env = dict(env)
        self.log = tmp_path / f"{name}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "fleet.up"],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    @property
    def redis_url(self) -> str:
        settings = Settings(data_dir=self.data_dir, embedded_redis_port=self.redis_port)
        return settings.embedded_redis_url

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def headers(self) -> dict[str, str]:
        """The first admin key make up printed (keys on), as a client sends it; none if off."""
        found = re.search(r"export FLEET_API_KEY=(fk-[\w-]+)", self.output())
        return {"Authorization": f"Bearer {found.group(1)}"} if found else {}

    def wait_up(self) -> None:
        def up() -> bool:
            assert self.proc.poll() is None, self.output()[-3000:]
            return "fleet is up" in self.output()

        wait_until(up, 300, f"launcher did not come up:\n{self.output()[-3000:]}")


def test_two_fleets_side_by_side_start_serve_and_stop_cleanly(tmp_path, demo_model_path):
    # a: make up's defaults (API keys on, a first admin key printed); b: AUTH=off
    fleets = [Launcher(tmp_path, "a"), Launcher(tmp_path, "b", auth="off")]
    try:
        for launcher in fleets:
            launcher.wait_up()
        children = {f: _children(f) for f in fleets}
        passwords = {f: _check_redis_locked_down(f, children[f]) for f in fleets}
        for launcher in fleets:
            names = " ".join(_cmd(c) for c in children[launcher])
            for expected in ("redis-server", "gunicorn", "worker", "flower", "webhooks.celery_app"):
                assert expected in names, names
            out = launcher.output()
            assert f"http://127.0.0.1:{launcher.gateway_port}" in out
            assert f"http://127.0.0.1:{launcher.flower_port}" in out
            _check_webhook_defaults(launcher, children[launcher])

            response = requests.post(
                f"{launcher.base}/v1/jobs", json={"prompt": "Hi", "max_new_tokens": 4},
                headers={"Prefer": "wait=60"} | launcher.headers(), timeout=90,
            )  # fmt: skip
            assert response.status_code == 200 and response.json()["status"] == "succeeded"
            flower = requests.get(
                f"http://127.0.0.1:{launcher.flower_port}/healthcheck", timeout=10
            )
            assert flower.status_code == 200
            # The embedded Redis persists with AOF under the fleet's own data directory.
            assert list((launcher.data_dir / "redis").rglob("*.aof")), "no AOF file"

        # The webhook worker answers on its broker under its own name, and serves /metrics.
        wait_until(lambda: _pings_webhook_worker(fleets[0]), 60, "no ping from the webhook worker")
        for launcher in fleets:
            metrics = f"http://127.0.0.1:{launcher.webhook_metrics_port}/metrics"
            assert f"webhooks: {metrics}" in launcher.output()
            wait_until(
                lambda m=metrics: _serves_deliveries(m), 30, f"no webhook metrics at {metrics}"
            )

        # A worker or Redis that dies is restarted, and the fleet serves again.
        restart = fleets[0]
        for name in ("--pool=solo", "redis-server"):
            [victim] = [c for c in _children(restart) if name in _cmd(c)]
            victim.kill()
            wait_until(
                lambda n=name, v=victim: _replaced(restart, n, v), 120, f"{name} not restarted"
            )
            # A new process is not yet a serving one: until Redis listens again a submit is
            # a 503 (queue_unavailable, with Retry-After), as a client would be told.
            wait_until(lambda: _ready(restart), 120, f"not ready again after {name} restarted")
            response = requests.post(
                f"{restart.base}/v1/jobs", json={"prompt": "again", "max_new_tokens": 4},
                headers={"Prefer": "wait=60"} | restart.headers(), timeout=120,
            )  # fmt: skip
            assert response.json().get("status") == "succeeded", (
                name,
                response.status_code,
                response.text,
            )
        children[restart] = _children(restart)
        _check_api_keys(fleets[0], fleets[1])

        fleets[0].proc.send_signal(signal.SIGTERM)
        fleets[1].proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        for launcher in fleets:
            assert launcher.proc.wait(180) == 0, launcher.output()[-3000:]
            assert "stopped" in launcher.output()
            _check_password_in_no_log(launcher, passwords[launcher])
        time.sleep(0.5)
        left = [
            c for cs in children.values() for c in cs if c.is_running() and c.status() != "zombie"
        ]
        assert not left, [c.cmdline() for c in left]
    finally:
        for launcher in fleets:
            if launcher.proc.poll() is None:
                launcher.proc.kill()


def _check_api_keys(keyed: Launcher, open_: Launcher) -> None:
    """make up turns API keys on and prints a first admin key once; AUTH=off says it is off
    (and the gateway warns); the key is in no log but make up's own output."""
    secret = keyed.headers()["Authorization"].removeprefix("Bearer ")
    assert keyed.output().count(secret) == 1
    job = {"prompt": "Hi", "max_new_tokens": 2}
    refused = requests.post(f"{keyed.base}/v1/jobs", json=job, timeout=30)
    assert refused.status_code == 401 and "WWW-Authenticate" in refused.headers
    assert "api keys  on; the first admin key" in keyed.output()
    assert "Authorization: Bearer $FLEET_API_KEY" in keyed.output()
    assert not open_.headers() and "api keys  off (AUTH=off)" in open_.output()
    assert "REQUIRE_API_KEYS is off" in open_.output()
    assert requests.post(f"{open_.base}/v1/jobs", json=job, timeout=30).status_code == 202
    for log in keyed.data_dir.rglob("*.log"):
        assert secret not in log.read_text(errors="replace"), log


ORPHAN_GRACE_S = 5
# A micro-batch far longer than the grace: its warm drain alone took 79 s (grace 300).
LONG_TOKENS = 3000


def test_no_process_outlives_a_supervisor_killed_mid_batch(tmp_path, demo_model_path):
    """SIGKILL leaves the supervisor no time to stop anything: the kernel's parent-death
    signal and each worker's parent watch must end the whole fleet, the worker within its
    grace even in the middle of a long micro-batch."""
    launcher = Launcher(
        tmp_path, "orphans", worker_orphan_grace_s=ORPHAN_GRACE_S, max_batch_size=4,
        max_new_tokens_limit=LONG_TOKENS, auth="off",
    )  # fmt: skip
    fleet: list[psutil.Process] = []
    try:
        launcher.wait_up()
        lines = [{"custom_id": str(i), "prompt": f"long {i}", "max_new_tokens": LONG_TOKENS}
                 for i in range(8)]  # fmt: skip
        created = requests.post(f"{launcher.base}/v1/batches", json={"requests": lines}, timeout=60)
        assert created.status_code == 202, created.text
        batch_url = f"{launcher.base}/v1/batches/{created.json()['id']}"
        wait_until(
            lambda: requests.get(batch_url, timeout=10).json()["status"] == "in_progress", 120,
            "the batch never started",
        )  # fmt: skip
        # A second fleet on the same DATA_DIR is refused while this one runs...
        second = subprocess.run(
            [sys.executable, "-m", "fleet.up"], cwd=ROOT, env=launcher.start_env,
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert second.returncode == 2 and "still runs on DATA_DIR" in second.stderr, second
        fleet = _children(launcher)
        [worker] = [c for c in fleet if "--pool=solo" in _cmd(c)]
        killed = time.monotonic()
        launcher.proc.kill()
        launcher.proc.wait(10)
        # ...and while anything of it is left, though its supervisor is gone.
        with pytest.raises(data_dir_lock.DataDirInUse):
            data_dir_lock.hold(launcher.data_dir)
        _, alive = psutil.wait_procs([worker], timeout=ORPHAN_GRACE_S + 15)
        assert not alive, f"the worker outlived its grace by {time.monotonic() - killed:.0f} s"
        _, alive = psutil.wait_procs(fleet, timeout=90)
        assert not alive, [_cmd(c) or c.pid for c in alive]
        os.close(data_dir_lock.hold(launcher.data_dir))  # free again once all are gone
    finally:
        if launcher.proc.poll() is None:
            launcher.proc.kill()
        for child in fleet:
            with contextlib.suppress(psutil.Error):
                child.kill()


def _check_webhook_defaults(launcher: Launcher, children: list[psutil.Process]) -> None:
    """make up generates one WEBHOOK_SECRET for the run, prints it, and gives the gateway and
    the webhook worker the same one; webhook URLs on private addresses are allowed."""
    out = launcher.output()
    match = GENERATED_SECRET.search(out)
    assert match, out[-3000:]
    secret = match.group(1)
    assert Settings(webhook_secret=secret).webhook_secret.get_secret_value() == secret
    assert len(base64.b64decode(secret.removeprefix("whsec_"))) == 32
    assert "set WEBHOOK_ALLOW_PRIVATE=0 to refuse" in out
    checked = 0
    for child in children:
        if any(part in _cmd(child) for part in ("gunicorn", "webhooks.celery_app")):
            environ = child.environ()
            assert environ["WEBHOOK_SECRET"] == secret, _cmd(child)
            assert environ["WEBHOOK_ALLOW_PRIVATE"] == "1", _cmd(child)
            checked += 1
    assert checked >= 2


def _check_redis_locked_down(launcher: Launcher, children: list[psutil.Process]) -> str:
    """The embedded Redis requires the password make up generated into DATA_DIR (mode 0600),
    which reaches no command line and no environment; every fleet process, Flower and `make
    status` connect with it. Returns the password."""
    password_file = launcher.data_dir / "redis.password"
    for path in (password_file, launcher.data_dir / "redis.conf"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    password = password_file.read_text().strip()
    assert len(password) >= 40  # secrets.token_urlsafe(32)
    with socket.create_connection(("127.0.0.1", launcher.redis_port), timeout=5) as sock:
        sock.sendall(b"PING\r\n")
        assert sock.recv(100).startswith(b"-NOAUTH"), "an unauthenticated PING was answered"
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=launcher.redis_port, password="not-" + password, retry=None).ping()
    assert redis.Redis(port=launcher.redis_port, password=password).ping()
    assert launcher.redis_url == f"redis://:{password}@127.0.0.1:{launcher.redis_port}/0"
    argv = [" ".join(p.info["cmdline"] or ()) for p in psutil.process_iter(["cmdline"])]
    assert not [line for line in argv if password in line]
    for child in children:
        with contextlib.suppress(psutil.Error):
            assert password not in str(child.environ()), _cmd(child)
    assert ":***@127.0.0.1" in launcher.output() and password not in launcher.output()
    broker = requests.get(f"http://127.0.0.1:{launcher.flower_port}/broker", timeout=30)
    assert broker.status_code == 200 and "127.0.0.1" in broker.text
    assert password not in broker.text
    status = subprocess.run(
        [sys.executable, "-m", "fleet.status"], cwd=ROOT, env=launcher.env, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert status.returncode == 0, status.stderr
    assert password not in status.stdout + status.stderr
    return password


def _check_password_in_no_log(launcher: Launcher, password: str) -> None:
    assert password not in launcher.output()
    kept = {launcher.data_dir / "redis.password", launcher.data_dir / "redis.conf"}
    for path in launcher.data_dir.rglob("*"):
        if path.is_file() and path not in kept:
            assert password.encode() not in path.read_bytes(), path


def _pings_webhook_worker(launcher: Launcher) -> bool:
    ping = [
        sys.executable, "-m", "celery", "-A", "webhooks.celery_app", "inspect", "ping",
        "-d", commands.webhook_worker_name(), "--timeout=5",
    ]  # fmt: skip
    reply = subprocess.run(ping, cwd=ROOT, env=launcher.env, capture_output=True, timeout=60)
    return reply.returncode == 0


def _serves_deliveries(url: str) -> bool:
    try:
        response = requests.get(url, timeout=5)
    except requests.ConnectionError:
        return False
    return response.status_code == 200 and "fleet_webhook_deliveries" in response.text


def _children(launcher: Launcher) -> list[psutil.Process]:
    return psutil.Process(launcher.proc.pid).children(recursive=True)


def _cmd(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:  # gone, or a zombie not reaped yet
        return ""


def _ready(launcher: Launcher) -> bool:
    try:
        return requests.get(f"{launcher.base}/readyz", timeout=5).status_code == 200
    except requests.ConnectionError:
        return False


def _replaced(launcher: Launcher, name: str, old: psutil.Process) -> bool:
    fresh = any(name in _cmd(c) and c.pid != old.pid for c in _children(launcher))
    return fresh and "restart in" in launcher.output()


def test_engine_vllm_without_its_virtualenv_says_how_to_make_it(monkeypatch, tmp_path, capsys):
    from fleet import up
    from shared.settings import get_settings

    monkeypatch.setattr(commands, "VLLM_PYTHON", tmp_path / ".venv-vllm" / "bin" / "python")
    monkeypatch.setenv("ENGINE", "vllm")
    get_settings.cache_clear()
    try:
        assert up.main() == 2
    finally:
        get_settings.cache_clear()
    assert "make up ENGINE=vllm" in capsys.readouterr().err
