"""The gateway's side of the job queue: submit, read and cancel jobs.

Each change is one script (``submit.lua``, ``cancel.lua``, ``end_if.lua``); the worker's
side is :mod:`shared.job_consumer`. A cacheable job may be answered from the result cache
or follow an identical one as it is submitted (:mod:`shared.cache`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from shared.cache import fingerprint as cache_fingerprint
from shared.coalesce import Coalescer
from shared.idempotency import IDEMPOTENCY_TTL_S, IdempotentResultExpired, replayed_id
from shared.job_consumer import DEADLINE_ERROR, ensure_job_groups
from shared.keys import Keys
from shared.owner_index import OwnerIndex
from shared.protocol import Job, JobError, JobInput, new_job_id
from shared.records import job_from_record, new_record, terminal_fields
from shared.redis_client import FleetRedis
from shared.scripts import load, pairs
from shared.states import JobStatus


class OwnerQueueFull(Exception):
    """The API key has its cap (KEY_MAX_QUEUED) of unfinished jobs; nothing was written."""

    def __init__(self, unfinished: int) -> None:
        super().__init__(unfinished)
        self.unfinished = unfinished


@dataclass(frozen=True)
class Submitted:
    job: Job
    replayed: bool  # an earlier request with this Idempotency-Key made the job
    cache: str = ""  # hit, coalesced or miss for a cacheable job; '' for any other


class JobStore(FleetRedis):
    def __init__(self, client: redis.Redis, keys: Keys, result_ttl_s: int) -> None:
        super().__init__(client, keys, result_ttl_s)
        self._submit: Callable[..., Any] = load(client, "submit")
        self._end_if = load(client, "end_if")
        self._cancel = load(client, "cancel")
        self._groups: set[str] = set()  # models whose groups this process has made sure of

    def coalesce_submits(self, coalescer: Coalescer) -> None:
        """Send this process's concurrent submits in the coalescer's pipelines (a busy
        gateway)."""
        self._submit = coalescer.script(self._submit)

    def ensure_groups_once(self, model: str) -> None:
        """Before the first submit: so the lag is known (and KEDA can scale) before any
        worker has started."""
        if model not in self._groups:
            ensure_job_groups(self.redis, self.keys, model)
            self._groups.add(model)

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
        cache_owner: str | None = None,
        owner: str = "",
        queue_cap: int = 0,
        charged_tokens: int = 0,
    ) -> Submitted:
        """Queue a job. With an Idempotency-Key seen before, return that job instead.

        ``cache_owner`` (None: not cacheable) is whose cached results and running jobs it
        may share ('' everyone's): then it may end at once from the cache, or follow an
        identical job that is queued or running. ``owner`` is the API key that may see it
        ('' : any caller); past ``queue_cap`` unfinished jobs of that key (0: no cap)
        OwnerQueueFull is raised. ``charged_tokens`` were taken from the key's tokens per
        minute: what the job does not generate is given back when it ends.
        """
        self.ensure_groups_once(model)
        job_id, now = new_job_id(), time.time()
        record = new_record(job_id, model, job_input, metadata, timeout_s, extra, now)
        if owner:
            record["owner"] = owner
            if charged_tokens:
                record["charged"] = str(charged_tokens)
        cache_fp = "" if cache_owner is None else cache_fingerprint(record["input"], cache_owner)
        if cache_fp:
            record["cache_fp"] = cache_fp  # submit.lua keeps it only if the job leads
        keys = [self.keys.stream(model), self.keys.job(model, job_id), self.keys.stats(model)]
        if idempotency_key:
            keys.append(self.keys.idempotency(model, idempotency_key, owner))
        outcome, *value = self._submit(
            keys=keys,
            args=[job_id, fingerprint, IDEMPOTENCY_TTL_S, self.keys.base(model), cache_fp,
                  repr(now), self.result_ttl_s, self.keys.job_finished_channel, owner,
                  queue_cap if owner else 0, *pairs(record)],
        )  # fmt: skip
        if outcome == "created":
            return Submitted(job_from_record(record), False, "miss" if cache_fp else "")
        if outcome in ("hit", "follow"):  # the script returns the record it wrote
            flat = value[0]
            job = job_from_record(dict(zip(flat[::2], flat[1::2], strict=True)))
            return Submitted(job, False, "hit" if outcome == "hit" else "coalesced")
        if outcome == "full":
            raise OwnerQueueFull(int(value[0]))
        prior_id = replayed_id(value[0], fingerprint)
        prior = self.get(model, prior_id)
        if prior is None:
            raise IdempotentResultExpired(prior_id)
        return Submitted(prior, replayed=True)

    def recent(
        self, model: str, owner: str, after: str | None, limit: int
    ) -> tuple[list[Job], bool]:
        """One API key's recent jobs ('' : the jobs made without keys), newest first, a page
        after job ``after``; and whether more follow. UnknownCursor for a bad ``after``."""
        index = OwnerIndex(self.redis, lambda o: self.keys.jobs_of(model, o), self.result_ttl_s)

        def load(ids: Sequence[str]) -> list[Job | None]:
            pipe = self.redis.pipeline(transaction=False)
            for job_id in ids:
                pipe.hgetall(self.keys.job(model, job_id))
            return [job_from_record(r) if r else None for r in pipe.execute()]

        return index.page(owner, after, limit, load)

    def read_tokens(
        self,
        model: str,
        after: dict[str, str],
        block_ms: int | None,
        client: redis.Redis | None = None,
    ) -> list[tuple[str, str, dict[str, str]]]:
        """(job id, entry id, fields) of the token events after each given entry id ("0": from
        the first), oldest first per job; waits up to ``block_ms`` for one if there is none
        (on ``client``, whose pool holds the connections of waiting readers)."""
        streams = {self.keys.tokens(model, job_id): entry for job_id, entry in after.items()}
        reply = (client or self.redis).xread(streams, count=256, block=block_ms)
        prefix = len(self.keys.tokens(model, ""))
        return [
            (key[prefix:], entry_id, fields)
            for key, entries in reply or []
            for entry_id, fields in entries
        ]

    def get(self, model: str, job_id: str, owner: str | None = None) -> Job | None:
        """The job; a queued job past its deadline is expired on the way (no worker may be up).
        With an ``owner``, None unless that API key made it (None: anyone's)."""
        record = self.redis.hgetall(self.keys.job(model, job_id))
        if not record or (owner is not None and record.get("owner", "") != owner):
            return None
        deadline = record.get("deadline")
        if record["status"] == JobStatus.QUEUED and deadline and float(deadline) < time.time():
            fields = terminal_fields(status=JobStatus.EXPIRED, error=DEADLINE_ERROR)
            self._end(model, job_id, JobStatus.QUEUED, fields)
            record = self.redis.hgetall(self.keys.job(model, job_id)) or record
        return job_from_record(record)

    def cancel(self, model: str, job_id: str) -> Job | None:
        """Cancel a queued job now, or ask its worker to stop a running one at its next token
        (a job that follows another, or that others follow, ends now: ``cancel.lua``).

        Returns the job as it stands (None if unknown); a job already terminal is unchanged.
        """
        keys = self.keys
        status = self._cancel(
            keys=[keys.job(model, job_id), keys.stats(model), keys.recent(model)],
            args=[self.result_ttl_s, keys.job_finished_channel, job_id, keys.base(model),
                  *pairs(terminal_fields(status=JobStatus.CANCELED))],
        )  # fmt: skip
        return self.get(model, job_id) if status else None

    def end_queued(
        self, model: str, job_ids: list[str], status: JobStatus, error: JobError | None = None
    ) -> None:
        """End those of these jobs that are still queued (a batch's cancel or expiry sweep)."""
        fields = terminal_fields(status=status, error=error)
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            self._end(model, job_id, JobStatus.QUEUED, fields, client=pipe)
        pipe.execute()

    def _end(
        self,
        model: str,
        job_id: str,
        expected: JobStatus,
        fields: dict[str, str],
        client: redis.client.Pipeline | None = None,
    ) -> str:
        keys = self.keys
        return self._end_if(
            keys=[keys.job(model, job_id), keys.stats(model), keys.recent(model)],
            args=[expected.value, self.result_ttl_s, keys.job_finished_channel, job_id,
                  keys.base(model), *pairs(fields)],
            client=client,
        )  # fmt: skip
