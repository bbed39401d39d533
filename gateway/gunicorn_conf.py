"""Gunicorn settings for the gateway, from the fleet's settings.

gevent workers: a request held by ``Prefer: wait`` is a parked greenlet, not a thread, so
hundreds of waiting clients do not stop others from submitting or polling.
"""

import os
import shutil
import tempfile
from pathlib import Path

from shared.settings import get_settings

_settings = get_settings()

# The gateway processes share their HTTP metrics through files in this directory. It must
# be set before prometheus_client is first imported, so that import happens in the hooks.
# A directory the operator set is only emptied of stale metric files, never removed.
_OWN_METRICS_DIR = "PROMETHEUS_MULTIPROC_DIR" not in os.environ
if _OWN_METRICS_DIR:
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(
        prefix=f"fleet-gateway-{_settings.gateway_port}-"
    )


def on_starting(server) -> None:
    path = Path(os.environ["PROMETHEUS_MULTIPROC_DIR"])
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("*.db"):  # left by an earlier run's processes
        stale.unlink()


def child_exit(server, worker) -> None:
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)


def on_exit(server) -> None:
    if _OWN_METRICS_DIR:
        shutil.rmtree(os.environ["PROMETHEUS_MULTIPROC_DIR"], ignore_errors=True)


bind = f"{_settings.gateway_host}:{_settings.gateway_port}"
workers = _settings.gateway_processes
worker_class = "gevent"
worker_connections = 2000
timeout = 90  # longer than the longest Prefer: wait (60 s)
graceful_timeout = 70
keepalive = 5
accesslog = "-" if _settings.gateway_access_log else None
errorlog = "-"
loglevel = "info"
