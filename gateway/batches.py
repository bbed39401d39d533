"""``/v1/batches``: many jobs at once, run behind interactive traffic, results as JSONL.

A batch is submitted as JSON (``{"requests": [...], "webhook", ...}``) or as JSONL
(``application/x-ndjson``, one request per line, the other fields as query parameters).
Every request is checked before any is queued; the first bad one is named in the 422.
"""

from __future__ import annotations

from flask import Blueprint, jsonify, request, url_for
from flask import Response as FlaskResponse
from pydantic import ValidationError
from spectree import Response

from gateway.errors import APIError, describe_validation_error
from gateway.extensions import fleet
from gateway.inputs import (
    check_webhook,
    idempotency_errors,
    idempotency_key,
    json_body,
    raw_body,
)
from gateway.openapi import DeliveryList, ErrorBody, api_spec
from shared.batches import (
    BadRequestLine,
    Batch,
    BatchCreate,
    BatchOptions,
    check_requests,
    is_batch_id,
    parse_jsonl,
)
from shared.jobs import Lane
from shared.queue import fingerprint
from webhooks import deliveries_of

bp = Blueprint("batches", __name__, url_prefix="/v1/batches")

JSONL_TYPES = ("application/x-ndjson", "application/jsonl", "application/x-jsonlines")
ACCEPTED = "application/json, or application/x-ndjson for JSONL"


@bp.post("")
@api_spec.validate(
    json=BatchCreate,
    resp=Response(
        HTTP_202=Batch,
        HTTP_200=Batch,
        HTTP_400=ErrorBody,
        HTTP_413=ErrorBody,
        HTTP_415=ErrorBody,
        HTTP_422=ErrorBody,
        HTTP_429=ErrorBody,
        HTTP_503=ErrorBody,
    ),
    tags=["batches"],
    skip_validation=True,
)
def create_batch():
    """Create a batch.

    JSON body: `requests` (each with a unique `custom_id`, a `prompt` or `messages`, and the
    job generation fields), optional `model`, `webhook`, `webhook_events`, `metadata`.
    Or a JSONL body (`Content-Type: application/x-ndjson`), one request per line, with
    `model`, `webhook`, `webhook_events` (comma-separated) and `metadata[key]=value` as query
    parameters. At most BATCH_MAX_REQUESTS requests. Answers 202 with the batch; a bad
    request line is a 422 naming its `line` (JSONL) or `index` (JSON) and field, and then
    nothing is queued. Webhook events default to batch.completed and batch.cancelled; list
    job.* events in `webhook_events` to get them for each request. `Idempotency-Key` works
    as on jobs.
    """
    key = idempotency_key()
    request_fingerprint = ""
    settings = fleet.settings
    limits = {
        "max_requests": settings.batch_max_requests,
        "max_new_tokens_limit": settings.max_new_tokens_limit,
    }
    try:
        if request.mimetype in JSONL_TYPES:
            body = raw_body(settings.batch_max_bytes)
            options = _options_from_query()
            if key:  # what makes a retry the same request: only needed with a key
                request_fingerprint = fingerprint({"jsonl": body.decode("utf-8", "replace"),
                                        **options.model_dump()})  # fmt: skip
            requests = check_requests(parse_jsonl(body), jsonl=True, **limits)
        else:
            raw = json_body(settings.batch_max_bytes, accepted=ACCEPTED)
            items = raw.pop("requests", None)
            if not isinstance(items, list):
                raise APIError(
                    422, "invalid_request", "'requests': a list of requests is required",
                    param="requests",
                )  # fmt: skip
            options = BatchOptions.model_validate(raw)
            if key:
                request_fingerprint = fingerprint({"requests": items, **raw})
            requests = check_requests(enumerate(items), jsonl=False, **limits)
    except BadRequestLine as bad:
        located = {k: v for k, v in (("line", bad.line), ("index", bad.index)) if v is not None}
        raise APIError(422, "invalid_request", str(bad), param=bad.param, **located) from None
    model = options.model or settings.served_model
    if model not in fleet.served_models():
        raise APIError(
            422, "model_not_found", f"model '{model}' is not served here; see GET /v1/models",
            param="model",
        )  # fmt: skip
    check_webhook(options.webhook)
    _check_room(model, len(requests))
    with idempotency_errors("batch"):
        submitted = fleet.batches.create(
            model, requests, options, idempotency_key=key, fingerprint=request_fingerprint
        )
    response = _batch_response(submitted.batch, 202)
    if submitted.replayed:
        response.headers["Idempotent-Replayed"] = "true"
    return response


