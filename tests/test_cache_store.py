"""The result cache and in-flight coalescing in the scripts, against a real Redis (no worker:
the consumer's calls are made here, as a worker makes them). What a whole fleet does with
them is tests/test_cache.py."""

from __future__ import annotations

import time
import uuid

import pytest
import redis

from shared.batch_store import BatchStore
from shared.cache import CachePolicy, CacheWrites, cacheable
from shared.job_consumer import DEADLINE_ERROR, JobConsumer
from shared.job_store import JobStore
from shared.keys import Keys
from shared.protocol import BatchOptions, BatchRequest, JobError, JobInput, Output, Usage
from shared.records import terminal_fields, webhook_fields
from shared.registry import WorkerRegistry
from shared.states import JobStatus
from shared.stats import QueueStats

MODEL = "m"
GREEDY = JobInput(prompt="same question", temperature=0.0, max_new_tokens=8)


class Cache:
    """The gateway's and a worker's roles over one client, with the cache on."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.redis, self.keys = client, keys
        self.store = JobStore(client, keys, result_ttl_s=60)
        self.batches = BatchStore(client, keys, result_ttl_s=60)
        self.consumer = JobConsumer(client, keys, result_ttl_s=60)
        self.consumer.cache_writes = CacheWrites("v1", 30, 1 << 20)
        self.stats = QueueStats(client, keys, result_ttl_s=60)
        WorkerRegistry(client, keys, 60).set_model_version(MODEL, "v1")

    def submit(self, job_input: JobInput = GREEDY, owner: str | None = "", **kwargs):
        return self.store.submit(MODEL, job_input, {}, cache_owner=owner, **kwargs)

    def run(self, fields: dict[str, str] | None = None):
        """A worker takes every queued entry, and finishes each with ``fields``."""
        entries = self.consumer.read_next(MODEL, "w", 100, None)
        started, dropped = self.consumer.start(MODEL, entries, "w")
        self.consumer.drop(MODEL, dropped)
        self.consumer.finish(MODEL, [(job.entry, fields or done()) for job in started])
        return started

    def counter(self, name: str) -> int:
        return int(self.stats.counters(MODEL).get(f"cache:{name}", 0))


@pytest.fixture
def cache(redis_url) -> Cache:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    c = Cache(client, Keys(f"t{uuid.uuid4().hex[:8]}"))
    c.consumer.ensure_groups(MODEL)
    return c


def done(text: str = "the answer") -> dict[str, str]:
    usage = Usage(prompt_tokens=3, completion_tokens=2)
    return terminal_fields(
        status=JobStatus.SUCCEEDED,
        output=Output(text=text, finish_reason="length", usage=usage),
        inference_seconds=0.5,
        batch_size=1,
    )


def failed() -> dict[str, str]:
    error = JobError(code="prompt_too_long", message="too long")
    return terminal_fields(status=JobStatus.FAILED, error=error)


def test_what_is_cacheable():
    assert cacheable(GREEDY)
    assert cacheable(JobInput(prompt="x", temperature=0.7, seed=1))
    assert not cacheable(JobInput(prompt="x", temperature=0.7))
    policy = CachePolicy(enabled=True, ttl_s=300, max_bytes=1 << 20, scope="key")
    assert policy.owner(GREEDY, wanted=True, api_key_id="key_a") == "key_a"
    assert policy.owner(GREEDY, wanted=False) is None
    global_ = CachePolicy(enabled=True, ttl_s=300, max_bytes=1 << 20, scope="global")
    assert global_.owner(GREEDY, wanted=True, api_key_id="key_a") == ""
    off = CachePolicy(enabled=False, ttl_s=300, max_bytes=1 << 20, scope="key")
    assert off.owner(GREEDY, wanted=True) is None


def test_hit_after_miss_is_a_succeeded_job_of_its_own(cache):
    first = cache.submit()
    assert first.cache == "miss" and first.job.status == JobStatus.QUEUED
    cache.run(done("forty-two"))
    hit = cache.store.submit(MODEL, GREEDY, {"mine": "yes"}, cache_owner="")
    assert hit.cache == "hit"
    job = hit.job
    assert job.id != first.job.id and job.status == JobStatus.SUCCEEDED
    assert job.output.text == "forty-two" and job.metadata == {"mine": "yes"}
    assert job.metrics.cache_hit and job.metrics.queue_seconds == 0
    assert job.metrics.inference_seconds == 0
    assert (cache.counter("hits"), cache.counter("misses")) == (1, 1)
    assert cache.counter("bytes") > len("forty-two")


def test_no_hit_across_owners_versions_or_fields(cache):
    cache.submit(owner="key_a")
    cache.run()
    assert cache.submit(owner="key_b").cache == "miss"  # another key's result is not served
    cache.run()
    assert cache.submit(owner="key_a").cache == "hit"
    changed = GREEDY.model_copy(update={"max_new_tokens": 9})
    assert cache.submit(changed, owner="key_a").cache == "miss"
    cache.run()
    WorkerRegistry(cache.redis, cache.keys, 60).set_model_version(MODEL, "v2")
    assert cache.submit(owner="key_a").cache == "miss"  # a new model version
    assert cache.submit(owner=None).cache == ""  # opted out: queued like any job


def test_followers_end_with_their_leader_and_it_runs_once(cache):
    leader = cache.submit(extra={"stream": "1"})
    followers = [cache.submit(extra={"stream": "1"}) for _ in range(5)]
    assert {f.cache for f in followers} == {"coalesced"}
    assert cache.redis.xlen(cache.keys.stream(MODEL)) == 1  # one entry for all six
    [started] = cache.run(done("shared"))
    assert started.entry.job_id == leader.job.id
    for f in followers:
        job = cache.store.get(MODEL, f.job.id)
        assert job.status == JobStatus.SUCCEEDED and job.output.text == "shared"
        assert job.metrics.coalesced and job.worker == "w"
        tokens = cache.redis.xrange(cache.keys.tokens(MODEL, f.job.id))
        assert [t["type"] for _, t in tokens] == ["token", "end"]
        assert tokens[0][1]["delta"] == "shared"
    assert cache.counter("coalesced") == 5
    assert cache.submit().cache == "hit"


def test_followers_that_join_a_running_job_run_with_it(cache):
    leader = cache.submit()
    entries = cache.consumer.read_next(MODEL, "w", 10, None)
    cache.consumer.start(MODEL, entries, "w")
    late = cache.submit()
    assert late.cache == "coalesced" and late.job.status == JobStatus.RUNNING
    cache.consumer.finish(MODEL, [(entries[0], done())])
    assert cache.store.get(MODEL, late.job.id).status == JobStatus.SUCCEEDED
    assert cache.store.get(MODEL, leader.job.id).status == JobStatus.SUCCEEDED


@pytest.mark.parametrize("started", [False, True], ids=["queued", "running"])
def test_canceling_the_leader_leaves_its_followers_running(cache, started):
    leader = cache.submit()
    follower = cache.submit()
    if started:
        entries = cache.consumer.read_next(MODEL, "w", 10, None)
        cache.consumer.start(MODEL, entries, "w")
    canceled = cache.store.cancel(MODEL, leader.job.id)
    assert canceled.status == JobStatus.CANCELED  # at once, for its own client
    assert not cache.consumer.cancel_requested(MODEL, [leader.job.id])  # its work goes on
    assert cache.submit().cache == "coalesced"  # and others may still join it
    if started:
        cache.consumer.finish(MODEL, [(entries[0], done())])
    else:
        assert [j.entry.job_id for j in cache.run()] == [leader.job.id]
    assert cache.store.get(MODEL, follower.job.id).status == JobStatus.SUCCEEDED
    assert cache.store.get(MODEL, leader.job.id).status == JobStatus.CANCELED
    assert cache.submit().cache == "hit"


def test_work_nobody_wants_stops(cache):
    """The leader's client left, then every follower's: its worker is asked to stop, and no
    new request joins it."""
    leader = cache.submit()
    follower = cache.submit()
    entries = cache.consumer.read_next(MODEL, "w", 10, None)
    cache.consumer.start(MODEL, entries, "w")
    cache.store.cancel(MODEL, leader.job.id)
    assert cache.store.cancel(MODEL, follower.job.id).status == JobStatus.CANCELED
    assert cache.consumer.cancel_requested(MODEL, [leader.job.id]) == {leader.job.id}
    assert cache.submit().cache == "miss"


def test_a_queued_leader_nobody_wants_never_runs(cache):
    leader = cache.submit()
    follower = cache.submit()
    cache.store.cancel(MODEL, leader.job.id)
    cache.store.cancel(MODEL, follower.job.id)
    assert cache.run() == []


def test_a_failed_leader_fails_its_followers_and_is_not_cached(cache):
    cache.submit()
    follower = cache.submit()
    cache.run(failed())
    job = cache.store.get(MODEL, follower.job.id)
    assert job.status == JobStatus.FAILED and job.error.code == "prompt_too_long"
    assert cache.submit().cache == "miss"


def test_a_dead_lettered_leader_fails_its_followers(cache):
    cache.submit()
    follower = cache.submit()
    [entry] = cache.consumer.read_next(MODEL, "w", 10, None)
    cache.consumer.start(MODEL, [entry], "w")
    cache.consumer.dead_letter(MODEL, entry, times_delivered=4)
    assert cache.store.get(MODEL, follower.job.id).error.code == "worker_crashed"
    assert cache.submit().cache == "miss"


def test_a_follower_past_its_deadline_expires_alone(cache):
    leader = cache.submit()
    follower = cache.submit(timeout_s=0.01)
    time.sleep(0.05)
    job = cache.store.get(MODEL, follower.job.id)  # a queued job past its deadline expires
    assert job.status == JobStatus.EXPIRED and job.error.code == DEADLINE_ERROR.code
    cache.run()
    assert cache.store.get(MODEL, leader.job.id).status == JobStatus.SUCCEEDED


def test_size_bound_evicts_the_soonest_to_expire(cache):
    cache.consumer.cache_writes = CacheWrites("v1", 30, 2000)
    for i in range(8):
        cache.submit(JobInput(prompt=f"q{i}", temperature=0.0))
        cache.run(done("x" * 300))
    assert cache.counter("evictions") >= 4
    assert cache.counter("bytes") <= 2000
    assert cache.submit(JobInput(prompt="q0", temperature=0.0)).cache == "miss"  # evicted
    assert cache.submit(JobInput(prompt="q7", temperature=0.0)).cache == "hit"


def test_a_cached_result_expires(cache):
    cache.consumer.cache_writes = CacheWrites("v1", 1, 1 << 20)
    cache.submit()
    cache.run()
    assert cache.submit().cache == "hit"
    time.sleep(1.2)
    assert cache.submit().cache == "miss"


def test_a_batch_computes_each_distinct_line_once(cache):
    requests = [
        BatchRequest(custom_id=str(i), prompt=f"q{i % 3}", temperature=0.0) for i in range(9)
    ]
    batch = cache.batches.create(MODEL, requests, BatchOptions(), cache_owners=[""] * 9).batch
    assert len(cache.run()) == 3
    assert cache.batches.get(MODEL, batch.id).request_counts.completed == 9
    again = cache.batches.create(MODEL, requests, BatchOptions(), cache_owners=[""] * 9).batch
    assert again.status == "completed"  # every line was cached
    assert cache.run() == []


def test_hits_and_followers_send_their_own_webhook_events(cache):
    hooks = webhook_fields("https://example.com/hook", ["job.started", "job.completed"])
    leader = cache.submit()
    follower = cache.submit(extra=hooks)
    cache.run()
    hit = cache.submit(extra=hooks)
    assert hit.cache == "hit"
    events = [(e["type"], e["id"]) for _, e in cache.redis.xrange(cache.keys.events(MODEL))]
    assert events == [
        ("job.started", follower.job.id),
        ("job.completed", follower.job.id),
        ("job.completed", hit.job.id),
    ]
    assert leader.job.id not in {job_id for _, job_id in events}  # it asked for none
