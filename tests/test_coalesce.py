"""Coalesced script calls against a real Redis: each caller gets its own reply or error,
also when many call at once and when Redis has lost its scripts."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from shared.coalesce import ScriptCoalescer

ECHO = "redis.call('INCR', KEYS[1]); if ARGV[1] == 'boom' then error('boom') end; return ARGV[1]"


@pytest.fixture
def client(redis_url) -> redis.Redis:
    return redis.Redis.from_url(redis_url, decode_responses=True)


def test_each_concurrent_caller_gets_its_own_reply(client):
    key = f"co-{uuid.uuid4().hex}"
    call = ScriptCoalescer(client, client.register_script(ECHO))
    with ThreadPoolExecutor(32) as pool:
        replies = list(pool.map(lambda i: call([key], [str(i)]), range(500)))
    assert replies == [str(i) for i in range(500)]
    assert client.get(key) == "500"


def test_an_error_reaches_only_its_own_caller(client):
    key = f"co-{uuid.uuid4().hex}"
    call = ScriptCoalescer(client, client.register_script(ECHO))

    def one(i: int) -> str:
        try:
            return call([key], ["boom" if i % 7 == 0 else str(i)])
        except redis.ResponseError:
            return "error"

    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(one, range(100)))
    assert replies == ["error" if i % 7 == 0 else str(i) for i in range(100)]


def test_scripts_lost_by_redis_are_loaded_again(client):
    key = f"co-{uuid.uuid4().hex}"
    call = ScriptCoalescer(client, client.register_script(ECHO))
    assert call([key], ["first"]) == "first"
    client.script_flush()  # as after a Redis restart without persistence
    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda i: call([key], [str(i)]), range(64)))
    assert replies == [str(i) for i in range(64)]
