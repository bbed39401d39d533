"""OpenAI's Batch API under ``/openai/v1``: ``client.batches.create / retrieve / list /
cancel`` on the fleet's native batches (the same lane, workers, all-or-nothing creation and
webhooks: :mod:`gateway.openai_batch_serving`). Errors are in OpenAI's shape; a bad line of
the input file is a 400 that names it (``error.line``).
"""

from __future__ import annotations

from typing import Literal

from flask import Blueprint, jsonify, request
from pydantic import BaseModel, Field
from spectree import Response as Spec

from gateway import openai_batch_serving as serving
from gateway.inputs import json_body
from gateway.openai_batch_protocol import BatchCreateBody
from gateway.openai_routes import OpenAIErrorBody, answer_in_openai_shape
from gateway.openapi import documented
from shared.openai_batches import OpenAIBatchStatus

bp = Blueprint("openai_batches", __name__, url_prefix="/openai/v1/batches")
answer_in_openai_shape(bp)


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int = Field(description="Requests that failed or expired.")


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str
    errors: dict | None = None
    input_file_id: str
    completion_window: str
    status: OpenAIBatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    usage: dict | None = None
    metadata: dict[str, str] | None = None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class BatchListQuery(BaseModel):
    after: str | None = None
    limit: int | None = Field(None, ge=1, le=100)


_ERRORS = {"HTTP_400": OpenAIErrorBody, "HTTP_404": OpenAIErrorBody}


@bp.post("")
@documented(
    json=BatchCreateBody,
    resp=Spec(HTTP_200=BatchObject, HTTP_429=OpenAIErrorBody, **_ERRORS), tags=["openai"],
)  # fmt: skip
def create_batch():
    """Create a batch from an uploaded file: `input_file_id`, `endpoint`
    (`/v1/chat/completions` or `/v1/completions`), `completion_window` (`24h`), `metadata`,
    and the fleet's own `webhook` URL. Every line is checked first, as its endpoint checks a
    body (one choice a line, one model for all); the first bad one is a 400 naming its
    `line`, and then nothing is queued. Requests still queued when the window ends expire;
    the batch then ends `expired` with what finished."""
    return jsonify(serving.create(json_body()))


@bp.get("")
@documented(query=BatchListQuery, resp=Spec(HTTP_200=BatchList, **_ERRORS), tags=["openai"])
def list_batches():
    """Your batches made through this API, newest first; paginated with `after`, `limit`."""
    return jsonify(serving.list_batches(request.args))


@bp.get("/<batch_id>")
@documented(resp=Spec(HTTP_200=BatchObject, **_ERRORS), tags=["openai"])
def retrieve_batch(batch_id: str):
    """A batch: `in_progress` until its last request ends, then `completed`, `expired`
    (its window ended first), `failed` (every request failed) or `cancelled`; its
    `output_file_id` and `error_file_id` once it ended."""
    return jsonify(serving.retrieve(batch_id))


@bp.post("/<batch_id>/cancel")
@documented(resp=Spec(HTTP_200=BatchObject, **_ERRORS), tags=["openai"])
def cancel_batch(batch_id: str):
    """Cancel: requests not started end at once, running ones finish (`cancelling`, then
    `cancelled`). An ended batch is a 400."""
    return jsonify(serving.cancel(batch_id))
