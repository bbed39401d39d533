"""Per-key limits against a real Redis: the coalesced checks count exactly as the `limits`
library's own strategy does, refuse past the quota, and give tokens back; the scripts'
per-key cap on unfinished jobs and their refunds of unused tokens."""

from __future__ import annotations

import time
import uuid

import pytest
import redis
from limits import RateLimitItemPerMinute

from gateway.rate_limits import RateLimited, RateLimits, TokenRefunds, headers
from shared.api_keys import ApiKeyStore
from shared.coalesce import Coalescer
from shared.job_store import JobStore, OwnerQueueFull
from shared.keys import Keys
from shared.protocol import JobInput
from shared.settings import Settings

MODEL = "demo/limits"


@pytest.fixture
def setup(redis_url):
    prefix = f"rl-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    settings = Settings(redis_url=redis_url, key_prefix=prefix)
    keys = Keys(prefix)
    limits = RateLimits(client, keys, settings, Coalescer(client))
    return limits, ApiKeyStore(client, keys, 60), client, keys


def same_reset(ours: int, library_s: float) -> bool:
    """Equal to the second, or a whole window apart: at a window's exact start the library's
    remainder wraps to 0 (``ttl % expiry``), where ours says the whole window."""
    return min(abs(ours - library_s), abs(abs(ours - library_s) - 60)) <= 1


def library_stats(limits: RateLimits, limit: int, key_id: str, policy: str) -> tuple[int, float]:
    reset, remaining = limits.limiter.get_window_stats(
        RateLimitItemPerMinute(limit), key_id, policy
    )
    return remaining, reset - time.time()


def test_requests_count_down_to_a_429_as_the_library_counts(setup):
    limits, store, _, _ = setup
    key = store.create("a", rpm=5).key
    standings = [limits.request(key) for _ in range(5)]
    assert [s.remaining for s in standings] == [4, 3, 2, 1, 0]
    remaining, reset_in = library_stats(limits, 5, key.id, "requests")
    assert remaining == 0 and same_reset(standings[-1].reset_s, reset_in)
    with pytest.raises(RateLimited) as refused:
        limits.request(key)
    assert refused.value.policy == "requests" and 1 <= refused.value.retry_after_s <= 60
    other = store.create("b", rpm=5).key
    assert limits.request(other).remaining == 4  # a counter of its own
    assert headers(standings[-1:]) == {
        "RateLimit-Policy": '"requests";q=5;w=60',
        "RateLimit": f'"requests";r=0;t={standings[-1].reset_s}',
    }


def test_after_the_window_moves_the_previous_one_is_weighted_as_the_library_does(setup):
    limits, store, client, keys = setup
    key = store.create("w", tpm=1000).key
    limits.tokens(key, 600)
    # As if 30 s passed: the current window's TTL drops below the window, so the next check
    # shifts it to the previous window (weighted by the time it has left).
    [current] = [k for k in client.keys(keys.rate_limits_prefix() + "*") if not k.endswith("/-1")]
    client.pexpire(current, 30_000)
    standing = limits.tokens(key, 100)
    remaining, reset_in = library_stats(limits, 1000, key.id, "tokens")
    # 1000 - 600 x (its time left: about half) - 100; read a moment apart, the weighted
    # count may have slipped by one
    assert abs(standing.remaining - remaining) <= 1 and 590 < remaining <= 601
    assert same_reset(standing.reset_s, reset_in)


def test_a_cost_over_the_whole_quota_never_fits_and_tokens_come_back(setup):
    limits, store, client, keys = setup
    key = store.create("t", tpm=100).key
    with pytest.raises(RateLimited) as never:
        limits.tokens(key, 101)
    assert never.value.retry_after_s == -1
    assert limits.tokens(key, 80).remaining == 20
    with pytest.raises(RateLimited):
        limits.tokens(key, 30)
    # What an ended job did not generate, as lib.lua queues it; applied once, by one gateway.
    client.rpush(keys.token_refunds(MODEL), f"{key.id} 50")
    refunds = TokenRefunds(client, keys, [MODEL], store, limits)
    assert refunds.apply_once() == 50 and refunds.apply_once() == 0
    assert limits.tokens(key, 30).remaining == 40
    assert limits.tokens(store.create("none").key, 10**9) is None  # no limit: not counted


def test_the_queue_cap_and_refunds_in_the_scripts(setup):
    _, _, client, keys = setup
    jobs = JobStore(client, keys, 60)
    job = JobInput(prompt="cap", max_new_tokens=40)
    owned = {"owner": "key_x", "queue_cap": 2, "charged_tokens": 40}
    first, second = (jobs.submit(MODEL, job, {}, **owned).job for _ in range(2))
    with pytest.raises(OwnerQueueFull) as full:
        jobs.submit(MODEL, job, {}, **owned)
    assert full.value.unfinished == 2
    assert jobs.submit(MODEL, job, {}, owner="key_y", queue_cap=2).job  # another key
    jobs.cancel(MODEL, first.id)  # ended: out of the cap, its 40 tokens owed back, once
    assert client.lrange(keys.token_refunds(MODEL), 0, -1) == ["key_x 40"]
    assert client.hget(keys.job(MODEL, first.id), "charged") is None
    third = jobs.submit(MODEL, job, {}, **owned).job
    # A member whose record is gone (expired) is pruned when the cap is reached.
    client.delete(keys.job(MODEL, second.id))
    assert jobs.submit(MODEL, job, {}, **owned).job
    assert client.smembers(keys.owner_active(MODEL, "key_x")) >= {third.id}
    assert jobs.get(MODEL, third.id, owner="key_y") is None  # another key's: not found
    assert jobs.get(MODEL, third.id, owner="key_x") and jobs.get(MODEL, third.id)
