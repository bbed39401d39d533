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

from gateway import batch_serving
from gateway.errors import APIError, describe_validation_error
from gateway.extensions import fleet
from gateway.inputs import idempotency_key, json_body, raw_body
from gateway.openapi import DeliveryList, ErrorBody, documented
from shared.idempotency import fingerprint
from shared.protocol import Batch, BatchCreate, BatchOptions

bp = Blueprint("batches", __name__, url_prefix="/v1/batches")

JSONL_TYPES = ("application/x-ndjson", "application/jsonl", "application/x-jsonlines")
ACCEPTED = "application/json, or application/x-ndjson for JSONL"


@bp.post("")
@documented(
    json=BatchCreate,
    resp=Response(
        HTTP_202=Batch,
        HTTP_400=ErrorBody,
        HTTP_413=ErrorBody,
        HTTP_415=ErrorBody,
        HTTP_422=ErrorBody,
        HTTP_429=ErrorBody,
        HTTP_503=ErrorBody,
    ),
    tags=["batches"],
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
    request_fingerprint = ""  # what makes a retry the same request: only needed with a key
    if request.mimetype in JSONL_TYPES:
        body = raw_body(fleet.settings.batch_max_bytes)
        options = _options_from_query()
        if key:
            request_fingerprint = fingerprint(
                {"jsonl": body.decode("utf-8", "replace"), **options.model_dump()}
            )
        requests = batch_serving.requests_from_jsonl(body)
    else:
        raw = json_body(fleet.settings.batch_max_bytes, accepted=ACCEPTED)
        items = raw.pop("requests", None)
        if not isinstance(items, list):
            raise APIError(
                422, "invalid_request", "'requests': a list of requests is required",
                param="requests",
            )  # fmt: skip
        options = BatchOptions.model_validate(raw)
        if key:
            request_fingerprint = fingerprint({"requests": items, **raw})
        requests = batch_serving.requests_from_list(items)
    submitted = batch_serving.create(requests, options, key, request_fingerprint)
    response = _batch_response(submitted.batch, 202)
    if submitted.replayed:
        response.headers["Idempotent-Replayed"] = "true"
    return response


@bp.get("/<batch_id>")
@documented(resp=Response(HTTP_200=Batch, HTTP_404=ErrorBody), tags=["batches"])
def get_batch(batch_id: str):
    """Read a batch: its status and request counts. Kept RESULT_TTL_S after it ends."""
    return jsonify(batch_serving.find(batch_id).model_dump(mode="json"))


@bp.get("/<batch_id>/results")
@documented(resp=Response(HTTP_404=ErrorBody), tags=["batches"])
def batch_results(batch_id: str):
    """The batch's results as JSONL, one `{custom_id, job_id, status, output, error}` per
    line, in the order the requests ended: those ended so far, all of them once the batch
    is `completed` (the `Batch-Status` header says which)."""
    batch = batch_serving.find(batch_id)
    lines = batch_serving.results(batch)
    response = FlaskResponse((line + "\n" for line in lines), mimetype="application/x-ndjson")
    response.headers["Batch-Status"] = batch.status.value
    return response


@bp.post("/<batch_id>/cancel")
@documented(resp=Response(HTTP_200=Batch, HTTP_404=ErrorBody, HTTP_409=ErrorBody), tags=["batches"])
def cancel_batch(batch_id: str):
    """Cancel a batch: requests not started end `canceled` at once, running ones finish.
    The batch is `cancelling` until then, and `cancelled` after. An ended batch is a 409."""
    return _batch_response(batch_serving.cancel(batch_id), 200)


@bp.get("/<batch_id>/webhook_deliveries")
@documented(
    resp=Response(HTTP_200=DeliveryList, HTTP_404=ErrorBody), tags=["batches"]
)  # fmt: skip
def batch_webhook_deliveries(batch_id: str):
    """The webhooks sent about the batch itself (batch.* events), each with its attempts."""
    return jsonify(object="list", data=batch_serving.webhook_deliveries(batch_id))


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


def _batch_response(batch: Batch, status: int):
    response = jsonify(batch.model_dump(mode="json"))
    response.status_code = status
    response.headers["Location"] = url_for("batches.get_batch", batch_id=batch.id)
    return response
