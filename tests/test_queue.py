"""The job store, consumer and stats against a real Redis: atomic submit, store-then-ack, no
trimming of unread entries."""

from __future__ import annotations

import uuid

import pytest
import redis

from shared.job_consumer import JobConsumer
from shared.job_store import JobStore
from shared.keys import JOBS_GROUP, Keys
from shared.protocol import JobInput, Output, Usage
from shared.records import terminal_fields
from shared.states import JobStatus
from shared.stats import QueueStats

MODEL = "m"


class Queue:
    """The job queue's roles over one client, as the gateway and a worker hold them."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.redis, self.keys = client, keys
        self.store = JobStore(client, keys, result_ttl_s=60)
        self.consumer = JobConsumer(client, keys, result_ttl_s=60)
        self.stats = QueueStats(client, keys, result_ttl_s=60)


@pytest.fixture
def queue(redis_url) -> Queue:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    q = Queue(client, Keys(f"t{uuid.uuid4().hex[:8]}"))
    q.consumer.ensure_groups(MODEL)
    return q


def _done(text: str = "hi") -> dict[str, str]:
    return terminal_fields(
        status=JobStatus.SUCCEEDED,
        output=Output(
            text=text, finish_reason="length", usage=Usage(prompt_tokens=1, completion_tokens=1)
        ),
        inference_seconds=0.1,
        batch_size=1,
    )


def test_submit_writes_record_and_entry_together(queue):
    job = queue.store.submit(MODEL, JobInput(prompt="x"), {"k": "v"}).job
    assert queue.store.get(MODEL, job.id).status == JobStatus.QUEUED
    entries = queue.redis.xrange(queue.keys.stream(MODEL))
    assert [fields["job"] for _, fields in entries] == [job.id]


def test_submit_is_one_atomic_step(queue):
    """If the append fails, the job record must not exist either."""
    queue.redis.set(queue.keys.stream("broken"), "not a stream")  # XADD will fail
    with pytest.raises(redis.ResponseError):
        queue.store.submit("broken", JobInput(prompt="x"), {})
    assert not queue.redis.keys(queue.keys.job("*", "*"))


def test_finish_stores_then_acks_and_deletes_entry(queue):
    job = queue.store.submit(MODEL, JobInput(prompt="x"), {}).job
    [entry] = queue.consumer.read(MODEL, "c1", 10, None)
    started, dropped = queue.consumer.start(MODEL, [entry], "c1")
    assert [s.entry for s in started] == [entry] and not dropped
    assert queue.store.get(MODEL, job.id).status == JobStatus.RUNNING
    assert queue.redis.xpending(queue.keys.stream(MODEL), JOBS_GROUP)["pending"] == 1
    queue.consumer.finish(MODEL, [(entry, _done())])
    stored = queue.store.get(MODEL, job.id)
    assert stored.status == JobStatus.SUCCEEDED and stored.output.text == "hi"
    assert queue.redis.xpending(queue.keys.stream(MODEL), JOBS_GROUP)["pending"] == 0
    assert queue.redis.xlen(queue.keys.stream(MODEL)) == 0
    assert 0 < queue.redis.ttl(queue.keys.job(MODEL, job.id)) <= 60


def test_terminal_result_is_never_overwritten(queue):
    job = queue.store.submit(MODEL, JobInput(prompt="x"), {}).job
    [entry] = queue.consumer.read(MODEL, "c1", 10, None)
    queue.consumer.start(MODEL, [entry], "c1")
    queue.consumer.finish(MODEL, [(entry, _done("first"))])
    queue.consumer.finish(MODEL, [(entry, _done("second"))])
    assert queue.store.get(MODEL, job.id).output.text == "first"
    # A re-delivered entry of a finished job is dropped, not run again.
    started, dropped = queue.consumer.start(MODEL, [entry], "c2")
    assert not started and dropped == [entry]


def test_unread_and_unacked_entries_are_never_trimmed(queue):
    jobs = [queue.store.submit(MODEL, JobInput(prompt=str(i)), {}) for i in range(50)]
    stream = queue.keys.stream(MODEL)
    assert queue.redis.xlen(stream) == 50
    read = queue.consumer.read(MODEL, "c1", 20, None)
    queue.consumer.finish(MODEL, [(e, _done()) for e in read[:10]])
    # Only the 10 acknowledged entries are gone; 10 pending and 30 unread remain.
    assert queue.redis.xlen(stream) == 40
    backlog = queue.stats.backlog(MODEL)
    assert (backlog.undelivered, backlog.pending) == (30, 10)
    assert len(jobs) == 50


def test_own_pending_entries_are_read_again(queue):
    queue.store.submit(MODEL, JobInput(prompt="x"), {})
    [entry] = queue.consumer.read(MODEL, "c1", 10, None)
    assert queue.consumer.read(MODEL, "c1", 10, None, own_pending=True) == [entry]
    assert queue.consumer.read(MODEL, "c2", 10, None, own_pending=True) == []


def test_start_drops_entries_of_vanished_jobs(queue):
    job = queue.store.submit(MODEL, JobInput(prompt="x"), {}).job
    queue.redis.delete(queue.keys.job(MODEL, job.id))
    [entry] = queue.consumer.read(MODEL, "c1", 10, None)
    started, dropped = queue.consumer.start(MODEL, [entry], "c1")
    assert not started and dropped == [entry]
    queue.consumer.drop(MODEL, dropped)
    assert queue.redis.xlen(queue.keys.stream(MODEL)) == 0
    assert not queue.redis.exists(queue.keys.job(MODEL, job.id))  # dropping never recreates it


def test_own_pending_ids_of_deleted_entries_are_forgotten(queue):
    queue.store.submit(MODEL, JobInput(prompt="x"), {})
    [entry] = queue.consumer.read(MODEL, "c1", 10, None)
    queue.redis.xdel(queue.keys.stream(MODEL), entry.entry_id)
    assert queue.consumer.read(MODEL, "c1", 10, None, own_pending=True) == []
    assert queue.redis.xpending(queue.keys.stream(MODEL), JOBS_GROUP)["pending"] == 0
