"""``make up``: run the whole fleet in the foreground until Ctrl-C or SIGTERM.

Starts, in order: Redis (embedded, AOF under DATA_DIR, unless REDIS_URL is set; its
password is generated once into DATA_DIR/redis.password, see :mod:`fleet.embedded_redis`), the
webhook worker, MIN_WORKERS inference workers, the gateway under gunicorn, and Flower; then
the autoscaler adds and drains workers with the queue's backlog. Crashed processes are
restarted. On Ctrl-C or SIGTERM everything is stopped in reverse order; a second signal
kills at once.

API keys are on (REQUIRE_API_KEYS=1) unless AUTH=off (or REQUIRE_API_KEYS=0) is given: with
no admin key in Redis yet, one is made and printed once (Redis keeps only its hash).

Local webhook defaults, the same for every child (the gateway accepts a webhook URL only
with a secret set, the webhook worker signs with it, receivers verify with it): without
WEBHOOK_SECRET, one is generated for this run and printed; without WEBHOOK_ALLOW_PRIVATE,
webhook URLs on loopback and private addresses are allowed, as local receivers usually are.
"""

from __future__ import annotations

import base64
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import redis
from prometheus_client import start_http_server

from fleet import commands, data_dir_lock, embedded_redis
from fleet.autoscaler import Autoscaler
from fleet.supervisor import Service, Supervisor
from fleet.worker_pool import WorkerPool, visible_gpus
from shared.api_keys import ApiKeyStore, Scope
from shared.settings import Settings, get_settings
from shared.stats import QueueStats
from workers import demo_model


class StartupError(RuntimeError):
    pass


def main() -> int:
    settings = get_settings()
    if settings.engine == "vllm" and not commands.VLLM_PYTHON.exists():
        print(f"ENGINE=vllm runs the workers from {commands.VLLM_PYTHON.parent.parent}, which "
              "is missing: run `make up ENGINE=vllm` (or `make vllm-env` first)",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        lock = data_dir_lock.hold(settings.data_dir)
    except data_dir_lock.DataDirInUse as exc:
        print(f"cannot start: {exc}", file=sys.stderr)
        return 2
    try:
        redis_config = None if settings.redis_url else embedded_redis.prepare(settings)
    except embedded_redis.PasswordFileError as exc:
        print(f"cannot start: {exc}", file=sys.stderr)
        return 2
    # The embedded Redis's password never travels in the environment: every child reads it
    # from DATA_DIR (Settings.embedded_redis_url), given as an absolute path.
    env = dict(
        os.environ, PYTHONPATH=str(commands.ROOT), REDIS_URL=settings.redis_url or "",
        DATA_DIR=str(settings.data_dir.resolve()),
    )  # fmt: skip
    if not settings.model:
        env["HF_HUB_OFFLINE"] = "1"  # the demo model is local; never reach a hub
    notes = webhook_defaults(settings, env)
    keys_on = api_keys_wanted(settings, env)
    supervisor = Supervisor(env, cwd=str(commands.ROOT), pass_fds=(lock,))
    logging.basicConfig(
        level=logging.INFO, format="%(message)s", handlers=[_SayHandler(supervisor)]
    )

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)  # also when started with SIGINT ignored (`cmd &`)
    try:
        check_ports_free(settings)
        start_redis(supervisor, settings, redis_config)
        key_notes = first_admin_key(settings) if keys_on else _KEYS_OFF
        start_webhook_worker(supervisor, settings)
        ensure_model(supervisor, settings, env)
        pool = WorkerPool(supervisor, settings)
        warn_metrics_port_overlap(supervisor, settings, pool.max_workers)
        autoscaler = Autoscaler(settings, QueueStats.from_settings(settings), pool)
        serve_autoscaler_metrics(supervisor, settings)
        pool.scale_to(autoscaler.policy.min_workers)
        supervisor.start(Service("gateway", commands.gateway(), 75))
        supervisor.start(Service("flower", commands.flower(settings)))
        wait_ready(
            supervisor, settings, autoscaler.policy.min_workers > 0, notes, key_notes, keys_on
        )
        supervisor.say(
            f"autoscaling {autoscaler.policy.min_workers}..{pool.max_workers} workers "
            f"({pool.gpus or 'no'} GPUs), {settings.target_backlog_per_worker} queued jobs each"
        )
        supervisor.watch(tick=autoscaler.tick)
    except StartupError as exc:
        supervisor.say(f"cannot start: {exc}")
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, lambda *_: _kill_now(supervisor))
        signal.signal(signal.SIGTERM, lambda *_: _kill_now(supervisor))
        supervisor.say("shutting down (Ctrl-C again to kill at once)")
        supervisor.stop_all()
        supervisor.say("stopped")
    return 0


