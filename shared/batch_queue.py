"""Every Redis operation on batches: create (all requests or none), read, results, cancel.

A batch's requests are ordinary jobs in the model's batch stream, so workers, recovery and
dead letters treat them like any job; the scripts in :mod:`shared.scripts` count each one
in its batch as it ends and end the batch with its last request.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

from shared import scripts
from shared.batches import Batch, BatchOptions, BatchRequest, batch_from_record, new_batch_id
from shared.jobs import JobStatus, Lane, new_job_id, new_record, webhook_fields
from shared.queue import (
    IDEMPOTENCY_TTL_S,
    IdempotentResultExpired,
    JobQueue,
    pairs,
    replayed_id,
)

WRITE_CHUNK = 1000  # job records per pipeline round trip while a batch is written
UNCOMMITTED_TTL_S = 3600  # records of a batch whose commit never came expire by themselves
RESULTS_CHUNK = 1000


@dataclass(frozen=True)
class SubmittedBatch:
    batch: Batch
    replayed: bool


class BatchQueue:
    """Batches in Redis, on top of the jobs of :class:`~shared.queue.JobQueue`."""

    def __init__(self, jobs: JobQueue) -> None:
        self.jobs = jobs
        self.redis = jobs.redis
        self.keys = jobs.keys
        self.result_ttl_s = jobs.result_ttl_s
        self._commit = self.redis.register_script(scripts.COMMIT_BATCH)
        self._cancel = self.redis.register_script(scripts.CANCEL_BATCH)

    def create(
        self,
        model: str,
        requests: list[BatchRequest],
        options: BatchOptions,
        *,
        idempotency_key: str | None = None,
        fingerprint: str = "",
    ) -> SubmittedBatch:
        """Store every request as a queued job, then queue them all in one atomic step."""
        idem = self.keys.idempotency(f"batch:{idempotency_key}") if idempotency_key else ""
        if idem and (prior := self.redis.get(idem)):
            return self._replay(prior, fingerprint)
        self.jobs.ensure_group_once(model)
        batch_id, now = new_batch_id(), time.time()
        keys = self.keys
        common = {
            "batch": batch_id,
            "batch_key": keys.batch(batch_id),
            "results_key": keys.batch_results(batch_id),
            **webhook_fields(keys, options.webhook, options.job_events()),
        }
        job_ids = [new_job_id() for _ in requests]
        for start in range(0, len(requests), WRITE_CHUNK):
            pipe = self.redis.pipeline(transaction=False)
            for job_id, request in zip(
                job_ids[start : start + WRITE_CHUNK],
                requests[start : start + WRITE_CHUNK],
                strict=True,
            ):
                extra = common | {"custom_id": request.custom_id}
                record = new_record(job_id, model, request, {}, extra=extra, now=now)
                pipe.hset(keys.job(job_id), mapping=record)
                pipe.expire(keys.job(job_id), UNCOMMITTED_TTL_S)
            pipe.execute()
        record = {
            "id": batch_id,
            "model": model,
            "status": "queued",
            "created_at": repr(now),
            "total": str(len(requests)),
            "completed": "0",
            "failed": "0",
            "cancelled": "0",
            "metadata": json.dumps(options.metadata),
            "jobs_key": keys.batch_jobs(batch_id),
        }
        # The scripts send batch.* events from this list; its job.* ones never match them.
        record |= webhook_fields(keys, options.webhook, options.events())
        outcome, *value = self._commit(
            keys=[
                keys.stream(model, Lane.BATCH),
                keys.batch(batch_id),
                keys.batch_jobs(batch_id),
                idem,
                keys.stats(model),
            ],
            args=[batch_id, fingerprint, IDEMPOTENCY_TTL_S, keys.job(""), len(job_ids),
                  *job_ids, *pairs(record)],
        )  # fmt: skip
        if outcome == "replay":  # a concurrent request with the same key won
            return self._replay(value[0], fingerprint)
        return SubmittedBatch(batch_from_record(record), replayed=False)

    def _replay(self, stored: str, fingerprint: str) -> SubmittedBatch:
        prior_id = replayed_id(stored, fingerprint)
        batch = self.get(prior_id)
        if batch is None:
            raise IdempotentResultExpired(prior_id)
        return SubmittedBatch(batch, replayed=True)

    def get(self, batch_id: str) -> Batch | None:
        record = self.redis.hgetall(self.keys.batch(batch_id))
        return batch_from_record(record) if record else None

    def results(self, batch_id: str) -> Iterator[str]:
        """The result lines of the requests that ended so far, in the order they ended."""
        key, start = self.keys.batch_results(batch_id), 0
        while True:
            lines = self.redis.lrange(key, start, start + RESULTS_CHUNK - 1)
            yield from lines
            if len(lines) < RESULTS_CHUNK:
                return
            start += len(lines)

    def cancel(self, batch_id: str) -> Batch | None:
        """Cancel the requests that have not started; running ones finish. The batch is
        ``cancelling`` until its last running request ends, then ``cancelled``.

        Workers also refuse to start a request of a cancelling batch, so a request this
        sweep misses (read by a worker meanwhile) is cancelled all the same, and cancelling
        again sweeps again (after a gateway died midway, say)."""
        key = self.keys.batch(batch_id)
        model = self.redis.hget(key, "model")
        if model is None:
            return None
        before = self._cancel(keys=[key], args=[repr(time.time())])
        if before in ("queued", "in_progress", "cancelling"):  # again: finishes a cut sweep
            job_ids_key = self.keys.batch_jobs(batch_id)
            length = self.redis.llen(job_ids_key)
            for start in range(0, length, WRITE_CHUNK):
                job_ids = self.redis.lrange(job_ids_key, start, start + WRITE_CHUNK - 1)
                self.jobs.end_queued(model, job_ids, JobStatus.CANCELED)
        return self.get(batch_id)
