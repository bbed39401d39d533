"""Writes streaming jobs' text deltas to their token streams, one round trip per decode step.

The engine hands over each row's safe delta as it is generated (:mod:`workers.text_stream`);
:meth:`TokenWriter.flush` sends what a step produced in one pipeline. Redis trouble never
stops a micro-batch: unsent text is kept and goes with the next flush, and whatever is still
unsent at the end travels with the job's result, in the same atomic step (``finish.lua``),
so a stream's deltas always add up to the job's output.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import redis

from shared.job_consumer import JobConsumer

log = logging.getLogger(__name__)


class TokenWriter:
    """Buffers the deltas of one micro-batch's streaming jobs and sends them per step."""

    def __init__(self, jobs: JobConsumer, model: str, cap: int) -> None:
        self.jobs = jobs
        self.model = model
        self.cap = cap  # entries a token stream keeps: more than a job can generate
        self._unsent: dict[str, list[str]] = {}
        self._index: dict[str, int] = {}  # the index of each job's next token event

    def add(self, job_id: str, delta: str) -> None:
        self._unsent.setdefault(job_id, []).append(delta)

    def flush(self) -> None:
        """Send every job's unsent text as one token event each; keep it if Redis fails."""
        batch = [
            (job_id, "".join(parts), self._index.get(job_id, 0))
            for job_id, parts in self._unsent.items()
            if parts
        ]
        if not batch:
            return
        try:
            self.jobs.append_tokens(self.model, batch, self.cap)
        except redis.RedisError as exc:
            log.warning("token streams: redis unavailable (%s); sending later", exc)
            return
        for job_id, _, index in batch:
            self._index[job_id] = index + 1
        self._unsent.clear()

    def restart(self, job_ids: list[str]) -> None:
        """These jobs run again from their first token (a failed micro-batch is retried row
        by row): readers drop what they got, and the unsent text is forgotten."""
        sent = [job_id for job_id in job_ids if self._index.get(job_id)]
        for job_id in job_ids:
            self._unsent.pop(job_id, None)
            self._index.pop(job_id, None)
        if sent:
            try:
                self.jobs.restart_tokens(self.model, sent)
            except redis.RedisError as exc:
                log.warning("token streams: could not restart %s: %s", sent, exc)

    def take_last(self) -> dict[str, tuple[str, int]]:
        """Each job's unsent text and its index, for ``finish.lua``; forgets the jobs."""
        return self.take(self._unsent.keys() | self._index.keys())

    def take(self, job_ids: Iterable[str]) -> dict[str, tuple[str, int]]:
        """The same for these jobs only: a continuous loop finishes its jobs one by one."""
        return {
            job_id: ("".join(self._unsent.pop(job_id, [])), self._index.pop(job_id, 0))
            for job_id in list(job_ids)
            if job_id in self._unsent or job_id in self._index
        }


class RowSink:
    """What the engine streams to: row i's delta belongs to job_ids[i] (None: not streaming);
    the end of each decode step flushes."""

    def __init__(self, writer: TokenWriter, job_ids: list[str | None]) -> None:
        self.writer = writer
        self.job_ids = job_ids

    def streams(self, row: int) -> bool:
        return self.job_ids[row] is not None

    def delta(self, row: int, text: str) -> None:
        job_id = self.job_ids[row]
        if job_id is not None and text:
            self.writer.add(job_id, text)

    def step(self) -> None:
        self.writer.flush()
