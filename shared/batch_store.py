"""Batches in Redis: create (all requests or none), read, results, cancel.

A batch's requests are ordinary jobs in the model's batch stream, so workers, recovery and
dead letters treat them like any job; the scripts count each one in its batch as it ends
and end the batch with its last request (``lib.lua``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import redis

from shared.cache import fingerprint as cache_fingerprint
from shared.idempotency import IDEMPOTENCY_TTL_S, IdempotentResultExpired, replayed_id
from shared.job_store import JobStore
from shared.keys import Keys
from shared.protocol import Batch, BatchOptions, BatchRequest, new_batch_id, new_job_id
from shared.records import batch_from_record, new_batch_record, new_record, webhook_fields
from shared.redis_client import FleetRedis
from shared.scripts import load, pairs
from shared.states import BatchStatus, JobStatus, Lane

WRITE_CHUNK = 1000  # job records per pipeline round trip while a batch is written
UNCOMMITTED_TTL_S = 3600  # records of a batch whose commit never came expire by themselves
RESULTS_CHUNK = 1000


@dataclass(frozen=True)
class SubmittedBatch:
    batch: Batch
    replayed: bool


class BatchStore(FleetRedis):
    def __init__(self, client: redis.Redis, keys: Keys, result_ttl_s: int) -> None:
        super().__init__(client, keys, result_ttl_s)
        self.jobs = JobStore(client, keys, result_ttl_s)
        self._commit = load(client, "commit_batch")
        self._cancel = load(client, "cancel_batch")

    def create(
        self,
        model: str,
        requests: list[BatchRequest],
        options: BatchOptions,
        *,
        idempotency_key: str | None = None,
        fingerprint: str = "",
        cache_owners: list[str | None] | None = None,
        owner: str = "",
        timeout_s: float | None = None,
        extra: dict[str, str] | None = None,
    ) -> SubmittedBatch:
        """Store every request as a queued job, then queue them all in one atomic step.

        ``cache_owners`` holds, per request, whose cached results and running jobs it may
        share (None: not cacheable; see JobStore.submit): repeated lines compute once.
        ``owner``, the API key creating it, owns the batch and each of its jobs.
        ``timeout_s`` gives every request a deadline (queued past it, it expires; running
        past it, it is stopped); ``extra`` fields go in the batch's record (another API's
        view of it, such as shared.openai_batches)."""
        keys = self.keys
        idem = keys.batch_idempotency(model, idempotency_key, owner) if idempotency_key else None
        if idem and (prior := self.redis.get(idem)):
            return self._replay(model, prior, fingerprint)
        self.jobs.ensure_groups_once(model)
        batch_id, now = new_batch_id(), time.time()
        owned = {"owner": owner} if owner else {}  # the batch's and each of its jobs'
        common = {"batch": batch_id, **webhook_fields(options.webhook, options.job_events())}
        common |= owned
        job_ids = [new_job_id() for _ in requests]
        sharers = cache_owners or [None] * len(requests)
        for start in range(0, len(requests), WRITE_CHUNK):
            pipe = self.redis.pipeline(transaction=False)
            for job_id, request, sharer in zip(
                job_ids[start : start + WRITE_CHUNK],
                requests[start : start + WRITE_CHUNK],
                sharers[start : start + WRITE_CHUNK],
                strict=True,
            ):
                fields = common | {"custom_id": request.custom_id}
                record = new_record(job_id, model, request, {}, timeout_s, fields, now)
                if sharer is not None:  # commit_batch looks it up, and keeps it if it leads
                    record["cache_fp"] = cache_fingerprint(record["input"], sharer)
                pipe.hset(keys.job(model, job_id), mapping=record)
                pipe.expire(keys.job(model, job_id), UNCOMMITTED_TTL_S)
            pipe.execute()
        record = new_batch_record(
            batch_id, model, len(requests), options.metadata,
            webhook_fields(options.webhook, options.events()), now,
        ) | owned | (extra or {})  # fmt: skip
        script_keys = [
            keys.stream(model, Lane.BATCH),
            keys.batch(model, batch_id),
            keys.batch_jobs(model, batch_id),
            keys.stats(model),
        ]
        outcome, *value = self._commit(
            keys=script_keys + ([idem] if idem else []),
            args=[batch_id, fingerprint, IDEMPOTENCY_TTL_S, keys.base(model), repr(now),
                  self.result_ttl_s, keys.job_finished_channel, len(job_ids), *job_ids,
                  *pairs(record)],
        )  # fmt: skip
        if outcome == "replay":  # a concurrent request with the same key won
            return self._replay(model, value[0], fingerprint)
        # Cached lines ended already (all of them: the batch completed).
        return SubmittedBatch(self.get(model, batch_id) or batch_from_record(record), False)

    def _replay(self, model: str, stored: str, fingerprint: str) -> SubmittedBatch:
        prior_id = replayed_id(stored, fingerprint)
        batch = self.get(model, prior_id)
        if batch is None:
            raise IdempotentResultExpired(prior_id)
        return SubmittedBatch(batch, replayed=True)

    def get(self, model: str, batch_id: str, owner: str | None = None) -> Batch | None:
        """The batch; with an ``owner``, None unless that API key made it."""
        record = self.redis.hgetall(self.keys.batch(model, batch_id))
        if not record or (owner is not None and record.get("owner", "") != owner):
            return None
        return batch_from_record(record)

    def results(self, model: str, batch_id: str) -> Iterator[str]:
        """The result lines of the requests that ended so far, in the order they ended."""
        key, start = self.keys.batch_results(model, batch_id), 0
        while True:
            lines = self.redis.lrange(key, start, start + RESULTS_CHUNK - 1)
            yield from lines
            if len(lines) < RESULTS_CHUNK:
                return
            start += len(lines)

    def cancel(self, model: str, batch_id: str) -> Batch | None:
        """Cancel the requests that have not started; running ones finish. The batch is
        ``cancelling`` until its last running request ends, then ``cancelled``.

        Workers also refuse to start a request of a cancelling batch, so a request this
        sweep misses (read by a worker meanwhile) is cancelled all the same, and cancelling
        again sweeps again (after a gateway died midway, say)."""
        before = self._cancel(keys=[self.keys.batch(model, batch_id)], args=[repr(time.time())])
        if not before:
            return None
        if before in (BatchStatus.QUEUED, BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING):
            job_ids_key = self.keys.batch_jobs(model, batch_id)
            length = self.redis.llen(job_ids_key)
            for start in range(0, length, WRITE_CHUNK):
                job_ids = self.redis.lrange(job_ids_key, start, start + WRITE_CHUNK - 1)
                self.jobs.end_queued(model, job_ids, JobStatus.CANCELED)
        return self.get(model, batch_id)