_KEYS_OFF = [
    "off (AUTH=off): anyone who reaches the gateway can submit, read every job and use the "
    "admin routes"
]


def api_keys_wanted(settings: Settings, env: dict[str, str]) -> bool:
    """Keys on for every child unless AUTH=off or REQUIRE_API_KEYS is set false."""
    if os.environ.get("AUTH", "").strip().lower() in ("off", "0", "false", "no"):
        env["REQUIRE_API_KEYS"] = "0"
        return False
    if any(name.upper() == "REQUIRE_API_KEYS" for name in os.environ):
        return settings.require_api_keys  # as given
    env["REQUIRE_API_KEYS"] = "1"
    return True


def first_admin_key(settings: Settings) -> list[str]:
    """Make an admin key if Redis holds none: what to print about keys (its secret, once)."""
    store = ApiKeyStore.from_settings(settings)
    more = "make more: python -m fleet.keys create --name NAME [--scopes jobs,batches]"
    if store.any_admin():
        return [f"on ({len(store.list())} keys in Redis; {more})"]
    made = store.create("admin", (Scope.ADMIN,))
    return [
        "on; the first admin key, shown this once (Redis keeps only its hash):",
        f"export FLEET_API_KEY={made.secret}",
        more,
    ]


def webhook_defaults(settings: Settings, env: dict[str, str]) -> list[str]:
    """Set make up's local webhook defaults in ``env`` (every child's); say what was set."""
    notes = []
    if settings.webhook_secret is None:
        secret = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
        env["WEBHOOK_SECRET"] = secret
        notes.append(
            f"WEBHOOK_SECRET was not set; generated for this run: {secret}; "
            "set it to keep it across restarts"
        )
    if not any(name.upper() == "WEBHOOK_ALLOW_PRIVATE" for name in os.environ):
        env["WEBHOOK_ALLOW_PRIVATE"] = "1"
        notes.append(
            "webhook URLs on loopback/private addresses are allowed "
            "(local default; set WEBHOOK_ALLOW_PRIVATE=0 to refuse)"
        )
    return notes


def serve_autoscaler_metrics(supervisor: Supervisor, settings: Settings) -> None:
    if settings.autoscaler_metrics_port:
        try:
            start_http_server(settings.autoscaler_metrics_port, addr="127.0.0.1")
        except OSError as exc:
            supervisor.say(f"no autoscaler /metrics on {settings.autoscaler_metrics_port}: {exc}")


def check_ports_free(settings: Settings) -> None:
    ports = {"GATEWAY_PORT": settings.gateway_port, "FLOWER_PORT": settings.flower_port}
    if not settings.redis_url:
        ports["EMBEDDED_REDIS_PORT"] = settings.embedded_redis_port
    if settings.webhook_metrics_port:
        ports["WEBHOOK_METRICS_PORT"] = settings.webhook_metrics_port
    for name, port in ports.items():
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                raise StartupError(f"port {port} is in use; set {name} to a free port")


def warn_metrics_port_overlap(supervisor: Supervisor, settings: Settings, workers: int) -> None:
    """Local worker i serves /metrics on WORKER_METRICS_PORT + i: say so if the webhook
    worker (started first, so it gets the port) takes one of those."""
    base, port = settings.worker_metrics_port, settings.webhook_metrics_port
    if base and port and base <= port < base + workers:
        supervisor.say(
            f"WEBHOOK_METRICS_PORT {port} is also the /metrics port of local worker "
            f"{port - base} (WORKER_METRICS_PORT + {port - base}), which will have none; "
            "set WEBHOOK_METRICS_PORT outside that range"
        )


