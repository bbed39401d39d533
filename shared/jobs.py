"""The job: its Redis key names, its request and response schema, and its stored record.

Gateway and workers both import this module, so a key name or a field means one thing in
the whole fleet. The operations on these keys live in :mod:`shared.queue`.

Key scheme (``P`` is ``KEY_PREFIX``, default ``fleet``)::

    P:job:{id}            hash    one job's record (fields of JobRecord); expires
                                  RESULT_TTL_S after it reaches a terminal state
    P:stream:{model}      stream  the model's interactive queue; entries are {job: id};
                                  consumer group "workers"; an entry is deleted once acked
    P:batch-stream:{model} stream the model's batch queue (same shape): workers read it only
                                  when the interactive one has nothing for them
    P:workers:{model}     zset    worker name -> unix time of its last heartbeat
    P:worker:{name}       hash    what a worker serves (model, device, loaded_at); expires
    P:job-finished        channel job ids, published when a job reaches a terminal state
    P:dead:{model}        stream  dead letters: entries delivered more than MAX_DELIVERIES
                                  times, {job, entry, deliveries, at}
    P:idem:{key}          string  Idempotency-Key -> "job id fingerprint"; expires in 24 h
    P:stats:{model}       hash    counters for metrics: submitted, finished:{status}, and
                                  latency / wait histograms ({name}:{bucket}, {name}:sum)
    P:recent:{model}      list    the last 1000 ended jobs, "completed_at latency status"
    P:batch:{id}          hash    one batch (fields of the batch object, counters, webhook);
                                  expires RESULT_TTL_S after it completes or is cancelled
    P:batch-jobs:{id}     list    the batch's job ids, in input order
    P:batch-results:{id}  list    one JSONL result line per ended request, in end order
    P:events              stream  outbox of webhook events {type, id, url}, written in the same
                                  script as the transition; consumer group "webhooks"
    P:webhook-owner:{id}  list    delivery ids of the webhooks sent about a job or batch
    P:webhook:{id}        hash    one webhook delivery (webhooks.store): url, type, payload,
                                  state, attempts; expires RESULT_TTL_S after its last write
                                  plus the wait for its next attempt
    P:webhook-attempts:{id} list  that delivery's attempts, one JSON object each
    P:webhook-celery:*    (kombu) the webhooks Celery app's broker keys (queue "webhooks",
                                  unacked), kept apart from the GPU workers' broker keys
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

CONSUMER_GROUP = "workers"
EVENTS_GROUP = "webhooks"
# Histogram buckets (seconds) of job latency and queue wait, kept in P:stats:{model}.
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 3600)


class Keys:
    """Every Redis key name the fleet uses, under one prefix so fleets can share a Redis."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.job_finished_channel = f"{prefix}:job-finished"

    def job(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def stream(self, model: str, lane: Lane | str = "interactive") -> str:
        if lane == Lane.BATCH:
            return f"{self.prefix}:batch-stream:{model}"
        return f"{self.prefix}:stream:{model}"

    def batch(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}"

    def batch_jobs(self, batch_id: str) -> str:
        return f"{self.prefix}:batch-jobs:{batch_id}"

    def batch_results(self, batch_id: str) -> str:
        return f"{self.prefix}:batch-results:{batch_id}"

    def events(self) -> str:
        return f"{self.prefix}:events"

    def webhook_owner(self, owner_id: str) -> str:
        return f"{self.prefix}:webhook-owner:{owner_id}"

    def workers(self, model: str) -> str:
        return f"{self.prefix}:workers:{model}"

    def worker(self, name: str) -> str:
        return f"{self.prefix}:worker:{name}"

    def dead_letters(self, model: str) -> str:
        return f"{self.prefix}:dead:{model}"

    def idempotency(self, key: str) -> str:
        return f"{self.prefix}:idem:{key}"

    def stats(self, model: str) -> str:
        return f"{self.prefix}:stats:{model}"

    def recent(self, model: str) -> str:
        return f"{self.prefix}:recent:{model}"

    def webhook(self, delivery_id: str) -> str:
        return f"{self.prefix}:webhook:{delivery_id}"

    def webhook_attempts(self, delivery_id: str) -> str:
        return f"{self.prefix}:webhook-attempts:{delivery_id}"

    def webhook_broker_prefix(self) -> str:
        """kombu's global_keyprefix for the webhooks Celery app."""
        return f"{self.prefix}:webhook-celery:"


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

# Webhook events about a job; ``job.failed`` covers failed and expired jobs.
JobEvent = Literal["job.started", "job.completed", "job.failed", "job.canceled"]
DEFAULT_JOB_EVENTS: tuple[str, ...] = ("job.completed", "job.failed", "job.canceled")
WebhookURL = Annotated[str, Field(min_length=1, max_length=2048)]


def new_job_id() -> str:
    return f"job_{uuid.uuid4().hex}"


def is_job_id(value: str) -> bool:
    return value.startswith("job_") and len(value) == 36 and value[4:].isalnum()


# --- request schema ----------------------------------------------------------------------


class _Strict(BaseModel):
    """Unknown fields and type coercions (\"5\" for 5) are errors, not silently accepted."""

    model_config = ConfigDict(extra="forbid", strict=True)


class Message(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=1_000_000)


MetadataKey = Annotated[str, Field(min_length=1, max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]
StopString = Annotated[str, Field(min_length=1, max_length=64)]


class GenerationParams(_Strict):
    """How to generate; each job in a micro-batch gets exactly these."""

    max_new_tokens: int = Field(
        128, ge=1, description="Most tokens to generate; at most MAX_NEW_TOKENS_LIMIT."
    )
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 is greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    stop: list[StopString] = Field(
        default_factory=list, max_length=4, description="Generation ends before any of these."
    )
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Makes sampling reproducible.")

    @field_validator("max_new_tokens")
    @classmethod
    def _within_limit(cls, value: int, info: ValidationInfo) -> int:
        limit = (info.context or {}).get("max_new_tokens_limit")
        if limit is not None and value > limit:
            raise ValueError(f"must be at most {limit} (MAX_NEW_TOKENS_LIMIT)")
        return value

    @model_validator(mode="after")
    def _default_within_limit(self, info: ValidationInfo) -> GenerationParams:
        limit = (info.context or {}).get("max_new_tokens_limit")
        if limit is not None and "max_new_tokens" not in self.model_fields_set:
            self.max_new_tokens = min(self.max_new_tokens, limit)
        return self


class JobInput(GenerationParams):
    """What the worker needs to run a job: the prompt or messages, and the parameters."""

    prompt: str | None = Field(None, min_length=1, max_length=1_000_000)
    messages: list[Message] | None = Field(None, min_length=1, max_length=512)

    @model_validator(mode="after")
    def _prompt_xor_messages(self) -> JobInput:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


class JobCreate(JobInput):
    """Body of ``POST /v1/jobs``."""

    model: str | None = Field(None, description="Served model id. Default: the fleet's model.")
    timeout_s: float | None = Field(
        None,
        gt=0,
        le=7 * 86_400,
        description="Deadline from submission: queued past it, the "
        "job ends expired without running; running past it, it is stopped and ends expired.",
    )
    metadata: dict[MetadataKey, MetadataValue] = Field(
        default_factory=dict, max_length=16, description="Your own labels, returned as given."
    )
    webhook: WebhookURL | None = Field(
        None,
        description="http(s) URL that receives signed events about this job (Standard "
        "Webhooks). Loopback, private and metadata addresses are refused.",
    )
    webhook_events: list[JobEvent] | None = Field(
        None,
        min_length=1,
        description="Which events to send. Default: job.completed, job.failed, job.canceled.",
    )

    @model_validator(mode="after")
    def _events_need_webhook(self) -> JobCreate:
        if self.webhook_events is not None and self.webhook is None:
            raise ValueError("'webhook_events' needs a 'webhook' URL")
        return self


# --- response schema ---------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int


class Output(BaseModel):
    text: str
    finish_reason: Literal["stop", "length"]
    usage: Usage


class JobError(BaseModel):
    code: str
    message: str


class JobMetrics(BaseModel):
    queue_seconds: float | None = None
    inference_seconds: float | None = None
    batch_size: int | None = None


class Job(BaseModel):
    """The job object every endpoint returns."""

    id: str
    object: Literal["job"] = "job"
    status: JobStatus
    model: str
    batch_id: str | None = None
    custom_id: str | None = None
    created_at: str
    started_at: str | None = None
    completed_at: str | None = None
    deadline: str | None = None
    cancel_requested: bool = False
    input: dict[str, Any]
    output: Output | None = None
    error: JobError | None = None
    metrics: JobMetrics = Field(default_factory=JobMetrics)
    worker: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    webhook: str | None = None
    webhook_events: list[str] | None = None
    urls: dict[str, str] = Field(default_factory=dict)


# --- the stored record -------------------------------------------------------------------


def rfc3339(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def new_record(
    job_id: str,
    model: str,
    job_input: JobInput,
    metadata: dict[str, str],
    timeout_s: float | None = None,
    extra: dict[str, str] | None = None,
    now: float | None = None,
) -> dict[str, str]:
    """The hash a new job is stored as (all values are strings, as Redis keeps them).

    ``extra`` holds the webhook and batch fields (:func:`webhook_fields`, batch_fields).
    """
    now = time.time() if now is None else now
    record = {
        "id": job_id,
        "model": model,
        "status": JobStatus.QUEUED.value,
        "created_at": repr(now),
        # Only the JobInput fields, also when given a subclass (a batch line's custom_id is
        # a field of the record, not of the input).
        "input": job_input.model_dump_json(include=set(JobInput.model_fields), exclude_none=True),
        "metadata": json.dumps(metadata),
    }
    if timeout_s is not None:
        record["deadline"] = repr(now + timeout_s)
    return record | (extra or {})


def webhook_fields(keys: Keys, url: str | None, events: tuple[str, ...] | list[str]) -> dict:
    """Record fields that make the scripts queue these events for ``url`` (none if no url).

    The record names the events stream itself, so every script that ends a job can emit."""
    if not url or not events:
        return {}
    return {"webhook": url, "webhook_events": " ".join(events), "events_key": keys.events()}


def terminal_fields(
    *,
    status: JobStatus,
    output: Output | None = None,
    error: JobError | None = None,
    inference_seconds: float | None = None,
    batch_size: int | None = None,
) -> dict[str, str]:
    """The hash fields written when a job ends."""
    fields = {"status": status.value, "completed_at": repr(time.time())}
    if inference_seconds is not None:
        fields["inference_seconds"] = repr(inference_seconds)
    if batch_size is not None:
        fields["batch_size"] = str(batch_size)
    if output is not None:
        fields["output"] = output.model_dump_json()
    if error is not None:
        fields["error"] = error.model_dump_json()
    return fields


def job_from_record(record: dict[str, str]) -> Job:
    """Turn a job's hash back into the API object."""

    def ts(name: str) -> float | None:
        value = record.get(name)
        return float(value) if value else None

    created, started = ts("created_at"), ts("started_at")
    metrics = JobMetrics(
        queue_seconds=round(started - created, 6) if started and created else None,
        inference_seconds=ts("inference_seconds"),
        batch_size=int(record["batch_size"]) if record.get("batch_size") else None,
    )
    urls = {"get": f"/v1/jobs/{record['id']}", "cancel": f"/v1/jobs/{record['id']}/cancel"}
    if record.get("webhook"):
        urls["webhook_deliveries"] = f"/v1/jobs/{record['id']}/webhook_deliveries"
    return Job(
        id=record["id"],
        status=JobStatus(record["status"]),
        model=record["model"],
        batch_id=record.get("batch") or None,
        custom_id=record.get("custom_id"),
        created_at=rfc3339(created) or "",
        started_at=rfc3339(started),
        completed_at=rfc3339(ts("completed_at")),
        deadline=rfc3339(ts("deadline")),
        cancel_requested=record.get("cancel_requested") == "1",
        input=json.loads(record.get("input") or "{}"),
        output=Output.model_validate_json(record["output"]) if record.get("output") else None,
        error=JobError.model_validate_json(record["error"]) if record.get("error") else None,
        metrics=metrics,
        worker=record.get("worker") or None,
        metadata=json.loads(record.get("metadata") or "{}"),
        webhook=record.get("webhook") or None,
        webhook_events=record["webhook_events"].split() if record.get("webhook") else None,
        urls=urls,
    )
