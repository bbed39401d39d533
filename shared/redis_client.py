"""The one way the fleet opens a Redis connection, with the same timeouts everywhere."""

from __future__ import annotations

import redis

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
