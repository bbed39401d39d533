"""Webhook deliveries in Redis: the record, its attempts, and the claim on each attempt.

A delivery is a hash ``P:webhook:{id}`` (the exact body sent, its state, how many attempts
were made) and a list ``P:webhook-attempts:{id}`` of one JSON object per attempt. Every
attempt is first claimed (one script), so a Celery message delivered twice (a restored
unacked message, a duplicated retry) never makes two requests for the same attempt
(``webhook_claim.lua``); a delivery is created once (``webhook_create.lua``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import redis

from shared.keys import Keys
from shared.records import timestamp
from shared.scripts import load, pairs
from shared.states import DeliveryState


@dataclass(frozen=True)
class Claimed:
    """What an attempt needs, read in the same step that claimed it."""

    delivery_id: str
    url: str
    payload: str
    created_at: float


class DeliveryStore:
    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.redis = client
        self.keys = keys
        self._claim = load(client, "webhook_claim")
        self._create = load(client, "webhook_create")

    def create(
        self,
        delivery_id: str,
        url: str,
        event_type: str,
        payload: str,
        ttl_s: float,
        owner: str | None = None,
    ) -> bool:
        """Store a new delivery (listed under its owner, a job or batch id); False if one
        with this id exists already, so an event processed twice is delivered once."""
        record = {
            "id": delivery_id,
            "url": url,
            "type": event_type,
            "payload": payload,
            "state": DeliveryState.PENDING.value,
            "created_at": repr(time.time()),
            "attempts": "0",
        }
        keys = [self.keys.webhook(delivery_id)]
        if owner:
            keys.append(self.keys.webhook_owner(owner))
        return self._create(keys=keys, args=[_seconds(ttl_s), *pairs(record)]) == "created"

    def owned_by(self, owner: str) -> list[str]:
        """Ids of the deliveries about one job or batch, oldest first."""
        return self.redis.lrange(self.keys.webhook_owner(owner), 0, -1)

    def claim(self, delivery_id: str, attempt: int, lease_s: float) -> Claimed | None:
        found = self._claim(
            keys=[self.keys.webhook(delivery_id)], args=[attempt, repr(time.time()), lease_s]
        )
        if not found:
            return None
        url, payload, created_at = found
        return Claimed(delivery_id, url, payload, float(created_at))

    def record_attempt(
        self,
        delivery_id: str,
        attempt: dict[str, Any],
        state: DeliveryState,
        next_retry_at: float | None,
        error: str | None,
        ttl_s: float,
    ) -> None:
        """Append the attempt and set the delivery's state, in one transaction."""
        key, attempts_key = self.keys.webhook(delivery_id), self.keys.webhook_attempts(delivery_id)
        fields = {
            "attempts": str(attempt["attempt"]),
            "state": state.value,
            "next_retry_at": repr(next_retry_at) if next_retry_at is not None else "",
            "error": error or "",
        }
        if state is not DeliveryState.PENDING:
            fields["ended_at"] = repr(time.time())
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.rpush(attempts_key, json.dumps(attempt))
            pipe.hset(key, mapping=fields)
            pipe.expire(key, _seconds(ttl_s))
            pipe.expire(attempts_key, _seconds(ttl_s))
            pipe.execute()

    def read(self, delivery_ids: list[str]) -> list[dict[str, Any] | None]:
        """Each delivery as the API shows it (None for an unknown or expired id)."""
        with self.redis.pipeline(transaction=False) as pipe:
            for delivery_id in delivery_ids:
                pipe.hgetall(self.keys.webhook(delivery_id))
                pipe.lrange(self.keys.webhook_attempts(delivery_id), 0, -1)
            replies = pipe.execute()
        return [
            view(record, attempts) if record else None
            for record, attempts in zip(replies[::2], replies[1::2], strict=True)
        ]


def view(record: dict[str, str], attempts: list[str]) -> dict[str, Any]:
    """The delivery object: its state, and every attempt with its outcome and next retry."""

    return {
        "id": record["id"],
        "object": "webhook_delivery",
        "url": record["url"],
        "type": record["type"],
        "state": record["state"],
        "created_at": timestamp(record, "created_at"),
        "ended_at": timestamp(record, "ended_at"),
        "next_retry_at": timestamp(record, "next_retry_at"),
        "error": record.get("error") or None,
        "attempts": [json.loads(a) for a in attempts],
    }


def _seconds(ttl_s: float) -> int:
    return max(1, int(ttl_s + 0.999))
