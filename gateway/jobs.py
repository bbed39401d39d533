"""``/v1/jobs``: submit a prompt, get a job id at once, poll (or wait) for the result.

The routes speak HTTP (headers, status codes, Location); :mod:`gateway.job_serving` does
the rest."""

from __future__ import annotations

from flask import Blueprint, current_app, jsonify, request, stream_with_context
from flask import Response as FlaskResponse
from spectree import Response

from gateway import job_serving
from gateway.inputs import idempotency_key, json_body, prefer_wait
from gateway.job_events import HEADERS, check_last_event_id, job_events, sse
from gateway.openapi import DeliveryList, ErrorBody, documented
from shared.protocol import Job, JobCreate, JobList, JobListQuery

bp = Blueprint("jobs", __name__, url_prefix="/v1/jobs")


@bp.post("")
@documented(
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

    A greedy or seeded request is answered from the result cache when an identical one
    succeeded within CACHE_TTL_S (200, `metrics.cache_hit`), or follows an identical one that
    is queued or running and ends with it (`metrics.coalesced`); header `Fleet-Cache: hit`,
    `coalesced` or `miss`. `"cache": false` or `Cache-Control: no-cache` runs it anew.
    """
    wait_s = prefer_wait()
    key = idempotency_key()
    raw = json_body()
    body = job_serving.parse(raw)
    submitted = job_serving.submit(body, raw, key, wait_s)
    job = submitted.job
    if body.stream:
        created = sse("created", job.model_dump(mode="json"))  # no id: resuming skips nothing
        response = _event_stream(job, "0", first=created)
    else:
        response = _job_response(job, 200 if job.status.terminal else 202, wait_s)
    if submitted.replayed:
        response.headers["Idempotent-Replayed"] = "true"
    if submitted.cache:
        response.headers["Fleet-Cache"] = submitted.cache
    return response


@bp.get("")
@documented(
    query=JobListQuery, resp=Response(HTTP_200=JobList, HTTP_400=ErrorBody, HTTP_422=ErrorBody),
    tags=["jobs"],
)  # fmt: skip
def list_jobs():
    """Your recent jobs, newest first: those your API key submitted (with keys off, every
    job submitted without one), at most the last 1000, each kept RESULT_TTL_S. `limit`
    (1-100, default 20) a page; `after` the last id of the page before. A batch's jobs are
    in its results, not here."""
    query = JobListQuery.model_validate(request.args.to_dict())
    jobs, more = job_serving.recent(query.after, query.limit)
    page = JobList(
        data=jobs, has_more=more,
        first_id=jobs[0].id if jobs else None, last_id=jobs[-1].id if jobs else None,
    )  # fmt: skip
    return current_app.response_class(page.model_dump_json(), mimetype="application/json")


@bp.post("/<job_id>/cancel")
@documented(
    resp=Response(HTTP_200=Job, HTTP_202=Job, HTTP_404=ErrorBody, HTTP_409=ErrorBody), tags=["jobs"]
)
def cancel_job(job_id: str):
    """Cancel a job.

    A queued job ends `canceled` at once and never runs (200). A running one stops at its
    next generated token and then ends `canceled` (202; its batch-mates go on). A job that
    already ended is a 409.
    """
    job = job_serving.cancel(job_id)
    return _job_response(job, 200 if job.status.terminal else 202, None)


@bp.get("/<job_id>/webhook_deliveries")
@documented(resp=Response(HTTP_200=DeliveryList, HTTP_404=ErrorBody), tags=["jobs"])
def job_webhook_deliveries(job_id: str):
    """The webhooks sent about a job: each delivery with every attempt (time, HTTP status
    or error, next retry)."""
    return jsonify(object="list", data=job_serving.webhook_deliveries(job_id))


@bp.get("/<job_id>/events")
@documented(resp=Response(HTTP_404=ErrorBody), tags=["jobs"])
def job_event_stream(job_id: str):
    """The job's text as Server-Sent Events (`text/event-stream`).

    `token` events (`{"delta", "index"}`) as the text is generated, for a job submitted with
    `"stream": true`; `restart` if a retry generates it anew (drop the text so far); then one
    `done` event with the job object. Each event's `id` is its position: reconnect with
    `Last-Event-ID` (header, or `last_event_id` in the query) to resume right after it, on
    any gateway. A job that ended replays its events. A job that does not stream gets one
    `token` with its whole text once it ends. A comment line comes every 15 s while idle.
    """
    job = job_serving.find(job_id)
    after = check_last_event_id(
        request.headers.get("Last-Event-ID") or request.args.get("last_event_id")
    )
    return _event_stream(job, after)


@bp.get("/<job_id>")
@documented(resp=Response(HTTP_200=Job, HTTP_404=ErrorBody), tags=["jobs"])
def get_job(job_id: str):
    """Read a job. Finished jobs are kept RESULT_TTL_S seconds, then 404."""
    return jsonify(job_serving.find(job_id).model_dump(mode="json"))


def _event_stream(job: Job, after: str, first: str = ""):
    def events():
        if first:
            yield first
        yield from job_events(job, after)

    response = FlaskResponse(
        stream_with_context(events()), mimetype="text/event-stream", headers=HEADERS
    )
    response.headers["Location"] = job.urls["get"]
    response.headers["Fleet-Job-Id"] = job.id
    return response


def _job_response(job: Job, status: int, wait_s: int | None):
    response = current_app.response_class(
        job.model_dump_json(), status=status, mimetype="application/json"
    )
    response.headers["Location"] = job.urls["get"]
    if wait_s:
        response.headers["Preference-Applied"] = f"wait={wait_s}"
    return response
