"""Turns the events outbox into webhook deliveries, in the webhook worker.

The scripts that change a job or batch append ``{type, id, url}`` to the events stream in
the same atomic step (see :mod:`shared.scripts`). This loop reads them (consumer group
``webhooks``), builds each payload from the job or batch as it stands, and hands it to
:func:`webhooks.api.enqueue_event` under a delivery id derived from the stream entry. An
event read twice (a crash before its ack) therefore makes one delivery, never two.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Any

import redis

from shared.batch_queue import BatchQueue
from shared.jobs import EVENTS_GROUP, Keys
from shared.queue import JobQueue
from shared.settings import Settings
from webhooks.api import WebhookConfigError, enqueue_event

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
        self.redis = client
        self.consumer = consumer
        keys = Keys(settings.key_prefix)
        self.stream = keys.events()
        self.jobs = JobQueue(client, keys, settings.result_ttl_s)
        self.batches = BatchQueue(self.jobs)
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
                    self._ensure_group()
                    entries = self._read("0", None)
                    recovering = bool(entries)
                else:
                    entries = self._claim_abandoned() or self._read(">", BLOCK_MS)
                for entry_id, fields in entries:
                    self.dispatch(entry_id, fields)
            except redis.RedisError as exc:
                log.warning("events: redis unavailable (%s); retrying", exc)
                recovering = True
                self._stop.wait(1)
            except WebhookConfigError as exc:
                log.error("events: cannot send webhooks: %s", exc)
                recovering = True  # keep them pending until the worker is fixed
                self._stop.wait(5)

    def dispatch(self, entry_id: str, fields: dict[str, str]) -> None:
        """Make the event's delivery (once), then ack and delete the event."""
        if fields:
            data = self._object(fields["id"])
            if data is None:
                log.warning("event %s: %s is gone; not sent", fields["type"], fields["id"])
            else:
                try:
                    enqueue_event(
                        fields["url"], fields["type"], data, self.settings,
                        delivery_id=delivery_id_for(self.stream, entry_id),
                        owner=fields["id"], check_url=False,
                    )  # fmt: skip
                except ValueError as exc:  # too big, or not JSON: it can never be sent
                    log.error("event %s for %s not sent: %s", fields["type"], fields["id"], exc)
        pipe = self.redis.pipeline(transaction=True)
        pipe.xack(self.stream, EVENTS_GROUP, entry_id)
        pipe.xdel(self.stream, entry_id)
        pipe.execute()

    def _object(self, object_id: str) -> dict[str, Any] | None:
        """The event's data: the job (without its input: GET it for that) or the batch."""
        if object_id.startswith("batch_"):
            batch = self.batches.get(object_id)
            return batch.model_dump(mode="json") if batch else None
        job = self.jobs.get(object_id)
        return job.model_dump(mode="json", exclude={"input"}) if job else None

    def _ensure_group(self) -> None:
        try:
            self.redis.xgroup_create(self.stream, EVENTS_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def _read(self, start: str, block_ms: int | None) -> list[tuple[str, dict[str, str]]]:
        reply = self.redis.xreadgroup(
            EVENTS_GROUP, self.consumer, {self.stream: start}, count=READ_COUNT, block=block_ms
        )
        return [entry for _stream, entries in reply or [] for entry in entries]

    def _claim_abandoned(self) -> list[tuple[str, dict[str, str]]]:
        now = time.monotonic()
        if now < self._next_claim:  # look a few times per CLAIM_IDLE_MS, not every read
            return []
        self._next_claim = now + CLAIM_IDLE_MS / 4000
        reply = self.redis.xautoclaim(
            self.stream, EVENTS_GROUP, self.consumer, CLAIM_IDLE_MS, "0-0", count=READ_COUNT
        )
        return reply[1]
