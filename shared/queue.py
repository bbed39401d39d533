"""Every Redis operation on jobs, streams and worker liveness: the one owner of them.

The gateway submits, reads and cancels jobs; workers read entries, start jobs, finish
them, reclaim entries of dead workers and dead-letter poison ones. Each multi-key change
is one atomic Lua script, documented with its invariants in :mod:`shared.scripts`.

Delivery and recovery, in Redis Streams terms: a worker reads new entries with
``XREADGROUP >``; while it works on them it refreshes their idle time every heartbeat
(``XCLAIM ... JUSTID``), so a live worker's entries never look abandoned however long its
batch runs. Entries idle longer than CLAIM_IDLE_S belong to a dead worker and are taken
over with ``XAUTOCLAIM``; a restarted worker re-reads its own pending entries (``0``).
Every such re-delivery counts; past MAX_DELIVERIES the entry is dead-lettered.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass

import redis

from shared import scripts
from shared.jobs import (
    CONSUMER_GROUP,
    LANES,
    Job,
    JobError,
    JobInput,
    JobStatus,
    Keys,
    Lane,
    job_from_record,
    new_job_id,
    new_record,
    terminal_fields,
)

IDEMPOTENCY_TTL_S = 86_400
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


@dataclass(frozen=True)
class Submitted:
    job: Job
    replayed: bool  # an earlier request with this Idempotency-Key made the job


class IdempotencyConflict(Exception):
    """The Idempotency-Key was used before with a different request body."""


class IdempotentResultExpired(Exception):
    """The Idempotency-Key names a job or batch whose record has expired."""


@dataclass(frozen=True)
class Backlog:
    undelivered: int
    pending: int
    entries_read: int = 0  # ever delivered to the group: its growth is the drain rate
    oldest_age_s: float = 0.0  # since the oldest unread entry was queued

    @property
    def total(self) -> int:
        return self.undelivered + self.pending


class JobQueue:
    """Jobs in Redis: submit, read, start, finish, and who is serving which model."""

    def __init__(self, client: redis.Redis, keys: Keys, result_ttl_s: int) -> None:
        self.redis = client
        self.keys = keys
        self.result_ttl_s = result_ttl_s
        self._submit = client.register_script(scripts.SUBMIT)
        self._start = client.register_script(scripts.START)
        self._finish = client.register_script(scripts.FINISH)
        self._end_if = client.register_script(scripts.END_IF)
        self._request_cancel = client.register_script(scripts.REQUEST_CANCEL)
        self._dead_letter = client.register_script(scripts.DEAD_LETTER)
        self._requeue = client.register_script(scripts.REQUEUE)
        self._groups: set[str] = set()  # models whose group this process has made sure of

    # --- both sides ----------------------------------------------------------------------

    def ensure_group(self, model: str) -> None:
        """Create the model's streams and consumer groups; from id 0, so no entry is missed."""
        for lane in LANES:
            try:
                self.redis.xgroup_create(
                    self.keys.stream(model, lane), CONSUMER_GROUP, id="0", mkstream=True
                )
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def ensure_group_once(self, model: str) -> None:
        """Before the first submit: so the lag is known (and KEDA can scale) before any
        worker has started."""
        if model not in self._groups:
            self.ensure_group(model)
            self._groups.add(model)

    def get(self, job_id: str) -> Job | None:
        """The job; a queued job past its deadline is expired on the way (no worker may be up)."""
        record = self.redis.hgetall(self.keys.job(job_id))
        if not record:
            return None
        deadline = record.get("deadline")
        if record["status"] == JobStatus.QUEUED and deadline and float(deadline) < time.time():
            fields = terminal_fields(status=JobStatus.EXPIRED, error=DEADLINE_ERROR)
            self._end(record["model"], job_id, JobStatus.QUEUED, fields)
            record = self.redis.hgetall(self.keys.job(job_id)) or record
        return job_from_record(record)

    def _end(self, model: str, job_id: str, expected: JobStatus, fields: dict[str, str]) -> str:
        return self._end_if(
            keys=[self.keys.job(job_id), self.keys.stats(model), self.keys.recent(model)],
            args=[expected.value, self.result_ttl_s, self.keys.job_finished_channel, job_id,
                  *pairs(fields)],
        )  # fmt: skip

    def backlog(self, model: str, lane: Lane | None = None) -> Backlog:
        """Entries not done in one lane, or in both (what the workers have to get through),
        and the age of the oldest unread one: one XINFO per lane, and an XRANGE only when
        something is unread."""
        if lane is None:
            parts = [self.backlog(model, one) for one in LANES]
            return Backlog(
                sum(p.undelivered for p in parts),
                sum(p.pending for p in parts),
                sum(p.entries_read for p in parts),
                max(p.oldest_age_s for p in parts),
            )
        stream = self.keys.stream(model, lane)
        try:
            groups = {g["name"]: g for g in self.redis.xinfo_groups(stream)}
        except redis.ResponseError:  # no such stream yet
            return Backlog(0, 0)
        group = groups.get(CONSUMER_GROUP)
        if group is None:
            return Backlog(0, 0, oldest_age_s=self._oldest_after(stream, "-"))
        lag = group.get("lag")  # None when Redis cannot tell: then look
        depth = Backlog(int(lag or 0), int(group["pending"]), int(group.get("entries-read") or 0))
        if lag == 0:
            return depth
        oldest = self._oldest_after(stream, f"({group['last-delivered-id']}")
        return dataclasses.replace(depth, oldest_age_s=oldest)

    def _oldest_after(self, stream: str, start: str) -> float:
        """Seconds since the first entry after ``start`` was added (0 if none)."""
        first = self.redis.xrange(stream, start, "+", count=1)
        if not first:
            return 0.0
        return max(0.0, time.time() - _id_key(first[0][0])[0] / 1000)

    def stats(self, model: str) -> dict[str, str]:
        """The model's counters and histograms (see P:stats:{model} in shared.jobs)."""
        return self.redis.hgetall(self.keys.stats(model))

    def recent(self, model: str) -> list[tuple[float, float, str]]:
        """The last ended jobs, newest first: (completed_at, latency seconds, status)."""
        rows = []
        for line in self.redis.lrange(self.keys.recent(model), 0, -1):
            completed, latency, status = line.split(" ")
            rows.append((float(completed), float(latency), status))
        return rows

    def dead_letter_count(self, model: str) -> int:
        return self.redis.xlen(self.keys.dead_letters(model))

    def workers(self, model: str, max_age_s: float) -> list[dict[str, str]]:
        """Live workers of a model, with what each told us in its heartbeat."""
        names = self.redis.zrangebyscore(self.keys.workers(model), time.time() - max_age_s, "+inf")
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(self.keys.worker(name))
        return [{"name": n, **info} for n, info in zip(names, pipe.execute(), strict=True) if info]

    # --- gateway side --------------------------------------------------------------------

    def submit(
        self,
        model: str,
        job_input: JobInput,
        metadata: dict[str, str],
        *,
        timeout_s: float | None = None,
        idempotency_key: str | None = None,
        fingerprint: str = "",
        extra: dict[str, str] | None = None,
    ) -> Submitted:
        """Queue a job. With an Idempotency-Key seen before, return that job instead."""
        self.ensure_group_once(model)
        job_id = new_job_id()
        record = new_record(job_id, model, job_input, metadata, timeout_s, extra)
        idem = self.keys.idempotency(idempotency_key) if idempotency_key else ""
        outcome, value = self._submit(
            keys=[self.keys.stream(model), self.keys.job(job_id), idem, self.keys.stats(model)],
            args=[job_id, fingerprint, IDEMPOTENCY_TTL_S, *pairs(record)],
        )
        if outcome == "created":
            return Submitted(job_from_record(record), replayed=False)
        prior_id = replayed_id(value, fingerprint)
        prior = self.get(prior_id)
        if prior is None:
            raise IdempotentResultExpired(prior_id)
        return Submitted(prior, replayed=True)

    def end_queued(self, model: str, job_ids: list[str], status: JobStatus) -> None:
        """End those of these jobs that are still queued (a batch's cancel sweep)."""
        fields = pairs(terminal_fields(status=status))
        channel = self.keys.job_finished_channel
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            self._end_if(
                keys=[self.keys.job(job_id), self.keys.stats(model), self.keys.recent(model)],
                args=[JobStatus.QUEUED.value, self.result_ttl_s, channel, job_id, *fields],
                client=pipe,
            )
        pipe.execute()

    def cancel(self, job_id: str) -> Job | None:
        """Cancel a queued job now, or ask its worker to stop a running one at its next token.

        Returns the job as it stands (None if unknown); a job already terminal is unchanged.
        """
        model = self.redis.hget(self.keys.job(job_id), "model")
        if model is None:
            return None
        fields = terminal_fields(status=JobStatus.CANCELED)
        status = self._end(model, job_id, JobStatus.QUEUED, fields)
        if status == JobStatus.RUNNING:
            self._request_cancel(keys=[self.keys.job(job_id)])
        return self.get(job_id) if status else None

    def ready_workers(self, model: str, max_age_s: float) -> int:
        return self.redis.zcount(self.keys.workers(model), time.time() - max_age_s, "+inf")

    # --- worker side ---------------------------------------------------------------------

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
        reply = self.redis.xreadgroup(
            CONSUMER_GROUP,
            consumer,
            dict.fromkeys(streams, "0" if own_pending else ">"),
            count=count,
            block=block_ms,
        )
        entries = []
        for stream, messages in reply or []:
            gone = []
            for entry_id, fields in messages:
                if fields:
                    entries.append(Entry(entry_id, fields["job"], streams[stream]))
                else:  # a pending id whose entry was deleted: nothing to run, forget it
                    gone.append(entry_id)
            if gone:
                self.redis.xack(stream, CONSUMER_GROUP, *gone)
        return entries

    def read_next(self, model: str, consumer: str, count: int, block_ms: int | None) -> list[Entry]:
        """Up to ``count`` new entries, interactive ones first: the batch lane fills only what
        the interactive lane leaves. With ``block_ms``, wait that long for a first entry."""
        entries = self.read(model, consumer, count, None, lanes=(Lane.INTERACTIVE,))
        if len(entries) < count:
            entries += self.read(model, consumer, count - len(entries), None, lanes=(Lane.BATCH,))
        if not entries and block_ms:
            entries = self.read(model, consumer, 1, block_ms)
        return entries

    def start(
        self, model: str, entries: list[Entry], worker: str
    ) -> tuple[list[StartedJob], list[Entry]]:
        """Mark jobs running. Returns the jobs to run, and entries to drop: their job is gone,
        ended, canceled before it started, or past its deadline (then ended ``expired``)."""
        now = repr(time.time())
        error = DEADLINE_ERROR.model_dump_json()
        channel = self.keys.job_finished_channel
        pipe = self.redis.pipeline(transaction=False)
        for entry in entries:
            self._start(
                keys=[self.keys.job(entry.job_id), self.keys.stats(model), self.keys.recent(model)],
                args=[now, worker, self.result_ttl_s, channel, entry.job_id, error],
                client=pipe,
            )
        started, dropped = [], []
        for entry, reply in zip(entries, pipe.execute(), strict=True):
            if len(reply) == 4:
                job_input = JobInput.model_validate_json(reply[1])
                deadline = float(reply[3]) if reply[3] else None
                started.append(StartedJob(entry, job_input, float(reply[2]), deadline))
            else:
                dropped.append(entry)
        return started, dropped

    def cancel_requested(self, job_ids: list[str]) -> set[str]:
        """Which of these running jobs a client asked to cancel."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(self.keys.job(job_id), "cancel_requested")
        return {j for j, flag in zip(job_ids, pipe.execute(), strict=True) if flag == "1"}

    def touch(self, model: str, consumer: str, entries: list[Entry]) -> None:
        """Reset the idle time of entries this live worker is still working on."""
        for lane, ids in _by_lane(entries).items():
            self.redis.xclaim(
                self.keys.stream(model, lane), CONSUMER_GROUP, consumer, 0, ids, justid=True
            )

    def claim_abandoned(self, model: str, consumer: str, idle_ms: int, count: int) -> list[Entry]:
        """Take over entries idle longer than idle_ms: their worker died without acking."""
        for lane in LANES:
            stream = self.keys.stream(model, lane)
            reply = self.redis.xautoclaim(
                stream, CONSUMER_GROUP, consumer, idle_ms, "0-0", count=count
            )
            messages, deleted = reply[1], reply[2] if len(reply) > 2 else []
            if deleted:  # ids in the group's pending list whose entries no longer exist
                self.redis.xack(stream, CONSUMER_GROUP, *deleted)
            claimed = [Entry(entry_id, f["job"], lane) for entry_id, f in messages if f]
            if claimed:
                return claimed
        return []

    def deliveries(self, model: str, consumer: str, entries: list[Entry]) -> dict[str, int]:
        """How many times each of these entries (pending for this consumer) was delivered."""
        counts: dict[str, int] = {}
        for lane, ids in _by_lane(entries).items():
            ids.sort(key=_id_key)
            rows = self.redis.xpending_range(
                self.keys.stream(model, lane), CONSUMER_GROUP, ids[0], ids[-1], len(ids) + 1000,
                consumername=consumer,
            )  # fmt: skip
            counts.update({row["message_id"]: int(row["times_delivered"]) for row in rows})
        return {e.entry_id: counts.get(e.entry_id, 1) for e in entries}

    def dead_letter(self, model: str, entry: Entry, deliveries: int) -> None:
        """Move a poison entry to the dead-letter stream; its job fails ``worker_crashed``."""
        error = JobError(
            code=CRASH_ERROR,
            message=f"the worker running this job died {deliveries - 1} times; "
            "the job was moved to the dead-letter queue",
        )
        fields = terminal_fields(status=JobStatus.FAILED, error=error)
        self._dead_letter(
            keys=[
                self.keys.job(entry.job_id),
                self.keys.stream(model, entry.lane),
                self.keys.dead_letters(model),
                self.keys.stats(model),
                self.keys.recent(model),
            ],
            args=[CONSUMER_GROUP, entry.entry_id, entry.job_id, deliveries, repr(time.time()),
                  self.result_ttl_s, self.keys.job_finished_channel, entry.lane.value,
                  *pairs(fields)],
        )  # fmt: skip

    def dead_letters(self, model: str, count: int = 1000) -> list[dict[str, str]]:
        rows = self.redis.xrange(self.keys.dead_letters(model), count=count)
        return [{"id": entry_id, **fields} for entry_id, fields in rows]

    def requeue_dead_letter(self, model: str, letter_id: str) -> str | None:
        """Queue a dead letter's job again; returns its new entry id (None if its job is gone)."""
        rows = self.redis.xrange(self.keys.dead_letters(model), letter_id, letter_id)
        if not rows:
            raise KeyError(letter_id)
        job_id, lane = rows[0][1]["job"], Lane(rows[0][1].get("lane", Lane.INTERACTIVE))
        entry = self._requeue(
            keys=[
                self.keys.dead_letters(model),
                self.keys.stream(model, lane),
                self.keys.job(job_id),
            ],
            args=[letter_id, job_id],
        )
        return entry or None

    def finish(self, model: str, results: list[tuple[Entry, dict[str, str]]]) -> None:
        """Store each job's terminal fields and ack its entry, one atomic step per job."""
        pipe = self.redis.pipeline(transaction=False)
        for entry, fields in results:
            self._finish(
                keys=[
                    self.keys.job(entry.job_id),
                    self.keys.stream(model, entry.lane),
                    self.keys.stats(model),
                    self.keys.recent(model),
                ],
                args=[
                    CONSUMER_GROUP,
                    entry.entry_id,
                    self.result_ttl_s,
                    self.keys.job_finished_channel,
                    entry.job_id,
                    *pairs(fields),
                ],
                client=pipe,
            )
        pipe.execute()

    def drop(self, model: str, entries: list[Entry]) -> None:
        """Ack and delete entries whose job is gone or already ended."""
        self.finish(model, [(entry, {}) for entry in entries])

    def heartbeat(self, model: str, worker: str, info: dict[str, str], ttl_s: float) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.zadd(self.keys.workers(model), {worker: time.time()})
        pipe.zremrangebyscore(self.keys.workers(model), "-inf", time.time() - 3600)
        pipe.hset(self.keys.worker(worker), mapping=info)
        pipe.expire(self.keys.worker(worker), max(1, int(ttl_s)))
        pipe.execute()

    def leave(self, model: str, worker: str) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.zrem(self.keys.workers(model), worker)
        pipe.delete(self.keys.worker(worker))
        pipe.execute()


def pairs(mapping: dict[str, str]) -> list[str]:
    """A mapping as the flat field, value, ... list that HSET takes in a script."""
    return [item for pair in mapping.items() for item in pair]


def replayed_id(stored: str, fingerprint: str) -> str:
    """The id an Idempotency-Key was stored with ("id fingerprint"); IdempotencyConflict if
    that request's body differed from this one."""
    prior_id, _, prior_fingerprint = stored.partition(" ")
    if prior_fingerprint != fingerprint:
        raise IdempotencyConflict(prior_id)
    return prior_id


def _by_lane(entries: list[Entry]) -> dict[Lane, list[str]]:
    lanes: dict[Lane, list[str]] = {}
    for entry in entries:
        lanes.setdefault(entry.lane, []).append(entry.entry_id)
    return lanes


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def fingerprint(body: dict) -> str:
    """What makes two submissions with one Idempotency-Key the same request (key order and
    whitespace aside)."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]
