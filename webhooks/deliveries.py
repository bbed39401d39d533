"""Webhook deliveries, as the rest of the fleet makes and reads them (a Python interface).

:func:`enqueue_event` checks the URL, stores the delivery and hands it to the webhook
worker (queue ``webhooks``); it never waits for the receiver. The returned delivery id is
also the ``webhook-id`` header of every attempt, so receivers can drop duplicates.
"""

from __future__ import annotations

import json
import time
import uuid
from functools import lru_cache
from typing import Any

from celery import Celery

from shared.keys import Keys
from shared.records import rfc3339
from shared.redis_client import connect
from shared.settings import Settings
from webhooks import ssrf
from webhooks.broker import DELIVER_TASK, QUEUE, create_app
from webhooks.store import DeliveryStore

MAX_PAYLOAD_BYTES = 64 * 1024  # Standard Webhooks: keep payloads small (~20 kB)
FIRST_ATTEMPT_LEASE_S = 3600  # the record outlives a first attempt that waits in the queue


class WebhookConfigError(RuntimeError):
    """Webhooks cannot be sent with these settings (no WEBHOOK_SECRET)."""


def new_delivery_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def enqueue_event(
    url: str,
    event_type: str,
    data: dict[str, Any],
    settings: Settings,
    *,
    delivery_id: str | None = None,
    owner: str | None = None,
    check_url: bool = True,
    envelope: dict[str, Any] | None = None,
) -> str:
    """Send ``{type, timestamp, data}`` to ``url``, signed; return the delivery id.
    ``envelope``, when given, is sent instead, whole (an OpenAI-shaped event).

    A given ``delivery_id`` makes the call idempotent: the delivery is created once, and a
    repeated call only re-sends the first attempt's task (which runs at most once).
    ``owner`` (a job or batch id) lists the delivery under it for :func:`deliveries_of`.
    ``check_url=False`` leaves the SSRF check to the attempt, which records a refusal.

    Raises :class:`~webhooks.ssrf.UnsafeURLError` (a ValueError) for a URL that may not
    receive webhooks, ValueError for a bad event, WebhookConfigError without a secret.
    """
    if settings.webhook_secret is None:
        raise WebhookConfigError("WEBHOOK_SECRET is not set: webhooks cannot be signed")
    if not event_type or not isinstance(event_type, str) or len(event_type) > 128:
        raise ValueError("event_type must be a non-empty string of at most 128 characters")
    if not isinstance(data, dict):
        raise ValueError("data must be a JSON object (dict)")
    if check_url:
        ssrf.check_url(url, settings.webhook_allow_private)
    event = envelope or {"type": event_type, "timestamp": rfc3339(time.time()), "data": data}
    try:
        payload = json.dumps(event, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"data is not JSON: {exc}") from None
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise ValueError(f"the event is {len(payload)} bytes, over {MAX_PAYLOAD_BYTES}")
    delivery_id = delivery_id or new_delivery_id()
    ttl_s = settings.result_ttl_s + FIRST_ATTEMPT_LEASE_S
    _store(settings).create(delivery_id, url, event_type, payload, ttl_s, owner)
    _producer(settings).send_task(DELIVER_TASK, args=(delivery_id, 1), queue=QUEUE)
    return delivery_id


def deliveries_of(owner: str, settings: Settings) -> list[dict[str, Any]]:
    """The deliveries about one job or batch, oldest first, as the API shows them.

    Each is ``{id, url, type, state, created_at, ended_at, next_retry_at, error,
    attempts: [{attempt, at, status, error, duration_ms, next_retry_at}]}``; state is
    pending, delivered, failed or gone.
    """
    store = _store(settings)
    return [d for d in store.read(store.owned_by(owner)) if d is not None]


def delivery(delivery_id: str, settings: Settings) -> dict[str, Any] | None:
    """One delivery (see :func:`deliveries_of`), or None when unknown or expired."""
    return _store(settings).read([delivery_id])[0]


@lru_cache(maxsize=8)
def _store(settings: Settings) -> DeliveryStore:
    """One Redis client (and connection pool) per settings, shared by every call."""
    return DeliveryStore(connect(settings), Keys(settings.key_prefix))


@lru_cache(maxsize=8)
def _producer(settings: Settings) -> Celery:
    """One Celery producer app per settings: its broker connections are pooled."""
    return create_app(settings)
