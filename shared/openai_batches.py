"""An OpenAI batch is a native batch seen through OpenAI's Batch API: what its record holds
for that view, its status in OpenAI's words, and its webhook event. Pure functions of the
record (``HGETALL P:{m}:batch:{id}``), shared by the gateway and the webhook worker.

A batch made through ``POST /openai/v1/batches`` is one native batch (:mod:`shared.batch_store`),
under the same id: the same lane, workers, counts, results and webhooks as one made through
``/v1/batches``. Its record carries these fields too:

    openai_endpoint           "/v1/chat/completions" or "/v1/completions"
    openai_input_file_id      the uploaded file it was made from
    openai_completion_window  "24h" (or "Ns" with OPENAI_BATCH_SHORT_WINDOWS, in tests); every
                              request's deadline is created_at + the window
    expired                   requests that expired (of ``failed``; counted by lib.lua)
    openai_expiry_swept       set once the queued requests were expired after the window
    openai_summary            {"at", "output_bytes", "errors_bytes", "usage"} of the ended batch,
                              computed from its results once (``at``: its end time, as a
                              requeued dead letter may reopen and end it again)
    openai_deleted            "output", "errors" or both: generated files deleted by the client

Statuses::

    native queued, in_progress   -> in_progress   (the input file is validated inside
                                                   POST /batches: a bad line is a 400 that
                                                   names it, so no batch is seen ``validating``)
    native cancelling, cancelled -> cancelling, cancelled
    native completed             -> expired    if a request expired (the window passed before
                                                it ran); the batch keeps what finished
                                    failed     if every request failed
                                    completed  otherwise

``finalizing`` is never seen: the output and error files are made from the native results
when they are read, so a batch is done the moment its last request ends.
"""

from __future__ import annotations

import re
from enum import StrEnum

from shared.records import seconds
from shared.states import BatchStatus

ENDPOINT = "openai_endpoint"
INPUT_FILE = "openai_input_file_id"
WINDOW = "openai_completion_window"
EXPIRED = "expired"
SWEPT = "openai_expiry_swept"
SUMMARY = "openai_summary"
DELETED = "openai_deleted"

WINDOWS_S = {"24h": 86_400}
_SHORT_WINDOW = re.compile(r"^([1-9][0-9]{0,3})s$")
SHORT_WINDOW_MAX_S = 3600


class OpenAIBatchStatus(StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


ENDED = frozenset(
    {
        OpenAIBatchStatus.COMPLETED,
        OpenAIBatchStatus.FAILED,
        OpenAIBatchStatus.EXPIRED,
        OpenAIBatchStatus.CANCELLED,
    }
)
EVENT_OF_END = {
    OpenAIBatchStatus.COMPLETED: "batch.completed",
    OpenAIBatchStatus.FAILED: "batch.failed",
    OpenAIBatchStatus.EXPIRED: "batch.expired",
    OpenAIBatchStatus.CANCELLED: "batch.cancelled",
}


def window_seconds(window: str, short_windows: bool = False) -> int | None:
    """The seconds a completion_window grants; None for a window this fleet does not take."""
    if window in WINDOWS_S:
        return WINDOWS_S[window]
    match = _SHORT_WINDOW.match(window) if short_windows else None
    if match and int(match.group(1)) <= SHORT_WINDOW_MAX_S:
        return int(match.group(1))
    return None


def is_openai(record: dict[str, str]) -> bool:
    return bool(record.get(ENDPOINT))


def expires_at(record: dict[str, str]) -> float:
    """When the batch's completion window ends."""
    window = window_seconds(record[WINDOW], short_windows=True) or WINDOWS_S["24h"]
    return float(record["created_at"]) + window


def status_of(record: dict[str, str]) -> OpenAIBatchStatus:
    native = BatchStatus(record["status"])
    if native in (BatchStatus.QUEUED, BatchStatus.IN_PROGRESS):
        return OpenAIBatchStatus.IN_PROGRESS
    if native != BatchStatus.COMPLETED:
        return OpenAIBatchStatus(native.value)  # cancelling, cancelled
    if int(record.get(EXPIRED) or 0):
        return OpenAIBatchStatus.EXPIRED
    if int(record.get("failed") or 0) == int(record["total"]):
        return OpenAIBatchStatus.FAILED
    return OpenAIBatchStatus.COMPLETED


def ended_at(record: dict[str, str]) -> float | None:
    """When the batch ended (None while it runs)."""
    return seconds(record, "completed_at") or seconds(record, "cancelled_at")


def webhook_event(record: dict[str, str], event_id: str) -> dict | None:
    """The event an ended OpenAI batch sends, as OpenAI's webhooks shape it (the ``openai``
    SDK's ``client.webhooks.unwrap`` reads it): a thin payload naming the batch. None for a
    native batch, or one that has not ended."""
    if not is_openai(record):
        return None
    status, at = status_of(record), ended_at(record)
    if status not in ENDED or at is None:
        return None
    return {
        "id": event_id,
        "object": "event",
        "type": EVENT_OF_END[status],
        "created_at": int(at),
        "data": {"id": record["id"]},
    }
