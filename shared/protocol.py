"""The protocol: request and response models of the native API (jobs and batches).

Requests are strict: unknown fields, type coercions ("5" for 5) and out-of-range values
are 422s that name the field. Responses are what every endpoint and webhook returns. How
a job is stored is :mod:`shared.records`; its statuses are :mod:`shared.states`.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationInfo,
    field_validator,
    model_validator,
)

from shared.states import BATCH_EVENTS, BatchEvent, BatchStatus, JobEvent, JobStatus


def new_job_id() -> str:
    return f"job_{uuid.uuid4().hex}"


def is_job_id(value: str) -> bool:
    return value.startswith("job_") and len(value) == 36 and value[4:].isalnum()


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def is_batch_id(value: str) -> bool:
    return value.startswith("batch_") and len(value) == 38 and value[6:].isalnum()


# --- requests ----------------------------------------------------------------------------


class Strict_(BaseModel):
    """Unknown fields and type coercions (\"5\" for 5) are errors, not silently accepted."""

    model_config = ConfigDict(extra="forbid", strict=True)


class Message(Strict_):
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=1_000_000)


MetadataKey = Annotated[str, Field(min_length=1, max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]
StopString = Annotated[str, Field(min_length=1, max_length=64)]
WebhookURL = Annotated[str, Field(min_length=1, max_length=2048)]
# Event names arrive as strings: the enums take them by value (lax for this field alone).
JobEventName = Annotated[JobEvent, Strict(False)]
# A batch takes both kinds: one Literal of their values, so an error lists them all.
EventName = Literal[tuple(e.value for e in (*BatchEvent, *JobEvent))]  # type: ignore[misc]


class GenerationParams(Strict_):
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


# "Exactly one of prompt or messages" in JSON Schema, for the OpenAPI document: null counts
# as absent, so each branch needs its field present and not null.
PROMPT_XOR_MESSAGES = {
    "oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
    ]
}


class JobInput(GenerationParams):
    """What the worker needs to run a job: the prompt or messages, and the parameters."""

    model_config = ConfigDict(json_schema_extra=PROMPT_XOR_MESSAGES)

    prompt: str | None = Field(None, min_length=1, max_length=1_000_000)
    messages: list[Message] | None = Field(None, min_length=1, max_length=512)

    @model_validator(mode="after")
    def _prompt_xor_messages(self) -> JobInput:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


CACHE_FIELD = (
    "A greedy (temperature 0) or seeded request may be answered from the result cache, or "
    "follow an identical one that is queued or running (metrics.cache_hit, "
    "metrics.coalesced); false: always run it anew."
)


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
    webhook_events: list[JobEventName] | None = Field(
        None,
        min_length=1,
        description="Which events to send. Default: job.completed, job.failed, job.canceled.",
    )
    stream: bool = Field(
        False,
        description="Stream the text as it is generated: the answer is the job's event stream "
        "(text/event-stream, as GET /v1/jobs/{id}/events), not the job object.",
    )
    cache: bool = Field(True, description=CACHE_FIELD)

    @model_validator(mode="after")
    def _events_need_webhook(self) -> JobCreate:
        if self.webhook_events is not None and self.webhook is None:
            raise ValueError("'webhook_events' needs a 'webhook' URL")
        return self


class BatchRequest(JobInput):
    """One line of a batch: a job's input and the caller's id for matching results."""

    custom_id: str = Field(min_length=1, max_length=64, description="Unique within the batch.")
    cache: bool = Field(True, description=CACHE_FIELD)


class BatchOptions(Strict_):
    """Everything about a batch but its requests (JSON body fields, or JSONL query params)."""

    model: str | None = Field(None, description="Served model id. Default: the fleet's model.")
    webhook: WebhookURL | None = Field(None, description="Receives signed events.")
    webhook_events: list[EventName] | None = Field(
        None,
        min_length=1,
        description="Default: batch.completed, batch.cancelled. job.* events are sent for "
        "each request only when listed here.",
    )
    metadata: dict[MetadataKey, MetadataValue] = Field(default_factory=dict, max_length=16)

    @model_validator(mode="after")
    def _events_need_webhook(self) -> BatchOptions:
        if self.webhook_events is not None and self.webhook is None:
            raise ValueError("'webhook_events' needs a 'webhook' URL")
        return self

    def events(self) -> list[str]:
        """Every event to send: the batch's own and the per-request job.* ones."""
        return [str(e) for e in self.webhook_events or BATCH_EVENTS] if self.webhook else []

    def job_events(self) -> list[str]:
        """The events each request of the batch sends about itself."""
        return [e for e in self.events() if e not in BATCH_EVENTS]


class BatchCreate(BatchOptions):
    """Body of ``POST /v1/batches`` as JSON (documentation; requests are checked one by one)."""

    requests: list[BatchRequest] = Field(
        min_length=1,
        description="The jobs: each has a custom_id, a prompt or messages, and optional "
        "generation fields (max_new_tokens, temperature, top_p, stop, seed).",
    )


# --- responses ---------------------------------------------------------------------------


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
    batch_size: int | None = Field(None, description="Rows in the micro-batch that ran it.")
    cache_hit: bool = Field(False, description="Answered from the result cache: it never ran.")
    coalesced: bool = Field(
        False,
        description="It followed an identical job that was queued or running, and ended with it.",
    )


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
    stream: bool = Field(False, description="Its text is streamed token by token.")
    urls: dict[str, str] = Field(default_factory=dict)


class JobList(BaseModel):
    """A page of GET /v1/jobs, as OpenAI's list pages are."""

    object: Literal["list"] = "list"
    data: list[Job]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None


class JobListQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    limit: int = Field(20, ge=1, le=100, description="Jobs in a page.")
    after: str | None = Field(None, description="The last job id of the page before.")


class RequestCounts(BaseModel):
    total: int
    completed: int = Field(description="Requests that succeeded.")
    failed: int = Field(description="Requests that failed or expired.")
    cancelled: int = Field(0, description="Requests cancelled before they ran.")


class Batch(BaseModel):
    """The batch object every batch endpoint returns."""

    id: str
    object: Literal["batch"] = "batch"
    status: BatchStatus
    model: str
    request_counts: RequestCounts
    created_at: str
    in_progress_at: str | None = None
    completed_at: str | None = None
    cancelling_at: str | None = None
    cancelled_at: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    webhook: str | None = None
    webhook_events: list[str] | None = None
    urls: dict[str, str] = Field(default_factory=dict)
