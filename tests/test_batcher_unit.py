"""The batch loop's failure isolation, with a fake engine (the real path is in test_faults
and test_observability: a job too long for the context fails alone)."""

from __future__ import annotations

from shared.job_consumer import Entry, StartedJob
from shared.protocol import JobInput
from shared.settings import Settings
from workers.batcher import MicroBatchLoop
from workers.engine import Completion


class RaisingEngine:
    """Generates one token per job, but raises on any batch holding a 'boom' prompt."""

    def prompt_ids(self, job: JobInput) -> list[int]:
        return [1, 2, 3]

    def check_fits(self, ids, job) -> None:
        pass

    def generate(self, jobs, prompts=None, interrupt=None, sink=None):
        if any(j.prompt == "boom" for j in jobs):
            raise RuntimeError("CUDA error: device-side assert triggered")
        return [Completion("ok", "length", 3, 1) for _ in jobs]


def _job(i: int, prompt: str) -> StartedJob:
    return StartedJob(Entry(f"{i}-0", f"job_{i}"), JobInput(prompt=prompt), 0.0, None)


def test_a_job_that_breaks_the_batch_fails_alone():
    loop = MicroBatchLoop(Settings(), jobs=None, engine=RaisingEngine(), worker="w")
    jobs = [_job(1, "fine"), _job(2, "boom"), _job(3, "also fine")]
    result = loop.infer(jobs)
    statuses = {entry.job_id: fields["status"] for entry, fields in result.stored}
    assert statuses == {"job_1": "succeeded", "job_2": "failed", "job_3": "succeeded"}
    assert result.failures["job_2"].code == "inference_error"
    assert all(fields["batch_size"] == "3" for _, fields in result.stored)