def start_redis(supervisor: Supervisor, settings: Settings, config: Path | None) -> None:
    if not settings.redis_url:
        data_dir = settings.data_dir.resolve() / "redis"
        argv = commands.redis_server(settings.embedded_redis_port, data_dir, config)
        supervisor.start(Service("redis", argv, stop_timeout_s=30))
    client = redis.Redis.from_url(settings.effective_redis_url, socket_connect_timeout=1)
    deadline = time.monotonic() + 30
    while True:
        try:
            client.ping()
            return
        except redis.BusyLoadingError:
            pass  # replaying its AOF
        except redis.ConnectionError as exc:
            if time.monotonic() > deadline:
                raise StartupError(f"redis at {settings.shown_redis_url}: {exc}") from None
        time.sleep(0.2)


def start_webhook_worker(supervisor: Supervisor, settings: Settings) -> None:
    """Before the gateway, so that the first job's webhooks find a worker to deliver them."""
    argv = commands.webhook_worker(commands.webhook_worker_name())
    # Warm shutdown lets an attempt in flight finish: at most WEBHOOK_TIMEOUT_S.
    supervisor.start(Service("webhooks", argv, stop_timeout_s=settings.webhook_timeout_s + 15))


def ensure_model(supervisor: Supervisor, settings: Settings, env: dict[str, str]) -> None:
    if settings.model or (demo_model.demo_model_dir() / "config.json").exists():
        return
    supervisor.say("building the demo AWQ model (once; about a minute)...")
    build = subprocess.run(
        [sys.executable, "-m", "workers.demo_model"], cwd=commands.ROOT, env=env,
        capture_output=True, text=True,
    )  # fmt: skip
    if build.returncode != 0:
        raise StartupError(
            f"demo model build failed:\n{build.stdout[-2000:]}{build.stderr[-2000:]}"
        )


def wait_ready(
    supervisor: Supervisor,
    settings: Settings,
    need_worker: bool,
    notes: Sequence[str] = (),
    key_notes: Sequence[str] = (),
    keys_on: bool = False,
    timeout_s: float = 600,
) -> None:
    base = f"http://{_display_host(settings)}:{settings.gateway_port}"
    probe = f"{base}/readyz" if need_worker else f"{base}/healthz"  # MIN_WORKERS=0: none yet
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(probe, timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        time.sleep(0.5)
    else:
        supervisor.say(f"not ready after {timeout_s}s; still trying (see the logs above)")
    flower = f"http://{_display_host(settings)}:{settings.flower_port}"
    password_file = settings.embedded_redis_password_file
    redis_note = "" if settings.redis_url else f"   (password in {password_file})"
    webhook_metrics = (
        f", webhooks: http://127.0.0.1:{settings.webhook_metrics_port}/metrics"
        if settings.webhook_metrics_port
        else ""
    )
    for line in (
        "fleet is up",
        f"  gateway   {base}   (API docs: {base}/docs/swagger, spec: {base}/openapi.json)",
        f"  flower    {flower}"
        + ("   (basic auth from FLOWER_BASIC_AUTH)" if settings.flower_basic_auth else ""),
        f"  metrics   {base}/metrics  (worker: "
        f"http://127.0.0.1:{settings.worker_metrics_port}/metrics{webhook_metrics})",
        f"  redis     {settings.shown_redis_url}" + redis_note,
        f"  model     {settings.served_model}   (engine: "
        f"{commands.worker_engine(settings, visible_gpus())})",
        f"  webhooks  {commands.webhook_worker_name()}",
        *(f"  webhooks  {note}" for note in notes),
        *(f"  api keys  {note}" for note in key_notes),
        "  try:      curl -s -H 'Content-Type: application/json' -H 'Prefer: wait=30' "
        + ("-H 'Authorization: Bearer $FLEET_API_KEY' " if keys_on else "")
        + f'-d \'{{"prompt": "Hello"}}\' {base}/v1/jobs',
        "Ctrl-C stops everything.",
    ):
        supervisor.say(line)


def _display_host(settings: Settings) -> str:
    return "127.0.0.1" if settings.gateway_host in ("0.0.0.0", "::") else settings.gateway_host


class _SayHandler(logging.Handler):
    """Log records of the launcher (the autoscaler's decisions) as fleet output lines."""

    def __init__(self, supervisor: Supervisor) -> None:
        super().__init__()
        self.supervisor = supervisor

    def emit(self, record: logging.LogRecord) -> None:
        self.supervisor.say(self.format(record))


def _kill_now(supervisor: Supervisor) -> None:
    for service in supervisor.services:
        if service.proc is not None and service.proc.poll() is None:
            os.killpg(service.proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
