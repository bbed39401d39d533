"""Celery remote control from the gateway (``fleet_drain``), without loading the workers'
Celery app (and its model code): a bare app on the same broker reaches the workers' pidbox."""

from __future__ import annotations

import threading

from celery import Celery

from gateway.extensions import fleet

REPLY_TIMEOUT_S = 3.0
_apps: dict[str, Celery] = {}
_lock = threading.Lock()


def drain(name: str) -> bool:
    """Ask worker ``name`` to drain; whether it answered."""
    replies = _app().control.broadcast(
        "fleet_drain", destination=[name], reply=True, timeout=REPLY_TIMEOUT_S
    )
    return any(name in reply and "ok" in reply[name] for reply in replies or [])


def _app() -> Celery:
    url = fleet.settings.effective_redis_url
    with _lock:
        if url not in _apps:
            _apps[url] = Celery("fleet-gateway", broker=url)
        return _apps[url]
