"""Jobs, whichever API they came through: submit (checked, with backpressure and
idempotency), wait, find, cancel. The routes in :mod:`gateway.jobs` only speak HTTP."""

from __future__ import annotations

from typing import Any

from gateway import auth, serving
from gateway.backpressure import QueueFull
from gateway.errors import APIError
from gateway.extensions import fleet
from gateway.inputs import cache_allowed
from gateway.serving import check_webhook, idempotency_errors, resolve_model
from shared.idempotency import fingerprint
from shared.job_store import OwnerQueueFull, Submitted
from shared.owner_index import UnknownCursor
from shared.protocol import Job, JobCreate, is_job_id
from shared.records import webhook_fields
from shared.states import DEFAULT_JOB_EVENTS, JobStatus
from webhooks import deliveries_of

OWNER_RETRY_S = 2  # a key at its cap of unfinished jobs: its jobs end every few seconds


def parse(raw: dict[str, Any]) -> JobCreate:
    """The request as a JobCreate; a 422 naming the first bad field (via the app's
    ValidationError handler) otherwise."""
    context = {"max_new_tokens_limit": fleet.settings.max_new_tokens_limit}
    return JobCreate.model_validate(raw, context=context)


def submit(
    body: JobCreate, raw: dict[str, Any], idempotency_key: str | None, wait_s: int | None
) -> Submitted:
    """Queue the job (or find the one an Idempotency-Key made, or answer it from the result
    cache), then wait up to ``wait_s`` for it to end. ``raw`` is the body as sent: its
    fingerprint tells a retry apart."""
    model = resolve_model(body.model)
    check_webhook(body.webhook)
    check_room(model)
    events = body.webhook_events or DEFAULT_JOB_EVENTS
    extra = webhook_fields(body.webhook, events) | ({"stream": "1"} if body.stream else {})
    key = auth.caller()
    charged = auth.charge_tokens(body.max_new_tokens)
    try:
        with idempotency_errors("job"):
            submitted = fleet.jobs.submit(
                model, body, body.metadata, timeout_s=body.timeout_s,
                idempotency_key=idempotency_key,
                fingerprint=fingerprint(raw) if idempotency_key else "",
                extra=extra,
                cache_owner=fleet.cache.owner(body, body.cache and cache_allowed(), key.id),
                owner=key.id, queue_cap=auth.queue_cap(key), charged_tokens=charged,
            )  # fmt: skip
    except OwnerQueueFull as full:
        auth.give_back_tokens(charged)
        raise APIError(
            429, "rate_limited",
            f"this API key has {full.unfinished} unfinished jobs, its cap (KEY_MAX_QUEUED or "
            f"the key's max_queued); retry after {OWNER_RETRY_S} s",
            headers={"Retry-After": str(OWNER_RETRY_S)},
        ) from None  # fmt: skip
    except Exception:
        auth.give_back_tokens(charged)
        raise
    if submitted.replayed:  # nothing new was queued: the first request paid
        auth.give_back_tokens(charged)
    job = submitted.job
    if wait_s and not body.stream and not job.status.terminal:
        job = fleet.waiter.wait(job.id, wait_s, lambda: fleet.jobs.get(model, job.id)) or job
    return Submitted(job, submitted.replayed, submitted.cache)


def check_room(model: str) -> None:
    """429 with Retry-After while the model's interactive backlog is over MAX_QUEUE_DEPTH."""
    try:
        fleet.backpressure.check(model)
    except QueueFull as full:
        raise APIError(
            429, "queue_full",
            f"model '{model}' has {full.backlog} jobs waiting (MAX_QUEUE_DEPTH "
            f"{fleet.settings.max_queue_depth}); retry after {full.retry_after_s} s",
            headers={"Retry-After": str(full.retry_after_s)},
        ) from None  # fmt: skip


def recent(after: str | None, limit: int) -> tuple[list[Job], bool]:
    """The caller's recent jobs, newest first (without keys: every job made without one);
    400 for an ``after`` that is not one of them."""
    model = fleet.settings.served_model
    try:
        return fleet.jobs.recent(model, auth.caller().id, after, limit)
    except UnknownCursor:
        raise APIError(
            400, "invalid_request", f"'after': no job '{after}' among yours", param="after"
        ) from None


def find(job_id: str) -> Job:
    """The job, whichever served model it belongs to; 404 if none has it."""
    return serving.find("job", job_id, is_job_id, fleet.jobs.get)


def cancel(job_id: str) -> Job:
    """Cancel now (queued) or at the next token (running); 409 if it already ended."""
    before = find(job_id)
    if before.status.terminal:
        raise _already_ended(before)
    job = fleet.jobs.cancel(before.model, job_id) or before
    if job.status.terminal and job.status != JobStatus.CANCELED:
        raise _already_ended(job)
    return job


def webhook_deliveries(job_id: str) -> list[dict[str, Any]]:
    find(job_id)
    return deliveries_of(job_id, fleet.settings)


def _already_ended(job: Job) -> APIError:
    return APIError(409, "job_already_ended", f"job {job.id} already ended '{job.status}'")
