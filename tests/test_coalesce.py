"""Coalesced script calls against a real Redis: each caller gets its own reply or error,
also when many call at once and when Redis has lost its scripts."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from shared.coalesce import Coalescer, ScriptOp

ECHO = "redis.call('INCR', KEYS[1]); if ARGV[1] == 'boom' then error('boom') end; return ARGV[1]"


@pytest.fixture
def client(redis_url) -> redis.Redis:
    return redis.Redis.from_url(redis_url, decode_responses=True)


def test_each_concurrent_caller_gets_its_own_reply(client):
    key = f"co-{uuid.uuid4().hex}"
    call = Coalescer(client).script(client.register_script(ECHO))
    with ThreadPoolExecutor(32) as pool:
        replies = list(pool.map(lambda i: call([key], [str(i)]), range(500)))
    assert replies == [str(i) for i in range(500)]
    assert client.get(key) == "500"


def test_an_error_reaches_only_its_own_caller(client):
    key = f"co-{uuid.uuid4().hex}"
    call = Coalescer(client).script(client.register_script(ECHO))

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
    call = Coalescer(client).script(client.register_script(ECHO))
    assert call([key], ["first"]) == "first"
    client.script_flush()  # as after a Redis restart without persistence
    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda i: call([key], [str(i)]), range(64)))
    assert replies == [str(i) for i in range(64)]


def test_calls_of_several_commands_and_scripts_get_their_own_replies_in_order(client):
    key, table = f"co-{uuid.uuid4().hex}", f"co-{uuid.uuid4().hex}"
    client.hset(table, mapping={"a": "1"})
    coalescer = Coalescer(client)
    echo = client.register_script(ECHO)

    def one(i: int) -> list:
        ops = [("INCRBY", key, 0), ScriptOp(echo, [key], [str(i)]), ("HGETALL", table)]
        return coalescer.run(ops)

    with ThreadPoolExecutor(32) as pool:
        replies = list(pool.map(one, range(300)))
    assert [r[1] for r in replies] == [str(i) for i in range(300)]
    assert all(r[2] == {"a": "1"} for r in replies)  # each reply parsed as its command's
    assert sorted(int(r[0]) for r in replies) == list(range(300))  # INCRBY 0 saw each INCR
    with pytest.raises(redis.ResponseError):
        coalescer.run([ScriptOp(echo, [key], ["boom"]), ("GET", key)])
