"""The worker's side of the job queue: read entries of both lanes, start, finish, retry.

The stream protocol itself (own pending, claims, acks) is :mod:`shared.consumer`; this
module adds what an entry means: a job to start (``start.lua``), to finish and ack in one
step (``finish.lua``), or to dead-letter after too many deliveries (``dead_letter.lua``).
The interactive lane is read first; the batch lane fills only the room it leaves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis

from shared.cache import CacheWrites
from shared.consumer import StreamConsumer, ensure_group
from shared.keys import JOBS_GROUP, Keys
from shared.protocol import JobError, JobInput
from shared.records import terminal_fields
from shared.redis_client import FleetRedis
from shared.scripts import load, pairs
from shared.states import LANES, JobStatus, Lane

DEADLINE_ERROR = JobError(code="deadline_exceeded", message="the job's timeout_s passed")
CRASH_ERROR = "worker_crashed"


@dataclass(frozen=True)
class Entry:
    """One stream entry: a reference to a job waiting in a model's queue."""

    entry_id: str
    job_id: str
    lane: Lane = Lane.INTERACTIVE


@dataclass(frozen=True)
class StartedJob:
    entry: Entry
    input: JobInput
    created_at: float
    deadline: float | None
    stream: bool = False  # its text goes to its token stream as it is generated


def ensure_job_groups(client: redis.Redis, keys: Keys, model: str) -> None:
    """Create both lanes' streams and the workers' group, so the lag is known (and KEDA
    can scale) before any worker has started."""
    for lane in LANES:
        ensure_group(client, keys.stream(model, lane), JOBS_GROUP)


