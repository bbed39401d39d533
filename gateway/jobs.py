"""``/v1/jobs``: submit a prompt, get a job id at once, poll (or wait) for the result."""

from __future__ import annotations

import re

from flask import Blueprint, jsonify, request, url_for
from spectree import Response

from gateway.backpressure import QueueFull
from gateway.errors import APIError
from gateway.extensions import fleet
from gateway.inputs import check_webhook, idempotency_errors, idempotency_key, json_body
from gateway.openapi import DeliveryList, ErrorBody, api_spec
from shared.jobs import DEFAULT_JOB_EVENTS, Job, JobCreate, is_job_id, webhook_fields
from shared.queue import fingerprint
from webhooks import deliveries_of

bp = Blueprint("jobs", __name__, url_prefix="/v1/jobs")

MAX_WAIT_S = 60
_PREFER_WAIT = re.compile(r"(?:^|[,;]\s*)wait(?:=(\d+))?\s*(?:$|[,;])", re.IGNORECASE)


@bp.post("")
@api_spec.validate(
    json=JobCreate,
    resp=Response(
        HTTP_200=Job,
        HTTP_202=Job,
        HTTP_400=ErrorBody,
        HTTP_413=ErrorBody,
        HTTP_415=ErrorBody,
        HTTP_422=ErrorBody,
        HTTP_429=ErrorBody,
        HTTP_503=ErrorBody,
    ),
    tags=["jobs"],
    skip_validation=True,
)
def create_job():
    """Submit a job.

    Answers 202 with the queued job and its Location. With `Prefer: wait=N` (N <= 60) the
    request is held until the job ends (200) or N seconds pass (202, the job as it stands).
    With an `Idempotency-Key`, a repeat of the same request within 24 h returns the first
    job (header `Idempotent-Replayed: true`) and creates none; a different body is a 422.
    While the model's backlog is over MAX_QUEUE_DEPTH the answer is 429 with Retry-After.
    With a `webhook`, signed events about the job are POSTed there (`webhook_events`
    picks them; default job.completed, job.failed, job.canceled).
    """
    wait_s = _prefer_wait()
    key = idempotency_key()
    raw = json_body()
    body = JobCreate.model_validate(
        raw, context={"max_new_tokens_limit": fleet.settings.max_new_tokens_limit}
    )
    model = body.model or fleet.settings.served_model
    if model not in fleet.served_models():
        raise APIError(
            422,
            "model_not_found",
            f"model '{model}' is not served here; see GET /v1/models",
            param="model",
        )
    check_webhook(body.webhook)
    try:
        fleet.backpressure.check(model)
    except QueueFull as full:
        error = APIError(
            429, "queue_full",
            f"model '{model}' has {full.backlog} jobs waiting (MAX_QUEUE_DEPTH "
            f"{fleet.settings.max_queue_depth}); retry after {full.retry_after_s} s",
        ).response()  # fmt: skip
        error[0].headers["Retry-After"] = str(full.retry_after_s)
        return error
    events = body.webhook_events or DEFAULT_JOB_EVENTS
    with idempotency_errors("job"):
        submitted = fleet.queue.submit(
            model, body, body.metadata, timeout_s=body.timeout_s,
            idempotency_key=key, fingerprint=fingerprint(raw) if key else "",
            extra=webhook_fields(fleet.keys, body.webhook, events),
        )  # fmt: skip
    job = submitted.job
    if wait_s and not job.status.terminal:
        job = fleet.waiter.wait(job.id, wait_s, lambda: fleet.queue.get(job.id)) or job
    response = _job_response(job, 200 if job.status.terminal else 202, wait_s)
    if submitted.replayed:
        response.headers["Idempotent-Replayed"] = "true"
    return response


@bp.post("/<job_id>/cancel")
@api_spec.validate(
    resp=Response(HTTP_200=Job, HTTP_202=Job, HTTP_404=ErrorBody, HTTP_409=ErrorBody),
    tags=["jobs"],
    skip_validation=True,
)
def cancel_job(job_id: str):
    """Cancel a job.

    A queued job ends `canceled` at once and never runs (200). A running one stops at its
    next generated token and then ends `canceled` (202; its batch-mates go on). A job that
    already ended is a 409.
    """
    before = fleet.queue.get(job_id) if is_job_id(job_id) else None
    if before is None:
        raise APIError(404, "job_not_found", f"no job '{job_id}' (unknown, or its result expired)")
    if before.status.terminal:
        raise APIError(409, "job_already_ended", f"job {job_id} already ended '{before.status}'")
    job = fleet.queue.cancel(job_id) or before
    if job.status.terminal and job.status != "canceled":
        raise APIError(409, "job_already_ended", f"job {job_id} already ended '{job.status}'")
    return _job_response(job, 200 if job.status.terminal else 202, None)


@bp.get("/<job_id>/webhook_deliveries")
@api_spec.validate(
    resp=Response(HTTP_200=DeliveryList, HTTP_404=ErrorBody), tags=["jobs"], skip_validation=True
)
def job_webhook_deliveries(job_id: str):
    """The webhooks sent about a job: each delivery with every attempt (time, HTTP status
    or error, next retry)."""
    job = fleet.queue.get(job_id) if is_job_id(job_id) else None
    if job is None:
        raise APIError(404, "job_not_found", f"no job '{job_id}' (unknown, or its result expired)")
    return jsonify(object="list", data=deliveries_of(job_id, fleet.settings))


@bp.get("/<job_id>")
@api_spec.validate(
    resp=Response(HTTP_200=Job, HTTP_404=ErrorBody), tags=["jobs"], skip_validation=True
)
def get_job(job_id: str):
    """Read a job. Finished jobs are kept RESULT_TTL_S seconds, then 404."""
    job = fleet.queue.get(job_id) if is_job_id(job_id) else None
    if job is None:
        raise APIError(404, "job_not_found", f"no job '{job_id}' (unknown, or its result expired)")
    return jsonify(job.model_dump(mode="json"))


def _job_response(job: Job, status: int, wait_s: int | None):
    response = jsonify(job.model_dump(mode="json"))
    response.status_code = status
    response.headers["Location"] = url_for("jobs.get_job", job_id=job.id)
    if wait_s:
        response.headers["Preference-Applied"] = f"wait={wait_s}"
    return response


def _prefer_wait() -> int | None:
    """Seconds asked for by ``Prefer: wait=N``; None if absent. Bare ``wait`` means 60."""
    prefer = request.headers.get("Prefer")
    if not prefer:
        return None
    match = _PREFER_WAIT.search(prefer.strip())
    if match is None:
        if re.search(r"\bwait\b", prefer, re.IGNORECASE):
            raise APIError(
                400, "invalid_header", "Prefer: wait must be 'wait' or 'wait=N' with 1 <= N <= 60"
            )
        return None  # other preferences are not ours to reject
    seconds = int(match.group(1)) if match.group(1) else MAX_WAIT_S
    if not 1 <= seconds <= MAX_WAIT_S:
        raise APIError(
            400, "invalid_header", f"Prefer: wait=N needs 1 <= N <= {MAX_WAIT_S} (got {seconds})"
        )
    return seconds
