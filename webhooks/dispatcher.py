"""Turns the events outbox into webhook deliveries, in the webhook worker.

The scripts that change a job or batch append ``{type, id, url}`` to the model's events
stream in the same atomic step (see ``shared/lua/lib.lua``). This loop consumes them
(consumer group ``webhooks``, through :class:`shared.consumer.StreamConsumer`), builds
each payload from the job or batch as it stands, and hands it to
:func:`webhooks.deliveries.enqueue_event` under a delivery id derived from the stream
entry. An event read twice (a crash before its ack) therefore makes one delivery, never two.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Any

import redis

from shared.batch_store import BatchStore
from shared.consumer import StreamConsumer, ensure_group
from shared.job_store import JobStore
from shared.keys import EVENTS_GROUP, Keys
from shared.openai_batch_store import OpenAIBatchStore
from shared.settings import Settings
from webhooks.deliveries import WebhookConfigError, enqueue_event

log = logging.getLogger(__name__)

READ_COUNT = 100
BLOCK_MS = 1000
CLAIM_IDLE_MS = 60_000  # events held this long by a webhook worker that died are taken over


def delivery_id_for(events_key: str, entry_id: str) -> str:
    """The webhook-id of an event: the same however often the event is processed."""
    return "msg_" + hashlib.sha256(f"{events_key}/{entry_id}".encode()).hexdigest()[:32]


class EventDispatcher:
    def __init__(self, settings: Settings, client: redis.Redis, consumer: str) -> None:
        self.settings = settings
        keys = Keys(settings.key_prefix)
        self.streams = {keys.events(settings.served_model): settings.served_model}
        self.consumer = StreamConsumer(client, EVENTS_GROUP, consumer)
        self.jobs = JobStore.from_settings(settings, client)
        self.batches = BatchStore.from_settings(settings, client)
        self.openai_batches = OpenAIBatchStore.from_settings(settings, client)
        self._stop = threading.Event()
        self._next_claim = 0.0

    def request_stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        """Dispatch until stopped; Redis outages and config errors are waited out."""
        recovering = True  # first the events this consumer read but never acked
        while not self._stop.is_set():
            try:
                if recovering:
                    for stream in self.streams:
                        ensure_group(self.consumer.client, stream, EVENTS_GROUP)
                    events = self._read(None, own_pending=True)
                    recovering = bool(events)
                else:
                    events = self._claim_abandoned() or self._read(BLOCK_MS)
                for stream, (entry_id, fields) in events:
                    self.dispatch(stream, entry_id, fields)
            except redis.RedisError as exc:
                log.warning("events: redis unavailable (%s); retrying", exc)
                recovering = True
                self._stop.wait(1)
            except WebhookConfigError as exc:
                log.error("events: cannot send webhooks: %s", exc)
                recovering = True  # keep them pending until the worker is fixed
                self._stop.wait(5)

    def dispatch(self, stream: str, entry_id: str, fields: dict[str, str]) -> None:
        """Make the event's delivery (once), then ack and delete the event. A batch made
        through /openai/v1 sends OpenAI's event instead (shared.openai_batches)."""
        model, delivery_id = self.streams[stream], delivery_id_for(stream, entry_id)
        event_type, envelope = fields["type"], None
        if fields["id"].startswith("batch_"):
            event_id = "evt_" + delivery_id.removeprefix("msg_")
            envelope = self.openai_batches.webhook_event(model, fields["id"], event_id)
        if envelope is not None:
            event_type, data = envelope["type"], envelope["data"]
        else:
            data = self._object(model, fields["id"])
        if data is None:
            log.warning("event %s: %s is gone; not sent", fields["type"], fields["id"])
        else:
            try:
                enqueue_event(
                    fields["url"], event_type, data, self.settings,
                    delivery_id=delivery_id, owner=fields["id"], check_url=False,
                    envelope=envelope,
                )  # fmt: skip
            except ValueError as exc:  # too big, or not JSON: it can never be sent
                log.error("event %s for %s not sent: %s", fields["type"], fields["id"], exc)
        self.consumer.ack(stream, [entry_id])

    def _object(self, model: str, object_id: str) -> dict[str, Any] | None:
        """The event's data: the job (without its input: GET it for that) or the batch."""
        if object_id.startswith("batch_"):
            batch = self.batches.get(model, object_id)
            return batch.model_dump(mode="json") if batch else None
        job = self.jobs.get(model, object_id)
        return job.model_dump(mode="json", exclude={"input"}) if job else None

    def _read(self, block_ms: int | None, *, own_pending: bool = False):
        return self.consumer.read(list(self.streams), READ_COUNT, block_ms, own_pending=own_pending)

    def _claim_abandoned(self) -> list[tuple[str, tuple[str, dict[str, str]]]]:
        now = time.monotonic()
        if now < self._next_claim:  # look a few times per CLAIM_IDLE_MS, not every read
            return []
        self._next_claim = now + CLAIM_IDLE_MS / 4000
        return [
            (stream, message)
            for stream in self.streams
            for message in self.consumer.claim_abandoned(stream, CLAIM_IDLE_MS, READ_COUNT)
        ]