class JobConsumer(FleetRedis):
    def __init__(self, client: redis.Redis, keys: Keys, result_ttl_s: int) -> None:
        super().__init__(client, keys, result_ttl_s)
        self._start = load(client, "start")
        self._finish = load(client, "finish")
        self._dead_letter = load(client, "dead_letter")
        # The model version and policy finish caches results with; set by the worker once
        # its model is loaded. The default caches nothing.
        self.cache_writes = CacheWrites()

    def _as(self, consumer: str) -> StreamConsumer:
        return StreamConsumer(self.redis, JOBS_GROUP, consumer)

    def ensure_groups(self, model: str) -> None:
        ensure_job_groups(self.redis, self.keys, model)

    def read(
        self,
        model: str,
        consumer: str,
        count: int,
        block_ms: int | None,
        *,
        own_pending: bool = False,
        lanes: tuple[Lane, ...] = LANES,
    ) -> list[Entry]:
        """Entries for this consumer: new ones, or (own_pending) those it read but never acked.

        With several lanes, up to ``count`` from each; :meth:`read_next` keeps the priority.
        """
        streams = {self.keys.stream(model, lane): lane for lane in lanes}
        messages = self._as(consumer).read(list(streams), count, block_ms, own_pending=own_pending)
        return [Entry(entry_id, f["job"], streams[stream]) for stream, (entry_id, f) in messages]

    def read_next(self, model: str, consumer: str, count: int, block_ms: int | None) -> list[Entry]:
        """Up to ``count`` new entries, interactive ones first: the batch lane fills only what
        the interactive lane leaves. With ``block_ms``, wait that long for a first entry."""
        entries = self.read(model, consumer, count, None, lanes=(Lane.INTERACTIVE,))
        if len(entries) < count:
            entries += self.read(model, consumer, count - len(entries), None, lanes=(Lane.BATCH,))
        if not entries and block_ms:
            entries = self.read(model, consumer, 1, block_ms)
        return entries

    def claim_abandoned(self, model: str, consumer: str, idle_ms: int, count: int) -> list[Entry]:
        """Take over entries idle longer than idle_ms: their worker died without acking."""
        for lane in LANES:
            messages = self._as(consumer).claim_abandoned(
                self.keys.stream(model, lane), idle_ms, count
            )
            if messages:
                return [Entry(entry_id, fields["job"], lane) for entry_id, fields in messages]
        return []

    def touch(self, model: str, consumer: str, entries: list[Entry]) -> None:
        """Reset the idle time of entries this live worker is still working on."""
        for lane, ids in _by_lane(entries).items():
            self._as(consumer).touch(self.keys.stream(model, lane), ids)

    def times_delivered(self, model: str, consumer: str, entries: list[Entry]) -> dict[str, int]:
        """How many times each of these entries (pending for this consumer) was delivered."""
        counts: dict[str, int] = {}
        for lane, ids in _by_lane(entries).items():
            counts |= self._as(consumer).times_delivered(self.keys.stream(model, lane), ids)
        return counts

    def start(
        self, model: str, entries: list[Entry], worker: str
    ) -> tuple[list[StartedJob], list[Entry]]:
        """Mark jobs running. Returns the jobs to run, and entries to drop: their job is gone,
        ended, canceled before it started, or past its deadline (then ended ``expired``)."""
        now = repr(time.time())
        error = DEADLINE_ERROR.model_dump_json()
        keys, base = self.keys, self.keys.base(model)
        pipe = self.redis.pipeline(transaction=False)
        for entry in entries:
            self._start(
                keys=[keys.job(model, entry.job_id), keys.stats(model), keys.recent(model)],
                args=[now, worker, self.result_ttl_s, keys.job_finished_channel, entry.job_id,
                      error, base],
                client=pipe,
            )  # fmt: skip
        started, dropped = [], []
        for entry, reply in zip(entries, pipe.execute(), strict=True):
            if reply[0] == "run":
                _, job_input, created_at, deadline, stream = reply
                started.append(
                    StartedJob(
                        entry,
                        JobInput.model_validate_json(job_input),
                        float(created_at),
                        float(deadline) if deadline else None,
                        stream == "1",
                    )
                )
            else:  # 'gone' or 'ended'
                dropped.append(entry)
        return started, dropped

    def cancel_requested(self, model: str, job_ids: list[str]) -> set[str]:
        """Which of these running jobs a client asked to cancel."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(self.keys.job(model, job_id), "cancel_requested")
        return {j for j, flag in zip(job_ids, pipe.execute(), strict=True) if flag == "1"}

    def finish(
        self,
        model: str,
        results: list[tuple[Entry, dict[str, str]]],
        last_deltas: dict[str, tuple[str, int]] | None = None,
    ) -> None:
        """Store each job's terminal fields and ack its entry, one atomic step per job; a
        streaming job's last text delta (text, index), if any, goes in the same step, and
        so do the ends of the jobs following it and the caching of its result."""
        keys, base = self.keys, self.keys.base(model)
        last_deltas = last_deltas or {}
        cache = self.cache_writes.args()
        pipe = self.redis.pipeline(transaction=False)
        for entry, fields in results:
            delta, index = last_deltas.get(entry.job_id, ("", 0))
            self._finish(
                keys=[keys.job(model, entry.job_id), keys.stream(model, entry.lane),
                      keys.stats(model), keys.recent(model)],
                args=[JOBS_GROUP, entry.entry_id, self.result_ttl_s, keys.job_finished_channel,
                      entry.job_id, base, delta, index, *cache, *pairs(fields)],
                client=pipe,
            )  # fmt: skip
        pipe.execute()

    def restart_tokens(self, model: str, job_ids: list[str]) -> None:
        """Tell these jobs' stream readers to drop the text so far: it is generated anew."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.xadd(self.keys.tokens(model, job_id), {"type": "restart"})
        pipe.execute()

    def append_tokens(self, model: str, deltas: list[tuple[str, str, int]], cap: int) -> None:
        """Append text deltas (job id, text, index) to the jobs' token streams: one round trip
        for a whole decode step. Each stream holds at most about ``cap`` entries."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id, delta, index in deltas:
            pipe.xadd(
                self.keys.tokens(model, job_id),
                {"type": "token", "delta": delta, "index": index},
                maxlen=cap,
                approximate=True,
            )
        pipe.execute()

    def drop(self, model: str, entries: list[Entry]) -> None:
        """Ack and delete entries whose job is gone or already ended."""
        self.finish(model, [(entry, {}) for entry in entries])

    def dead_letter(self, model: str, entry: Entry, times_delivered: int) -> None:
        """Move a poison entry to the dead-letter stream; its job fails ``worker_crashed``."""
        error = JobError(
            code=CRASH_ERROR,
            message=f"the worker running this job died {times_delivered - 1} times; "
            "the job was moved to the dead-letter queue",
        )
        fields = terminal_fields(status=JobStatus.FAILED, error=error)
        keys = self.keys
        self._dead_letter(
            keys=[keys.job(model, entry.job_id), keys.stream(model, entry.lane),
                  keys.dead_letters(model), keys.stats(model), keys.recent(model)],
            args=[JOBS_GROUP, entry.entry_id, entry.job_id, times_delivered, repr(time.time()),
                  self.result_ttl_s, keys.job_finished_channel, entry.lane.value,
                  keys.base(model), *pairs(fields)],
        )  # fmt: skip


def _by_lane(entries: list[Entry]) -> dict[Lane, list[str]]:
    lanes: dict[Lane, list[str]] = {}
    for entry in entries:
        lanes.setdefault(entry.lane, []).append(entry.entry_id)
    return lanes
