"""The state machines of a job and a batch: their statuses, lanes and webhook event names.

Defined once here; the request models, the record codec and the Lua scripts (which get
these values as constants, see :mod:`shared.scripts`) all use them.

A job::

    queued ──start──> running ──finish──> succeeded | failed | canceled | expired
      │                  └── cancel asked: stops at its next token ──> canceled
      └── cancel ──> canceled;  past its deadline ──> expired;  dead-lettered ──> failed

A terminal job never changes again, except when an operator re-queues its dead letter
(then it is ``queued`` anew). A batch::

    queued ──first request starts──> in_progress ──last request ends──> completed
      └──────────── cancel ────────────> cancelling ──last running ends──> cancelled
"""

from __future__ import annotations

from enum import StrEnum


class Lane(StrEnum):
    """A model's two queues. Workers fill micro-batches from batch only after interactive."""

    INTERACTIVE = "interactive"
    BATCH = "batch"


LANES = (Lane.INTERACTIVE, Lane.BATCH)  # in the order workers read them


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"
    EXPIRED = "expired"

    @property
    def terminal(self) -> bool:
        return self not in (JobStatus.QUEUED, JobStatus.RUNNING)


TERMINAL_STATUSES = frozenset(s.value for s in JobStatus if s.terminal)


class BatchStatus(StrEnum):
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def ended(self) -> bool:
        return self in (BatchStatus.COMPLETED, BatchStatus.CANCELLED)


class JobEvent(StrEnum):
    """Webhook events about a job; ``job.failed`` covers failed and expired jobs."""

    STARTED = "job.started"
    COMPLETED = "job.completed"
    FAILED = "job.failed"
    CANCELED = "job.canceled"


class BatchEvent(StrEnum):
    COMPLETED = "batch.completed"
    CANCELLED = "batch.cancelled"


class DeliveryState(StrEnum):
    """A webhook delivery's state."""

    PENDING = "pending"  # an attempt is due or running
    DELIVERED = "delivered"  # a 2xx answer
    FAILED = "failed"  # retries exhausted, a 4xx/3xx answer, or the URL was refused
    GONE = "gone"  # the receiver answered 410: do not send there again


DEFAULT_JOB_EVENTS = (JobEvent.COMPLETED, JobEvent.FAILED, JobEvent.CANCELED)
BATCH_EVENTS = tuple(BatchEvent)  # all of them, the default too

# The event a job's end sends, by its terminal status.
EVENT_OF_END = {
    JobStatus.SUCCEEDED: JobEvent.COMPLETED,
    JobStatus.FAILED: JobEvent.FAILED,
    JobStatus.EXPIRED: JobEvent.FAILED,
    JobStatus.CANCELED: JobEvent.CANCELED,
}
# The batch counter a request's end adds to, by its terminal status.
BATCH_COUNTER = {
    JobStatus.SUCCEEDED: "completed",
    JobStatus.FAILED: "failed",
    JobStatus.EXPIRED: "failed",
    JobStatus.CANCELED: "cancelled",
}
# The event a batch's end sends, by its final status.
EVENT_OF_BATCH_END = {
    BatchStatus.COMPLETED: BatchEvent.COMPLETED,
    BatchStatus.CANCELLED: BatchEvent.CANCELLED,
}
