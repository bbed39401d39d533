"""Webhook deliveries in Redis: the record, its attempts, and the claim on each attempt.

A delivery is a hash ``P:webhook:{id}`` (the exact body sent, its state, how many attempts
were made) and a list ``P:webhook-attempts:{id}`` of one JSON object per attempt. Every
attempt is first claimed (one script), so a Celery message delivered twice (a restored
unacked message, a duplicated retry) never makes two requests for the same attempt.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import redis

from shared.jobs import Keys, rfc3339


class State(StrEnum):
    PENDING = "pending"  # an attempt is due or running
    DELIVERED = "delivered"  # a 2xx answer
    FAILED = "failed"  # retries exhausted, a 4xx/3xx answer, or the URL was refused
    GONE = "gone"  # the receiver answered 410: do not send there again


@dataclass(frozen=True)
class Claimed:
    """What an attempt needs, read in the same step that claimed it."""

    delivery_id: str
    url: str
    payload: str
    created_at: float


# KEYS[1] delivery hash; ARGV attempt number, now, lease seconds. Returns {url, payload,
# created_at} when this attempt may run now, else nil: the delivery ended, the attempt
# was already made, or another copy of the message claimed it less than a lease ago.
CLAIM = """
local rec = KEYS[1]
local attempt, now, lease = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if redis.call('HGET', rec, 'state') ~= 'pending' then return nil end
if tonumber(redis.call('HGET', rec, 'attempts') or '0') ~= attempt - 1 then return nil end
local claimed = tonumber(redis.call('HGET', rec, 'claimed') or '0')
local claimed_at = tonumber(redis.call('HGET', rec, 'claimed_at') or '0')
if claimed == attempt and claimed_at > now - lease then return nil end
redis.call('HSET', rec, 'claimed', attempt, 'claimed_at', ARGV[2])
return redis.call('HMGET', rec, 'url', 'payload', 'created_at')
"""


# KEYS[1] delivery hash, KEYS[2] owner's delivery list ("" when none); ARGV ttl, field,
# value, ... Creates the delivery once: returns 1 if created, 0 if it already existed.
CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
if KEYS[2] ~= '' then
  redis.call('RPUSH', KEYS[2], redis.call('HGET', KEYS[1], 'id'))
  redis.call('EXPIRE', KEYS[2], ARGV[1])
end
return 1
"""


class DeliveryStore:
    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.redis = client
        self.keys = keys
        self._claim = client.register_script(CLAIM)
        self._create = client.register_script(CREATE)

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
            "state": State.PENDING.value,
            "created_at": repr(time.time()),
            "attempts": "0",
        }
        owner_key = self.keys.webhook_owner(owner) if owner else ""
        args = [_seconds(ttl_s), *(item for pair in record.items() for item in pair)]
        return bool(self._create(keys=[self.keys.webhook(delivery_id), owner_key], args=args))

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
        state: State,
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
        if state is not State.PENDING:
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

    def ts(name: str) -> str | None:
        value = record.get(name)
        return rfc3339(float(value)) if value else None

    return {
        "id": record["id"],
        "object": "webhook_delivery",
        "url": record["url"],
        "type": record["type"],
        "state": record["state"],
        "created_at": ts("created_at"),
        "ended_at": ts("ended_at"),
        "next_retry_at": ts("next_retry_at"),
        "error": record.get("error") or None,
        "attempts": [json.loads(a) for a in attempts],
    }


def _seconds(ttl_s: float) -> int:
    return max(1, int(ttl_s + 0.999))
