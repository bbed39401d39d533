"""The batch: its request schema, its object, and how a submitted list of requests is checked.

A batch is many jobs submitted at once (OpenAI's Batch API is the model): each request is a
job with a ``custom_id``, run from the model's low-priority batch stream. Every request is
validated before anything is stored, and the first bad one is reported by its line (JSONL)
or index (JSON), with the field. Key names are in :mod:`shared.jobs`; the Redis operations
in :mod:`shared.batch_queue`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal, get_args

from pydantic import BaseModel, Field, ValidationError, model_validator

from shared.jobs import (
    JobEvent,
    JobInput,
    MetadataKey,
    MetadataValue,
    WebhookURL,
    _Strict,
    rfc3339,
)

BatchEvent = Literal["batch.completed", "batch.cancelled"]
BATCH_EVENTS: tuple[str, ...] = get_args(BatchEvent)  # all of them, the default too


class BatchStatus(StrEnum):
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def ended(self) -> bool:
        return self in (BatchStatus.COMPLETED, BatchStatus.CANCELLED)


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def is_batch_id(value: str) -> bool:
    return value.startswith("batch_") and len(value) == 38 and value[6:].isalnum()


# --- request schema ----------------------------------------------------------------------


class BatchRequest(JobInput):
    """One line of a batch: a job's input and the caller's id for matching results."""

    custom_id: str = Field(min_length=1, max_length=64, description="Unique within the batch.")


class BatchOptions(_Strict):
    """Everything about a batch but its requests (JSON body fields, or JSONL query params)."""

    model: str | None = Field(None, description="Served model id. Default: the fleet's model.")
    webhook: WebhookURL | None = Field(None, description="Receives signed events.")
    webhook_events: list[BatchEvent | JobEvent] | None = Field(
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
        return list(self.webhook_events or BATCH_EVENTS) if self.webhook else []

    def job_events(self) -> list[str]:
        """The events each request of the batch sends about itself."""
        return [e for e in self.events() if e not in BATCH_EVENTS]


class BatchCreate(BatchOptions):
    """Body of ``POST /v1/batches`` as JSON (documentation; requests are checked one by one)."""

    requests: list[dict[str, Any]] = Field(
        min_length=1,
        description="The jobs: each has a custom_id, a prompt or messages, and optional "
        "generation fields (max_new_tokens, temperature, top_p, stop, seed).",
    )


@dataclass(frozen=True)
class BadRequestLine(Exception):
    """A request of the batch is invalid; ``where`` is 'line N' or 'requests[N]'."""

    where: str
    param: str | None
    message: str
    line: int | None = None
    index: int | None = None

    def __str__(self) -> str:
        field = f"'{self.param}': " if self.param else ""
        return f"{self.where}: {field}{self.message}"


def parse_jsonl(body: bytes) -> Iterable[tuple[int, Any]]:
    """(line number, parsed JSON) for each non-blank line; a line that is not JSON raises."""
    for number, raw in enumerate(body.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            yield number, json.loads(raw, parse_constant=_reject_constant)
        except (ValueError, UnicodeDecodeError) as exc:
            where = f"line {number}"
            raise BadRequestLine(where, None, f"not valid JSON: {exc}", line=number) from None


def check_requests(
    items: Iterable[tuple[int, Any]], *, jsonl: bool, max_requests: int, max_new_tokens_limit: int
) -> list[BatchRequest]:
    """Validate every request and the uniqueness of custom_ids; raise on the first bad one.

    ``items`` are (line number, value) for JSONL, (index, value) for a JSON list.
    """
    context = {"max_new_tokens_limit": max_new_tokens_limit}
    requests: list[BatchRequest] = []
    seen: dict[str, int] = {}
    for position, item in items:
        where = f"line {position}" if jsonl else f"requests[{position}]"
        located = {"line": position} if jsonl else {"index": position}
        if len(requests) >= max_requests:
            raise BadRequestLine(
                where, None, f"a batch holds at most {max_requests} requests (BATCH_MAX_REQUESTS)",
                **located,
            )  # fmt: skip
        if not isinstance(item, dict):
            raise BadRequestLine(where, None, "must be a JSON object", **located)
        try:
            request = BatchRequest.model_validate(item, context=context)
        except ValidationError as exc:
            err = exc.errors(include_url=False, include_input=False)[0]
            param = ".".join(str(part) for part in err["loc"]) or None
            raise BadRequestLine(
                where, param, err["msg"].removeprefix("Value error, "), **located
            ) from None
        if request.custom_id in seen:
            first = seen[request.custom_id]
            raise BadRequestLine(
                where, "custom_id",
                f"'{request.custom_id}' is used twice (first at "
                f"{'line ' if jsonl else 'requests['}{first}{'' if jsonl else ']'})",
                **located,
            )  # fmt: skip
        seen[request.custom_id] = position
        requests.append(request)
    if not requests:
        raise BadRequestLine("body", None, "a batch needs at least one request")
    return requests


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


# --- response schema ---------------------------------------------------------------------


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


def batch_from_record(record: dict[str, str]) -> Batch:
    def ts(name: str) -> str | None:
        value = record.get(name)
        return rfc3339(float(value)) if value else None

    batch_id = record["id"]
    urls = {
        "get": f"/v1/batches/{batch_id}",
        "results": f"/v1/batches/{batch_id}/results",
        "cancel": f"/v1/batches/{batch_id}/cancel",
    }
    if record.get("webhook"):
        urls["webhook_deliveries"] = f"/v1/batches/{batch_id}/webhook_deliveries"
    return Batch(
        id=batch_id,
        status=BatchStatus(record["status"]),
        model=record["model"],
        request_counts=RequestCounts(
            total=int(record["total"]),
            completed=int(record.get("completed", 0)),
            failed=int(record.get("failed", 0)),
            cancelled=int(record.get("cancelled", 0)),
        ),
        created_at=ts("created_at") or "",
        in_progress_at=ts("in_progress_at"),
        completed_at=ts("completed_at"),
        cancelling_at=ts("cancelling_at"),
        cancelled_at=ts("cancelled_at"),
        metadata=json.loads(record.get("metadata") or "{}"),
        webhook=record.get("webhook") or None,
        webhook_events=record["webhook_events"].split() if record.get("webhook") else None,
        urls=urls,
    )
