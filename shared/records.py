"""The record codec: how a job and a batch are stored as Redis hashes, and read back.

Every value is a string, as Redis keeps it; times are unix seconds (``repr(float)``). The
Lua scripts read and write the same fields (``status``, ``*_at``, ``batch``,
``webhook``, ``webhook_events``, the batch counters).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from datetime import UTC, datetime

from shared.protocol import (
    Batch,
    Job,
    JobError,
    JobInput,
    JobMetrics,
    Output,
    RequestCounts,
)
from shared.states import BatchStatus, JobStatus

_INPUT_FIELDS = set(JobInput.model_fields)


def rfc3339(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def seconds(record: dict[str, str], name: str) -> float | None:
    """A time field of a record as unix seconds (None when unset)."""
    value = record.get(name)
    return float(value) if value else None


def timestamp(record: dict[str, str], name: str) -> str | None:
    """A time field of a record as the API shows it (RFC 3339)."""
    return rfc3339(seconds(record, name))


# --- jobs --------------------------------------------------------------------------------


def new_record(
    job_id: str,
    model: str,
    job_input: JobInput,
    metadata: dict[str, str],
    timeout_s: float | None = None,
    extra: dict[str, str] | None = None,
    now: float | None = None,
) -> dict[str, str]:
    """The hash a new job is stored as.

    ``extra`` holds the webhook fields (:func:`webhook_fields`) and, for a request of a
    batch, ``batch`` (its id) and ``custom_id``.
    """
    now = time.time() if now is None else now
    record = {
        "id": job_id,
        "model": model,
        "status": JobStatus.QUEUED.value,
        "created_at": repr(now),
        # Only the JobInput fields, also when given a subclass (a batch line's custom_id is
        # a field of the record, not of the input).
        "input": job_input.model_dump_json(include=_INPUT_FIELDS, exclude_none=True),
        "metadata": json.dumps(metadata),
    }
    if timeout_s is not None:
        record["deadline"] = repr(now + timeout_s)
    return record | (extra or {})


def webhook_fields(url: str | None, events: Iterable[str]) -> dict[str, str]:
    """Record fields that make the scripts send these events to ``url`` (none if no url)."""
    events = " ".join(events)
    if not url or not events:
        return {}
    return {"webhook": url, "webhook_events": events}


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
    created, started = seconds(record, "created_at"), seconds(record, "started_at")
    metrics = JobMetrics(
        queue_seconds=round(started - created, 6) if started and created else None,
        inference_seconds=seconds(record, "inference_seconds"),
        batch_size=int(record["batch_size"]) if record.get("batch_size") else None,
        cache_hit=record.get("cache_hit") == "1",
        coalesced="follows" in record,
    )
    job_id = record["id"]
    urls = {
        "get": f"/v1/jobs/{job_id}",
        "cancel": f"/v1/jobs/{job_id}/cancel",
        "events": f"/v1/jobs/{job_id}/events",
    }
    if record.get("webhook"):
        urls["webhook_deliveries"] = f"/v1/jobs/{job_id}/webhook_deliveries"
    return Job(
        id=job_id,
        status=JobStatus(record["status"]),
        model=record["model"],
        batch_id=record.get("batch") or None,
        custom_id=record.get("custom_id"),
        created_at=rfc3339(created) or "",
        started_at=rfc3339(started),
        completed_at=timestamp(record, "completed_at"),
        deadline=timestamp(record, "deadline"),
        cancel_requested=record.get("cancel_requested") == "1",
        input=json.loads(record.get("input") or "{}"),
        output=Output.model_validate_json(record["output"]) if record.get("output") else None,
        error=JobError.model_validate_json(record["error"]) if record.get("error") else None,
        metrics=metrics,
        worker=record.get("worker") or None,
        metadata=json.loads(record.get("metadata") or "{}"),
        webhook=record.get("webhook") or None,
        webhook_events=record["webhook_events"].split() if record.get("webhook") else None,
        stream=record.get("stream") == "1",
        urls=urls,
    )


# --- batches -----------------------------------------------------------------------------


def new_batch_record(
    batch_id: str,
    model: str,
    total: int,
    metadata: dict[str, str],
    webhook: dict[str, str],
    now: float,
) -> dict[str, str]:
    """The hash a new batch is stored as; ``webhook`` is :func:`webhook_fields` of its
    events (the scripts send the batch.* ones from it; its job.* ones never match)."""
    return {
        "id": batch_id,
        "model": model,
        "status": BatchStatus.QUEUED.value,
        "created_at": repr(now),
        "total": str(total),
        "completed": "0",
        "failed": "0",
        "cancelled": "0",
        "metadata": json.dumps(metadata),
    } | webhook


def batch_from_record(record: dict[str, str]) -> Batch:
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
        created_at=timestamp(record, "created_at") or "",
        in_progress_at=timestamp(record, "in_progress_at"),
        completed_at=timestamp(record, "completed_at"),
        cancelling_at=timestamp(record, "cancelling_at"),
        cancelled_at=timestamp(record, "cancelled_at"),
        metadata=json.loads(record.get("metadata") or "{}"),
        webhook=record.get("webhook") or None,
        webhook_events=record["webhook_events"].split() if record.get("webhook") else None,
        urls=urls,
    )
