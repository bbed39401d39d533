"""The webhook worker: ``celery -A webhooks.celery_app worker --queues=webhooks --pool=threads``.

A light app of its own (no torch, no model) so deliveries never wait behind, or run in, a
GPU worker; threads suit it because an attempt mostly waits on the receiver. Each attempt
is one task run; a retry is the same task sent again with a countdown.
"""

from __future__ import annotations

from functools import lru_cache

from celery import Task

from shared.jobs import Keys
from shared.redis_client import connect
from shared.settings import get_settings
from webhooks.broker import DELIVER_TASK, create_app
from webhooks.delivery import run_attempt
from webhooks.store import DeliveryStore

app = create_app(get_settings(), main=True)


@lru_cache(maxsize=1)
def _store() -> DeliveryStore:
    settings = get_settings()
    return DeliveryStore(connect(settings), Keys(settings.key_prefix))


@app.task(name=DELIVER_TASK, bind=True, max_retries=None)
def deliver(self: Task, delivery_id: str, attempt: int = 1) -> None:
    """Make one attempt; when it asks for another, schedule it with a countdown."""
    delay = run_attempt(get_settings(), _store(), delivery_id, attempt)
    if delay is not None:
        raise self.retry(args=(delivery_id, attempt + 1), countdown=delay)
