"""The worker loop of a continuous-batching engine (ENGINE=vllm): feed it from the stream at
every step, store each job the moment its sequence ends.

One turn of the loop::

    admit (free slots? read that many entries, interactive lane first; start; add)
      ->  interrupt (abort canceled and expired jobs)
      ->  step (one prefill or decode step of every running sequence)
      ->  stream (each streaming job's new text, one round trip)
      ->  finish (each ended job: store + ack, atomic, at once)

An idle worker blocks on the stream for its first entry; a busy one only polls, between
steps, and only when a slot is free. Retries (own pending after a restart, entries of dead
workers) run alone, after the running sequences end, as in :class:`MicroBatchLoop`. Warm
shutdown stops admitting and lets what runs end and be stored. Everything else (recovery,
claims, dead letters, Redis outages, Flower, metrics) is the micro-batch loop's, inherited.
"""

from __future__ import annotations

import logging
import time
import traceback
import uuid
from dataclasses import dataclass, field

import redis

from shared.job_consumer import Entry, StartedJob
from shared.protocol import JobError
from workers.batcher import READ_BLOCK_MS, MicroBatchLoop, MicroBatchResult, terminal_result
from workers.engine import Completion
from workers.token_writer import TokenWriter
from workers.vllm_engine import VllmEngine, completion

log = logging.getLogger(__name__)

SHUTDOWN_REDIS_TRIES = 3


@dataclass
class RunningJob:
    """A job running in the engine, and what it has produced so far."""

    job: StartedJob
    admission: Admission
    prompt: list[int]  # token ids, kept to run it again alone if a step fails
    text: list[str] = field(default_factory=list)
    tokens: int = 0

    @property
    def job_id(self) -> str:
        return self.job.entry.job_id


@dataclass
class Admission:
    """The entries one read admitted: Flower shows them as one task, and the metrics count
    them as one micro-batch once the last of them ends."""

    task_id: str
    size: int
    began: float = field(default_factory=time.monotonic)
    stored: list[tuple[Entry, dict[str, str]]] = field(default_factory=list)
    completions: dict[str, Completion] = field(default_factory=dict)
    failures: dict[str, JobError] = field(default_factory=dict)


