"""The webhook worker: ``celery -A webhooks.celery_app worker --queues=webhooks --pool=threads``.

A light app of its own (no torch, no model) so deliveries never wait behind, or run in, a
GPU worker; threads suit it because an attempt mostly waits on the receiver. Each attempt
is one task run; a retry is the same task sent again with a countdown. Beside its tasks,
the worker runs the events dispatcher (:mod:`webhooks.dispatcher`), which turns job and
batch events into deliveries, and serves ``/metrics`` on WEBHOOK_METRICS_PORT.
"""

from __future__ import annotations

import threading
from functools import lru_cache

from celery import Task, bootsteps

from shared.keys import Keys
from shared.redis_client import connect
from shared.settings import get_settings
from webhooks import metrics
from webhooks.attempts import run_attempt
from webhooks.broker import DELIVER_TASK, create_app
from webhooks.dispatcher import EventDispatcher
from webhooks.store import DeliveryStore


class DispatcherStep(bootsteps.StartStopStep):
    """Runs the events dispatcher in a thread for the worker's whole life."""

    def __init__(self, parent, **kwargs) -> None:
        super().__init__(parent, **kwargs)
        self.dispatcher: EventDispatcher | None = None
        self.thread: threading.Thread | None = None

    def start(self, worker) -> None:
        settings = get_settings()
        metrics.serve(settings.webhook_metrics_port)
        self.dispatcher = EventDispatcher(settings, connect(settings), worker.hostname)
        self.thread = threading.Thread(
            target=self.dispatcher.run, name="events-dispatcher", daemon=True
        )
        self.thread.start()

    def stop(self, worker) -> None:
        if self.dispatcher is not None:
            self.dispatcher.request_stop()
        if self.thread is not None:
            self.thread.join(5)


app = create_app(get_settings(), main=True)
app.steps["worker"].add(DispatcherStep)


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
