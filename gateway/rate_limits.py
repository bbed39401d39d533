"""Per-key requests and generated tokens per minute, shared by every gateway process and
replica through Redis.

The counting is the `limits` library's sliding-window counter (its scripts and keys, in
Redis under ``P:limits``); each check is coalesced with other requests' Redis calls. A
job is charged its ``max_new_tokens`` when it is submitted; when it ends, ``ended()`` in
``lib.lua`` queues what it did not generate on the model's ``token-refunds`` list, and
:class:`TokenRefunds` gives it back (a hit of negative cost: the counters are INCRBY).
Answers carry the ``RateLimit-Policy`` and ``RateLimit`` headers of the IETF draft
(draft-ietf-httpapi-ratelimit-headers-11), e.g.
``RateLimit-Policy: "requests";q=600;w=60, "tokens";q=200000;w=60`` and
``RateLimit: "requests";r=598;t=12``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass
from math import inf

import redis
from limits import RateLimitItemPerMinute
from limits.storage import RedisStorage
from limits.strategies import SlidingWindowCounterRateLimiter

from shared.api_keys import ApiKey, ApiKeyStore
from shared.coalesce import Coalescer, ScriptOp
from shared.keys import Keys
from shared.settings import Settings

log = logging.getLogger(__name__)
WINDOW_S = 60


class RateLimited(Exception):
    def __init__(self, policy: str, limit: int, retry_after_s: int) -> None:
        super().__init__(policy)
        self.policy, self.limit, self.retry_after_s = policy, limit, retry_after_s


@dataclass
class Standing:
    """Where one policy of a key stands after a request: for the RateLimit headers."""

    policy: str
    quota: int
    remaining: int
    reset_s: int

    def policy_item(self) -> str:
        return f'"{self.policy}";q={self.quota};w={WINDOW_S}'

    def item(self) -> str:
        return f'"{self.policy}";r={self.remaining};t={self.reset_s}'


def headers(standings: list[Standing]) -> dict[str, str]:
    if not standings:
        return {}
    return {
        "RateLimit-Policy": ", ".join(s.policy_item() for s in standings),
        "RateLimit": ", ".join(s.item() for s in standings),
    }


class RateLimits:
    """Counting is the library's: its sliding-window scripts on its keys. Only the calling
    is ours: a check (take, then read the window for the headers) goes out as one call of
    the gateway's :class:`~shared.coalesce.Coalescer`, so that under load many requests'
    checks share a round trip instead of paying two each."""

    def __init__(
        self, client: redis.Redis, keys: Keys, settings: Settings, coalescer: Coalescer
    ) -> None:
        self.storage = RedisStorage(
            settings.effective_redis_url,
            connection_pool=client.connection_pool,
            key_prefix=keys.rate_limits_prefix(),
        )
        self.limiter = SlidingWindowCounterRateLimiter(self.storage)
        self.coalescer = coalescer
        self.default_rpm = settings.key_rpm
        self.default_tpm = settings.key_tpm

    def rpm(self, key: ApiKey) -> int:
        return self.default_rpm if key.rpm is None else key.rpm

    def tpm(self, key: ApiKey) -> int:
        return self.default_tpm if key.tpm is None else key.tpm

    def request(self, key: ApiKey) -> Standing | None:
        """Count one request against the key's requests per minute; RateLimited past it."""
        return self._take("requests", self.rpm(key), key.id, 1)

    def tokens(self, key: ApiKey, tokens: int) -> Standing | None:
        """Charge ``tokens`` to the key's tokens per minute; RateLimited past it (nothing is
        charged then)."""
        return self._take("tokens", self.tpm(key), key.id, tokens)

    def give_back(self, key: ApiKey, tokens: int) -> None:
        limit = self.tpm(key)
        if limit and tokens > 0:
            self.limiter.hit(RateLimitItemPerMinute(limit), key.id, "tokens", cost=-tokens)

    def _take(self, policy: str, limit: int, key_id: str, cost: int) -> Standing | None:
        if not limit:
            return None
        item = RateLimitItemPerMinute(limit)
        name = item.key_for(key_id, policy)
        # The keys and scripts SlidingWindowCounterRateLimiter.hit / get_window_stats use.
        windows = [
            self.storage.prefixed_key(self.storage._previous_window_key(name)),
            self.storage.prefixed_key(self.storage._current_window_key(name)),
        ]
        expiry = item.get_expiry()
        taken, window = self.coalescer.run([
            ScriptOp(self.storage.lua_acquire_sliding_window, windows, [limit, expiry, cost]),
            ScriptOp(self.storage.lua_sliding_window, windows, [expiry]),
        ])  # fmt: skip
        remaining, reset_s = window_stats(limit, expiry, window)
        if not taken:
            # A cost over the whole quota never fits: say so rather than "retry later".
            raise RateLimited(policy, limit, reset_s if cost <= limit else -1)
        return Standing(policy, limit, remaining, reset_s)


def window_stats(limit: int, expiry: int, window: list) -> tuple[int, int]:
    """(remaining, seconds to the next reset) from the sliding-window script's reply, as
    SlidingWindowCounterRateLimiter.get_window_stats computes them (tests/test_rate_limits.py
    holds the two equal)."""
    previous, previous_ttl = max(0, int(window[0] or 0)), max(0.0, float(window[1] or 0)) / 1000
    current, current_ttl = max(0, int(window[2] or 0)), max(0.0, float(window[3] or 0)) / 1000
    remaining = max(0, limit - math.floor(previous * previous_ttl / expiry + current))
    resets = [inf]
    if previous:
        resets.append(previous_ttl % (expiry / previous))
    if current:
        # A window just made has 2 x expiry to live: its remainder 0 is a whole window.
        resets.append(current_ttl % expiry or expiry)
    reset = min(resets) if previous or current else 0.0
    return remaining, max(1, math.ceil(reset))


class TokenRefunds:
    """Gives back, every second, the tokens per minute that ended jobs did not use. Each
    gateway process runs one; LPOP hands every refund to exactly one of them."""

    EVERY_S = 1.0
    BATCH = 500

    def __init__(
        self, client: redis.Redis, keys: Keys, models: list[str], store: ApiKeyStore,
        limits: RateLimits,
    ) -> None:  # fmt: skip
        self.redis, self.keys, self.models = client, keys, models
        self.store, self.limits = store, limits
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def ensure_running(self) -> None:
        """Start on first use, in the serving process (not before gunicorn forks)."""
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="token-refunds", daemon=True
                    )
                    self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self.apply_once()
            except redis.RedisError as exc:
                log.warning("token refunds: %s", exc)
            time.sleep(self.EVERY_S)

    def apply_once(self) -> int:
        """Apply the queued refunds; how many there were."""
        owed: Counter[str] = Counter()
        for model in self.models:
            for entry in self.redis.lpop(self.keys.token_refunds(model), self.BATCH) or []:
                owner, _, tokens = entry.partition(" ")
                owed[owner] += int(tokens)
        for owner, tokens in owed.items():
            key = self.store.get(owner)
            if key is not None:  # a revoked key has nothing to give back to
                self.limits.give_back(key, tokens)
        return sum(owed.values())
