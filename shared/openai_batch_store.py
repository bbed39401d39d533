"""OpenAI batches in Redis: the native batch records (:mod:`shared.openai_batches` says
which fields they add), the list of each API key's batches, the sweep that expires what
is still queued when a batch's window ends, and the summary kept once a batch ended.

Creating one is :meth:`shared.batch_store.BatchStore.create` with the OpenAI fields as
``extra`` and the window as every request's ``timeout_s``; then :meth:`add` lists it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import redis

from shared import openai_batches as ob
from shared.job_consumer import DEADLINE_ERROR
from shared.job_store import JobStore
from shared.keys import Keys
from shared.owner_index import OwnerIndex
from shared.redis_client import FleetRedis
from shared.states import BatchStatus, JobStatus

SWEEP_CHUNK = 1000
# How long a batch stays listed: its longest window, then RESULT_TTL_S once it ended.
LONGEST_WINDOW_S = max(ob.WINDOWS_S.values())

Record = dict[str, str]


class OpenAIBatchStore(FleetRedis):
    def __init__(self, client: redis.Redis, keys: Keys, result_ttl_s: int) -> None:
        super().__init__(client, keys, result_ttl_s)
        self.jobs = JobStore(client, keys, result_ttl_s)
        self.index = OwnerIndex(client, keys.openai_batches, LONGEST_WINDOW_S + result_ttl_s)

    def add(self, owner: str, batch_id: str, created_at: float) -> None:
        """List a new batch among its key's."""
        self.index.add(owner, batch_id, created_at)

    def get(self, model: str, batch_id: str, owner: str | None = None) -> Record | None:
        """An OpenAI batch's record; None for a native batch, or (with an ``owner``) one
        another API key made."""
        return self._load(model, [batch_id], owner)[0]

    def page(
        self, model: str, owner: str, after: str | None, limit: int
    ) -> tuple[list[Record], bool]:
        """One key's batches, newest first; UnknownCursor for a bad ``after``."""
        return self.index.page(owner, after, limit, lambda ids: self._load(model, ids, owner))

    def expire_if_due(self, model: str, record: Record) -> Record:
        """Past its window, end the batch's queued requests ``expired`` (once: the first
        reader does it); running ones are stopped by their worker at the deadline, and the
        last to end ends the batch. Workers expire a queued request past its deadline as
        they read it anyway: this makes it happen even when the batch lane is starved or
        no worker is up. Returns the record as it stands."""
        if BatchStatus(record["status"]).ended or time.time() < ob.expires_at(record):
            return record
        batch_key = self.keys.batch(model, record["id"])
        if not self.redis.hsetnx(batch_key, ob.SWEPT, repr(time.time())):
            return record
        jobs_key = self.keys.batch_jobs(model, record["id"])
        for start in range(0, self.redis.llen(jobs_key), SWEEP_CHUNK):
            job_ids = self.redis.lrange(jobs_key, start, start + SWEEP_CHUNK - 1)
            self.jobs.end_queued(model, job_ids, JobStatus.EXPIRED, DEADLINE_ERROR)
        return self.redis.hgetall(batch_key) or record

    def summary(self, record: Record) -> dict[str, Any] | None:
        """The ended batch's summary, if it was computed for this end of it."""
        raw = record.get(ob.SUMMARY)
        if not raw:
            return None
        summary = json.loads(raw)
        return summary if summary.get("at") == ob.ended_at(record) else None

    def save_summary(self, model: str, record: Record, summary: dict[str, Any]) -> None:
        summary = {"at": ob.ended_at(record), **summary}
        self.redis.hset(self.keys.batch(model, record["id"]), ob.SUMMARY, json.dumps(summary))

    def delete_file(self, model: str, batch_id: str, kind: str) -> None:
        """Hide a generated file (``output`` or ``errors``) from its owner from now on."""
        key = self.keys.batch(model, batch_id)
        deleted = set((self.redis.hget(key, ob.DELETED) or "").split())
        self.redis.hset(key, ob.DELETED, " ".join(sorted(deleted | {kind})))

    def webhook_event(self, model: str, batch_id: str, event_id: str) -> dict | None:
        """The OpenAI-shaped event of an ended OpenAI batch; None for any other."""
        record = self.redis.hgetall(self.keys.batch(model, batch_id))
        return ob.webhook_event(record, event_id) if record else None

    def _load(self, model: str, batch_ids: Sequence[str], owner: str | None) -> list[Record | None]:
        pipe = self.redis.pipeline(transaction=False)
        for batch_id in batch_ids:
            pipe.hgetall(self.keys.batch(model, batch_id))
        return [
            record
            if record
            and ob.is_openai(record)
            and (owner is None or record.get("owner", "") == owner)
            else None
            for record in pipe.execute()
        ]
