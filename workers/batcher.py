"""The GPU worker's micro-batch loop: read a micro-batch from the model's streams, run it,
store, ack.

It runs in its own thread inside the Celery worker (see :mod:`workers.bootstep`), so the
worker's event loop keeps answering heartbeats and remote control while a micro-batch
generates.
One loop iteration is a short list of named steps::

    retries (own pending after a restart or outage; entries of dead workers, now and then)
      or read a micro-batch (interactive lane first, then batch)
      ->  start  ->  infer  ->  finish (store + ack)

Retried entries may be what killed a worker, so they are taken and run one at a time, and
one delivered more than MAX_DELIVERIES times is dead-lettered instead. Shutdown is warm:
:meth:`MicroBatchLoop.request_stop` lets the current micro-batch finish and be acknowledged
first. (A *micro-batch* is the rows of one generate() call; a *batch* is the Batch API's
many jobs submitted at once, which reach this loop as entries of the batch lane.)
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field

import redis

from shared.job_consumer import DEADLINE_ERROR, Entry, JobConsumer, StartedJob
from shared.protocol import JobError, Output, Usage
from shared.records import terminal_fields
from shared.settings import Settings
from shared.states import JobStatus
from workers.engine import INTERRUPTIONS, Completion, Engine, PromptTooLong
from workers.flower_tasks import FlowerTasks
from workers.metrics import WorkerMetrics
from workers.token_writer import RowSink, TokenWriter

log = logging.getLogger(__name__)

READ_BLOCK_MS = 1000  # how long an idle read waits, which bounds how fast stop is noticed
FILL_POLL_S = 0.002  # between reads while a micro-batch fills
RECONNECT_DELAY_S = (0.5, 1, 2, 5)


@dataclass
class MicroBatchResult:
    """What one micro-batch produced: the fields to store per entry, and its numbers."""

    stored: list[tuple[Entry, dict[str, str]]]
    completions: dict[str, Completion]
    failures: dict[str, JobError]
    seconds: float
    last_deltas: dict[str, tuple[str, int]] = field(default_factory=dict)  # streaming jobs
    # Wall time the worker spent on it alone, for tokens per second; micro-batches never
    # overlap, so it is ``seconds`` unless set (a continuous loop's admissions do overlap).
    busy_seconds: float | None = None

    def statuses(self) -> Counter[str]:
        return Counter(fields["status"] for _, fields in self.stored)


@dataclass
class LoopStats:
    """Counters shown in ``celery inspect stats`` and Flower's worker page."""

    batches: int = 0
    jobs_succeeded: int = 0
    jobs_failed: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=20))  # (end time, tokens, s)

    def record(self, completions: list[Completion], failed: int, seconds: float) -> None:
        self.batches += 1
        self.jobs_succeeded += len(completions)
        self.jobs_failed += failed
        tokens = sum(c.completion_tokens for c in completions)
        self.prompt_tokens += sum(c.prompt_tokens for c in completions)
        self.generated_tokens += tokens
        self.recent.append((time.time(), tokens, seconds))

    def tokens_per_second(self, window_s: float = 60.0) -> float:
        recent = [(t, s) for end, t, s in self.recent if end > time.time() - window_s]
        busy = sum(s for _, s in recent)
        return round(sum(t for t, _ in recent) / busy, 2) if busy else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {
            "batches": self.batches,
            "jobs_succeeded": self.jobs_succeeded,
            "jobs_failed": self.jobs_failed,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "recent_tokens_per_second": self.tokens_per_second(),
        }


