"""Every Redis operation on jobs, streams and worker liveness: the one owner of them.

The gateway submits and reads jobs; workers read entries, start jobs and finish them.
Each multi-key change is one atomic step (a MULTI pipeline or a Lua script below), so a
crash between two commands can never leave a half-written job:

* ``submit`` (script ``_SUBMIT``): XADD the entry, then HSET the record. Redis never rolls
  a script back, so the order matters: if the append fails, nothing was written; an entry
  whose record is missing would only be dropped by the worker.
* ``start`` (script ``_START``): queued/running -> running, stamping started_at and the
  worker. A job that is gone or already terminal is reported as such and not touched.
* ``finish`` (script ``_FINISH``): store the terminal fields unless the job is already
  terminal, set its TTL, publish its id, then XACK and XDEL the entry. The entry is
  acknowledged only in the same step that stored the result, and only acknowledged
  entries are ever deleted from a stream, so nothing unread is trimmed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis

from shared.jobs import (
    CONSUMER_GROUP,
    TERMINAL_STATUSES,
    Job,
    JobInput,
    Keys,
    job_from_record,
    new_job_id,
    new_record,
)

# KEYS: stream, job. ARGV: job id, field, value, ... Returns the entry id.
_SUBMIT = """
local entry = redis.call('XADD', KEYS[1], '*', 'job', ARGV[1])
redis.call('HSET', KEYS[2], unpack(ARGV, 2))
return entry
"""

_TERMINAL_LUA = "{" + ", ".join(f"['{s}'] = true" for s in sorted(TERMINAL_STATUSES)) + "}"

# KEYS: job. ARGV: now, worker. Returns {status, input, created_at} or {} if the job is gone.
_START = f"""
local terminal = {_TERMINAL_LUA}
local rec = redis.call('HMGET', KEYS[1], 'status', 'input', 'created_at')
if not rec[1] then return {{}} end
if terminal[rec[1]] then return {{rec[1]}} end
redis.call('HSET', KEYS[1], 'status', 'running', 'started_at', ARGV[1], 'worker', ARGV[2])
return {{'running', rec[2], rec[3]}}
"""

# KEYS: job, stream. ARGV: group, entry id, ttl, channel, job id, field, value, ...
# Returns 1 if the result was stored, 0 if the job was gone or already terminal.
_FINISH = f"""
local terminal = {_TERMINAL_LUA}
local status = redis.call('HGET', KEYS[1], 'status')
local stored = 0
if status and not terminal[status] and #ARGV >= 6 then
  redis.call('HSET', KEYS[1], unpack(ARGV, 6))
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  redis.call('PUBLISH', ARGV[4], ARGV[5])
  stored = 1
end
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[2], ARGV[2])
return stored
"""


@dataclass(frozen=True)
class Entry:
    """One stream entry: a reference to a job waiting in a model's queue."""

    entry_id: str
    job_id: str


@dataclass(frozen=True)
class StartedJob:
    entry: Entry
    input: JobInput
    created_at: float


@dataclass(frozen=True)
class Backlog:
    undelivered: int
    pending: int

    @property
    def total(self) -> int:
        return self.undelivered + self.pending


class JobQueue:
    """Jobs in Redis: submit, read, start, finish, and who is serving which model."""

    def __init__(self, client: redis.Redis, keys: Keys, result_ttl_s: int) -> None:
        self.redis = client
        self.keys = keys
        self.result_ttl_s = result_ttl_s
        self._submit = client.register_script(_SUBMIT)
        self._start = client.register_script(_START)
        self._finish = client.register_script(_FINISH)
        self._groups: set[str] = set()  # models whose group this process has made sure of

    # --- both sides ----------------------------------------------------------------------

    def ensure_group(self, model: str) -> None:
        """Create the model's stream and consumer group; from id 0, so no entry is missed."""
        try:
            self.redis.xgroup_create(self.keys.stream(model), CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def get(self, job_id: str) -> Job | None:
        record = self.redis.hgetall(self.keys.job(job_id))
        return job_from_record(record) if record else None

    def backlog(self, model: str) -> Backlog:
        try:
            groups = self.redis.xinfo_groups(self.keys.stream(model))
        except redis.ResponseError:  # no such stream yet
            return Backlog(0, 0)
        for group in groups:
            if group["name"] == CONSUMER_GROUP:
                return Backlog(int(group.get("lag") or 0), int(group["pending"]))
        return Backlog(0, 0)

    # --- gateway side --------------------------------------------------------------------

    def submit(self, model: str, job_input: JobInput, metadata: dict[str, str]) -> Job:
        if model not in self._groups:  # so the lag is known (and KEDA can scale) before any
            self.ensure_group(model)  # worker has started
            self._groups.add(model)
        job_id = new_job_id()
        record = new_record(job_id, model, job_input, metadata)
        keys = [self.keys.stream(model), self.keys.job(job_id)]
        self._submit(keys=keys, args=[job_id, *_pairs(record)])
        return job_from_record(record)

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
    ) -> list[Entry]:
        """Entries for this consumer: new ones, or (own_pending) those it read but never acked."""
        stream = self.keys.stream(model)
        reply = self.redis.xreadgroup(
            CONSUMER_GROUP,
            consumer,
            {stream: "0" if own_pending else ">"},
            count=count,
            block=block_ms,
        )
        entries = []
        for _stream, messages in reply or []:
            for entry_id, fields in messages:
                if fields:  # a pending id whose entry was deleted comes back with no fields
                    entries.append(Entry(entry_id, fields["job"]))
        return entries

    def start(
        self, model: str, entries: list[Entry], worker: str
    ) -> tuple[list[StartedJob], list[Entry]]:
        """Mark jobs running. Returns the jobs to run, and entries to drop (job gone or ended)."""
        now = repr(time.time())
        pipe = self.redis.pipeline(transaction=False)
        for entry in entries:
            self._start(keys=[self.keys.job(entry.job_id)], args=[now, worker], client=pipe)
        started, dropped = [], []
        for entry, reply in zip(entries, pipe.execute(), strict=True):
            if len(reply) == 3:
                job_input = JobInput.model_validate_json(reply[1])
                started.append(StartedJob(entry, job_input, float(reply[2])))
            else:
                dropped.append(entry)
        return started, dropped

    def finish(self, model: str, results: list[tuple[Entry, dict[str, str]]]) -> None:
        """Store each job's terminal fields and ack its entry, one atomic step per job."""
        pipe = self.redis.pipeline(transaction=False)
        for entry, fields in results:
            self._finish(
                keys=[self.keys.job(entry.job_id), self.keys.stream(model)],
                args=[
                    CONSUMER_GROUP,
                    entry.entry_id,
                    self.result_ttl_s,
                    self.keys.job_finished_channel,
                    entry.job_id,
                    *_pairs(fields),
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


def _pairs(mapping: dict[str, str]) -> list[str]:
    """A mapping as the flat field, value, ... list that HSET takes in a script."""
    return [item for pair in mapping.items() for item in pair]
