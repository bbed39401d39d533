"""The one way the fleet opens a Redis connection (the same timeouts everywhere), and the
base of the classes that use it."""

from __future__ import annotations

from typing import Self

import redis

from shared.keys import Keys
from shared.settings import Settings


def connect(settings: Settings, **overrides) -> redis.Redis:
    options = dict(
        decode_responses=True,
        socket_connect_timeout=2,
        socket_timeout=10,
        health_check_interval=15,
        retry_on_timeout=False,
    )
    options.update(overrides)
    return redis.Redis.from_url(settings.effective_redis_url, **options)


class FleetRedis:
    """Base of each class that owns one role over the fleet's keys (the job store, the
    stream consumer, the stats...): a client, the key scheme and the result TTL."""

    def __init__(self, client: redis.Redis, keys: Keys, result_ttl_s: int) -> None:
        self.redis = client
        self.keys = keys
        self.result_ttl_s = result_ttl_s

    @classmethod
    def from_settings(cls, settings: Settings, client: redis.Redis | None = None) -> Self:
        """The one way to build one: a new connection pool unless ``client`` is given."""
        return cls(client or connect(settings), Keys(settings.key_prefix), settings.result_ttl_s)