class MicroBatchLoop:
    """Pulls micro-batches of one model's stream and runs them on one loaded engine."""

    def __init__(
        self,
        settings: Settings,
        jobs: JobConsumer,
        engine: Engine,
        worker: str,
        tasks: FlowerTasks | None = None,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.tasks = tasks
        self.metrics = metrics
        self.jobs = jobs
        self.engine = engine
        self.worker = worker
        self.model = settings.served_model
        self.stats = LoopStats()
        self.busy_since: float | None = None
        self.in_flight: list[Entry] = []  # refreshed every heartbeat so no one claims them
        self.canceled: set[str] = set()  # job ids of the running micro-batch a client canceled
        self._next_claim = 0.0
        self._stop = threading.Event()

    def request_stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def run(self) -> None:
        """Serve until asked to stop. Redis outages are waited out, never fatal."""
        failures = 0
        recovering = True  # a (re)started worker first finishes what it read but never acked
        while not self.stopping:
            try:
                if recovering:
                    self.jobs.ensure_groups(self.model)
                    retries = self.jobs.read(self.model, self.worker, 1, None, own_pending=True)
                    recovering = bool(retries)
                else:
                    retries = self.claim_abandoned()
                if retries:
                    self.run_retries(retries)
                else:
                    self.serve_next()
                failures = 0
            except redis.RedisError as exc:
                delay = RECONNECT_DELAY_S[min(failures, len(RECONNECT_DELAY_S) - 1)]
                log.warning("redis unavailable (%s); retrying in %ss", exc, delay)
                failures, recovering = failures + 1, True
                self.abandon_running()
                self._stop.wait(delay)

    def serve_next(self) -> None:
        """Take new work and run it: here, one whole micro-batch."""
        self.run_micro_batch(self.next_micro_batch())

    def abandon_running(self) -> None:
        """After a Redis outage, whatever still runs is read again from own pending; a
        micro-batch has already ended by then, so there is nothing to drop here."""

    # --- steps ---------------------------------------------------------------------------

    def claim_abandoned(self) -> list[Entry]:
        """Take over an entry whose worker died (idle past CLAIM_IDLE_S); look again once a
        heartbeat after finding none."""
        if time.monotonic() < self._next_claim:
            return []
        idle_ms = int(self.settings.claim_idle_s * 1000)
        claimed = self.jobs.claim_abandoned(self.model, self.worker, idle_ms, 1)
        if not claimed:
            self._next_claim = time.monotonic() + self.settings.worker_heartbeat_s
        return claimed

    def run_retries(self, entries: list[Entry]) -> None:
        """Dead-letter a poison entry, or run it alone, in case it is what killed a worker.

        Retries are taken one entry at a time (COUNT 1), so each re-delivery counted against
        an entry is a real attempt to run it, never a ride-along with a poison batch-mate.
        """
        delivered = self.jobs.times_delivered(self.model, self.worker, entries)
        for entry in entries:
            if delivered[entry.entry_id] > self.settings.max_deliveries:
                log.error("job %s dead-lettered after %d deliveries", entry.job_id,
                          delivered[entry.entry_id])  # fmt: skip
                self.jobs.dead_letter(self.model, entry, delivered[entry.entry_id])
            else:
                self.run_micro_batch([entry])

    def next_micro_batch(self) -> list[Entry]:
        """Wait for a first entry, then up to MAX_BATCH_WAIT_MS for the micro-batch to fill.

        Interactive entries come first; batch entries only fill what they leave."""
        size = self.settings.max_batch_size
        entries = self.jobs.read_next(self.model, self.worker, size, READ_BLOCK_MS)
        # Fill by polling: Redis checks BLOCK timeouts only ~10 times a second (hz 10), so a
        # blocking read of a few ms can take 100 ms.
        deadline = time.monotonic() + self.settings.max_batch_wait_ms / 1000
        while entries and len(entries) < size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            more = self.jobs.read_next(self.model, self.worker, size - len(entries), None)
            if more:
                entries.extend(more)
            else:
                time.sleep(min(left, FILL_POLL_S))
        return entries

    def run_micro_batch(self, entries: list[Entry]) -> None:
        if not entries:
            return
        self.in_flight = entries
        try:
            started, dropped = self.jobs.start(self.model, entries, self.worker)
            if dropped:
                self.jobs.drop(self.model, dropped)
            if not started:
                return
            task_id = str(uuid.uuid4())  # the micro-batch's Flower task
            self._busy(task_id, started)
            try:
                result = self.infer(started)
            except Exception as exc:
                if self.tasks:
                    self.tasks.failed(task_id, repr(exc), traceback.format_exc())
                raise
            finally:
                self._busy(None, started)
            self.jobs.finish(self.model, result.stored, result.last_deltas)
            self.report(task_id, result)
        finally:
            self.in_flight, self.canceled = [], set()

    def _busy(self, task_id: str | None, jobs: list[StartedJob]) -> None:
        self.busy_since = time.monotonic() if task_id else None
        if self.metrics:
            self.metrics.busy(task_id is not None)
            self.metrics.running(len(jobs) if task_id else 0)
        if task_id and self.tasks:
            self.tasks.started(task_id, [j.entry.job_id for j in jobs])

    def report(self, task_id: str, result: MicroBatchResult) -> None:
        """Counters for inspect stats, Prometheus, and the micro-batch's task in Flower."""
        completions = list(result.completions.values())
        busy = result.seconds if result.busy_seconds is None else result.busy_seconds
        self.stats.record(completions, len(result.failures), busy)
        generated = sum(c.completion_tokens for c in completions)
        if self.metrics:
            prompt = sum(c.prompt_tokens for c in completions)
            self.metrics.micro_batch(
                len(result.stored), result.seconds, prompt, generated, result.statuses()
            )
        if not self.tasks:
            return
        if result.failures:
            summary = "; ".join(
                f"{job}: {e.code}: {e.message}" for job, e in result.failures.items()
            )
            self.tasks.failed(
                task_id, f"{len(result.failures)} of {len(result.stored)} jobs failed: {summary}"
            )
        else:
            outcome = {"jobs": len(result.stored), "generated_tokens": generated}
            self.tasks.succeeded(task_id, result.seconds, outcome | dict(result.statuses()))

    def watch_cancels(self) -> None:
        """Called by the heartbeat thread often: note which running jobs were canceled."""
        entries = self.in_flight
        if entries and self.busy_since is not None:
            self.canceled = self.jobs.cancel_requested(self.model, [e.job_id for e in entries])

    def infer(self, jobs: list[StartedJob]) -> MicroBatchResult:
        """Generate for every job; a job that fails on its own input fails alone."""
        began = time.monotonic()
        failures: dict[str, JobError] = {}
        runnable, prompts = [], []
        for job in jobs:
            ids = self.prompt_of(job)
            if isinstance(ids, JobError):
                failures[job.entry.job_id] = ids
                continue
            self._maybe_crash(job)
            runnable.append(job)
            prompts.append(ids)
        writer = None
        if any(job.stream for job in runnable):
            cap = self.settings.max_new_tokens_limit + 16
            writer = TokenWriter(self.jobs, self.model, cap)
        completions = self._generate(runnable, prompts, failures, writer)
        seconds = time.monotonic() - began
        results = [
            (
                job.entry,
                terminal_result(
                    completions.get(job.entry.job_id),
                    failures.get(job.entry.job_id),
                    seconds,
                    len(jobs),
                ),
            )
            for job in jobs
        ]
        last = writer.take_last() if writer else {}
        return MicroBatchResult(results, completions, failures, seconds, last)

    def prompt_of(self, job: StartedJob) -> list[int] | JobError:
        """The job's prompt ids, or why its input cannot run (then it fails alone)."""
        try:
            ids = self.engine.prompt_ids(job.input)
            self.engine.check_fits(ids, job.input)
        except PromptTooLong as exc:
            return JobError(code="prompt_too_long", message=str(exc))
        except Exception as exc:  # a template or tokenizer error on this input alone
            return JobError(code="invalid_input", message=str(exc))
        return ids

    def _generate(
        self,
        jobs: list[StartedJob],
        prompts: list[list[int]],
        failures: dict[str, JobError],
        writer: TokenWriter | None = None,
    ) -> dict[str, Completion]:
        """Run the micro-batch; if it raises, run each job alone to find the one that fails.
        Streaming jobs send their text to ``writer`` as it is generated."""
        if not jobs:
            return {}

        def interrupt(i: int) -> str | None:
            if jobs[i].entry.job_id in self.canceled:
                return "canceled"
            deadline = jobs[i].deadline
            return "expired" if deadline is not None and time.time() > deadline else None

        sink = None
        if writer is not None and any(j.stream for j in jobs):
            sink = RowSink(writer, [j.entry.job_id if j.stream else None for j in jobs])
        try:
            outs = self.engine.generate([j.input for j in jobs], prompts, interrupt, sink)
            return {j.entry.job_id: c for j, c in zip(jobs, outs, strict=True)}
        except Exception:
            if len(jobs) == 1:
                log.exception("job %s failed", jobs[0].entry.job_id)
                failures[jobs[0].entry.job_id] = JobError(
                    code="inference_error", message="the model failed on this input"
                )
                return {}
            log.exception("micro-batch of %d failed; retrying its jobs one by one", len(jobs))
        if writer is not None:
            writer.restart([j.entry.job_id for j in jobs if j.stream])
        completions: dict[str, Completion] = {}
        for job, ids in zip(jobs, prompts, strict=True):
            completions.update(self._generate([job], [ids], failures, writer))
        return completions

    def _maybe_crash(self, job: StartedJob) -> None:
        """Fault injection for tests (FAULT_CRASH_MARKER): die the way an OOM kill does."""
        marker = self.settings.fault_crash_marker
        if marker and marker in (job.input.prompt or ""):
            log.error("fault injection: crashing on job %s", job.entry.job_id)
            os.kill(os.getpid(), signal.SIGKILL)


def terminal_result(
    completion: Completion | None, error: JobError | None, seconds: float, batch_size: int
) -> dict[str, str]:
    """A job's terminal fields: succeeded with its output, canceled or expired (its run was
    interrupted), or failed with its error."""
    if completion is not None and completion.finish_reason in INTERRUPTIONS:
        expired = completion.finish_reason == "expired"
        return terminal_fields(
            status=JobStatus.EXPIRED if expired else JobStatus.CANCELED,
            error=DEADLINE_ERROR if expired else None,
            inference_seconds=seconds,
            batch_size=batch_size,
        )
    if completion is not None:
        return terminal_fields(
            status=JobStatus.SUCCEEDED,
            output=_output(completion),
            inference_seconds=seconds,
            batch_size=batch_size,
        )
    assert error is not None, "a job ends with a completion or an error"
    return terminal_fields(
        status=JobStatus.FAILED, error=error, inference_seconds=seconds, batch_size=batch_size
    )


def _output(c: Completion) -> Output:
    return Output(
        text=c.text,
        finish_reason=c.finish_reason,
        usage=Usage(prompt_tokens=c.prompt_tokens, completion_tokens=c.completion_tokens),
    )