class ContinuousLoop(MicroBatchLoop):
    """Keeps up to MAX_BATCH_SIZE sequences running in a vLLM engine, fed from the stream."""

    engine: VllmEngine

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.running: dict[str, RunningJob] = {}
        self._reported_until = 0.0  # monotonic end of the busy time reports have counted
        cap = self.settings.max_new_tokens_limit + 16
        self.writer = TokenWriter(self.jobs, self.model, cap)

    # --- the loop --------------------------------------------------------------------

    def run(self) -> None:
        super().run()  # until asked to stop
        self.finish_running()

    def serve_next(self) -> None:
        free = self.settings.max_batch_size - len(self.running)
        if free > 0:
            block = None if self.running else READ_BLOCK_MS
            self.admit(self.jobs.read_next(self.model, self.worker, free, block))
        if self.running:
            self.step()

    def run_micro_batch(self, entries: list[Entry]) -> None:
        """Retries: run these alone, once the running sequences have ended."""
        while self.running:
            self.step()
        self.admit(entries)
        while self.running:
            self.step()

    def finish_running(self) -> None:
        """Warm shutdown: admit nothing more; let what runs end and be stored. If Redis stays
        down, the entries stay pending and another worker (or this one, restarted) reruns
        them."""
        tries = 0
        while self.running:
            try:
                self.step()
            except redis.RedisError as exc:
                tries += 1
                if tries >= SHUTDOWN_REDIS_TRIES:
                    log.warning("redis unavailable at shutdown (%s); leaving %d jobs pending",
                                exc, len(self.running))  # fmt: skip
                    self.abandon_running()
                    return
                time.sleep(1)

    def abandon_running(self) -> None:
        """After a Redis outage the running jobs are read again from own pending, so they
        leave the engine now rather than run twice."""
        if self.running:
            self.engine.abort(list(self.running))
            self.writer.take(self.running)
            self.running = {}
            self._changed()

    # --- steps -----------------------------------------------------------------------

    def admit(self, entries: list[Entry]) -> None:
        """Start these jobs and add them to the engine; one whose input cannot run fails
        alone, at once."""
        if not entries:
            return
        started, dropped = self.jobs.start(self.model, entries, self.worker)
        if dropped:
            self.jobs.drop(self.model, dropped)
        if not started:
            return
        admission = Admission(str(uuid.uuid4()), len(started))
        if self.tasks:
            self.tasks.started(admission.task_id, [j.entry.job_id for j in started])
        failed = []
        for job in started:
            ids = self.prompt_of(job)
            if isinstance(ids, JobError):
                admission.failures[job.entry.job_id] = ids
                failed.append(job)
                continue
            self._maybe_crash(job)
            self.engine.add(job.entry.job_id, ids, job.input)
            self.running[job.entry.job_id] = RunningJob(job, admission, ids)
        self._changed()
        if failed:
            errors = admission.failures
            results = [
                (job.entry, terminal_result(None, errors[job.entry.job_id], 0.0, len(started)))
                for job in failed
            ]
            self.jobs.finish(self.model, results)
            admission.stored += results
            self._maybe_report(admission)

    def step(self) -> None:
        """Interrupt, run one engine step, stream what it produced, finish what ended."""
        ended: list[tuple[RunningJob, Completion]] = self.interrupt()
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self.engine_failed(exc)
            return
        for out in outputs:
            seq = self.running.get(out.job_id)
            if seq is None:
                continue  # the warm-up, or a job ended here already
            seq.tokens += out.tokens
            if out.delta:
                seq.text.append(out.delta)
                if seq.job.stream:
                    self.writer.add(seq.job_id, out.delta)
            if out.finish_reason is not None:
                text = "".join(seq.text)
                ended.append((seq, completion(text, out.finish_reason, len(seq.prompt),
                                              seq.tokens)))  # fmt: skip
        self.writer.flush()
        if ended:
            self.finish(ended)

    def interrupt(self) -> list[tuple[RunningJob, Completion]]:
        """Abort the jobs a client canceled (noted by the heartbeat) or whose deadline passed:
        they end now, with the text they had."""
        now = time.time()
        ended = []
        for seq in self.running.values():
            reason = None
            if seq.job_id in self.canceled:
                reason = "canceled"
            elif seq.job.deadline is not None and now > seq.job.deadline:
                reason = "expired"
            if reason:
                text = "".join(seq.text)
                ended.append((seq, Completion(text, reason, len(seq.prompt), seq.tokens)))
        if ended:
            self.engine.abort([seq.job_id for seq, _ in ended])
        return ended

    def finish(self, ended: list[tuple[RunningJob, Completion]]) -> None:
        """Store + ack each ended job (one atomic step each, with its last stream text),
        then let it leave the running set."""
        running = len(self.running)
        results = []
        for seq, done in ended:
            seconds = time.monotonic() - seq.admission.began
            results.append((seq.job.entry, terminal_result(done, None, seconds, running)))
        last = self.writer.take([seq.job_id for seq, _ in ended if seq.job.stream])
        self.jobs.finish(self.model, results, last)
        for (seq, done), result in zip(ended, results, strict=True):
            self.running.pop(seq.job_id, None)
            seq.admission.stored.append(result)
            seq.admission.completions[seq.job_id] = done
            self._maybe_report(seq.admission)
        self._changed()

    def engine_failed(self, exc: Exception) -> None:
        """A step raised. One running job: it fails alone. Several: each runs again alone,
        to find the one that fails (as a failed micro-batch is retried row by row)."""
        sequences = list(self.running.values())
        self.engine.abort(list(self.running))
        self.running = {}
        if len(sequences) == 1:
            seq = sequences[0]
            log.error("job %s failed: %r", seq.job_id, exc)
            if self.tasks:
                self.tasks.failed(seq.admission.task_id, repr(exc), traceback.format_exc())
            error = JobError(code="inference_error", message="the model failed on this input")
            self.writer.take([seq.job_id])
            result = (seq.job.entry, terminal_result(None, error, 0.0, 1))
            self.jobs.finish(self.model, [result])
            seq.admission.stored.append(result)
            seq.admission.failures[seq.job_id] = error
            self._changed()
            self._maybe_report(seq.admission)
            return
        log.exception("an engine step of %d jobs failed; running each alone", len(sequences))
        self.writer.restart([seq.job_id for seq in sequences if seq.job.stream])
        for seq in sequences:
            self.engine.add(seq.job_id, seq.prompt, seq.job.input)
            seq.text, seq.tokens = [], 0
            self.running = {seq.job_id: seq}
            self._changed()
            while self.running:
                self.step()

    # --- bookkeeping -----------------------------------------------------------------

    def _changed(self) -> None:
        """The running set changed: the heartbeat keeps these entries claimed and watches
        them for cancels; busy/idle goes to the metrics."""
        self.in_flight = [seq.job.entry for seq in self.running.values()]
        busy = bool(self.running)
        if self.metrics:
            self.metrics.running(len(self.running))
        if busy != (self.busy_since is not None):
            self.busy_since = time.monotonic() if busy else None
            if self.metrics:
                self.metrics.busy(busy)
        if not busy:
            self.canceled = set()

    def _maybe_report(self, admission: Admission) -> None:
        """Once an admission's last job has ended. Its busy time is the part of its span no
        earlier report counted, so tokens per second adds up over overlapping admissions."""
        if len(admission.stored) == admission.size:
            now = time.monotonic()
            busy = now - max(admission.began, self._reported_until)
            self._reported_until = now
            result = MicroBatchResult(
                admission.stored, admission.completions, admission.failures,
                now - admission.began, busy_seconds=max(busy, 0.0),
            )  # fmt: skip
            self.report(admission.task_id, result)