@bp.get("/<batch_id>")
@api_spec.validate(
    resp=Response(HTTP_200=Batch, HTTP_404=ErrorBody), tags=["batches"], skip_validation=True
)
def get_batch(batch_id: str):
    """Read a batch: its status and request counts. Kept RESULT_TTL_S after it ends."""
    return jsonify(_batch_or_404(batch_id).model_dump(mode="json"))


@bp.get("/<batch_id>/results")
@api_spec.validate(resp=Response(HTTP_404=ErrorBody), tags=["batches"], skip_validation=True)
def batch_results(batch_id: str):
    """The batch's results as JSONL, one `{custom_id, job_id, status, output, error}` per
    line, in the order the requests ended: those ended so far, all of them once the batch
    is `completed` (the `Batch-Status` header says which)."""
    batch = _batch_or_404(batch_id)
    lines = fleet.batches.results(batch_id)
    response = FlaskResponse((line + "\n" for line in lines), mimetype="application/x-ndjson")
    response.headers["Batch-Status"] = batch.status.value
    return response


@bp.post("/<batch_id>/cancel")
@api_spec.validate(
    resp=Response(HTTP_200=Batch, HTTP_404=ErrorBody, HTTP_409=ErrorBody),
    tags=["batches"],
    skip_validation=True,
)
def cancel_batch(batch_id: str):
    """Cancel a batch: requests not started end `canceled` at once, running ones finish.
    The batch is `cancelling` until then, and `cancelled` after. An ended batch is a 409."""
    before = _batch_or_404(batch_id)
    if before.status.ended:
        raise APIError(409, "batch_already_ended", f"batch {batch_id} is already {before.status}")
    batch = fleet.batches.cancel(batch_id) or before
    return _batch_response(batch, 200)


@bp.get("/<batch_id>/webhook_deliveries")
@api_spec.validate(
    resp=Response(HTTP_200=DeliveryList, HTTP_404=ErrorBody), tags=["batches"],
    skip_validation=True,
)  # fmt: skip
def batch_webhook_deliveries(batch_id: str):
    """The webhooks sent about the batch itself (batch.* events), each with its attempts."""
    _batch_or_404(batch_id)
    return jsonify(object="list", data=deliveries_of(batch_id, fleet.settings))


def _options_from_query() -> BatchOptions:
    """JSONL batches carry their options as query parameters."""
    args = request.args
    unknown = [
        name for name in args
        if name not in ("model", "webhook", "webhook_events") and not _is_metadata(name)
    ]  # fmt: skip
    if unknown:
        raise APIError(
            422, "invalid_request", f"unknown query parameter '{unknown[0]}'", param=unknown[0]
        )
    options: dict = {
        "metadata": {name[9:-1]: value for name, value in args.items() if _is_metadata(name)}
    }
    for name in ("model", "webhook"):
        if name in args:
            options[name] = args[name]
    if "webhook_events" in args:
        options["webhook_events"] = [e.strip() for e in args["webhook_events"].split(",")]
    try:
        return BatchOptions.model_validate(options)
    except ValidationError as exc:
        raise describe_validation_error(exc) from None


def _is_metadata(name: str) -> bool:
    return name.startswith("metadata[") and name.endswith("]") and len(name) > 10


def _check_room(model: str, count: int) -> None:
    backlog = fleet.queue.backlog(model, Lane.BATCH).total
    limit = fleet.settings.batch_max_queue_depth
    if backlog + count > limit:
        raise APIError(
            429, "queue_full",
            f"model '{model}' has {backlog} batch requests queued; {count} more would pass "
            f"BATCH_MAX_QUEUE_DEPTH {limit}; retry later",
            headers={"Retry-After": "60"},
        )  # fmt: skip


def _batch_or_404(batch_id: str) -> Batch:
    batch = fleet.batches.get(batch_id) if is_batch_id(batch_id) else None
    if batch is None:
        raise APIError(404, "batch_not_found", f"no batch '{batch_id}' (unknown, or it expired)")
    return batch


def _batch_response(batch: Batch, status: int):
    response = jsonify(batch.model_dump(mode="json"))
    response.status_code = status
    response.headers["Location"] = url_for("batches.get_batch", batch_id=batch.id)
    return response
