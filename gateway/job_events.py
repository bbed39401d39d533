"""A job's text as Server-Sent Events, read from its token stream in Redis.

Each event's SSE ``id`` is its Redis entry id, so a client that reconnects with
``Last-Event-ID`` (to any gateway process) resumes right after it: nothing missed, nothing
twice. Events: ``token`` ``{"delta", "index"}``; ``restart`` (the job runs again from its
first token after a worker died: drop the text so far); and last ``done`` with the job
object. A job that did not ask to stream is told the same way once it ends: one ``token``
with its whole text (id ``0-1``), then ``done`` (id ``0-2``). If the stream cannot be read
(Redis unreachable), a last ``error`` event says which id to resume after.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import redis

from gateway.errors import APIError
from gateway.extensions import fleet
from shared.protocol import Job

KEEPALIVE_S = 15.0  # a comment this often keeps proxies from closing an idle stream
READ_BLOCK_MS = 5000  # below the Redis client's socket timeout
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_ENTRY_ID = re.compile(r"[0-9]+-[0-9]+")  # ASCII: \d takes any script's digits


def check_last_event_id(value: str | None) -> str:
    """The entry to resume after ("0": from the start); 400 for a malformed id."""
    if value is None or value == "":
        return "0"
    # fullmatch: "1-1\n" matched with a trailing newline, and Redis refused it mid-stream.
    # Each part is an unsigned 64-bit number for Redis.
    if not _ENTRY_ID.fullmatch(value) or any(int(part) >= 2**64 for part in value.split("-")):
        raise APIError(
            400, "invalid_header", "Last-Event-ID must be the id of an event of this stream",
            param="Last-Event-ID",
        )  # fmt: skip
    return value


def sse(event: str, data: dict, event_id: str | None = None) -> str:
    head = f"id: {event_id}\n" if event_id else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def job_events(job: Job, after: str) -> Iterator[str]:
    """The events of ``job`` after entry ``after``, until its ``done``."""
    if job.stream:
        yield from _streamed(job, after)
    else:
        yield from _whole(job, after)


def _streamed(job: Job, after: str) -> Iterator[str]:
    quiet_since = time.monotonic()
    while True:
        try:
            events = fleet.jobs.read_tokens(
                job.model, {job.id: after}, READ_BLOCK_MS, fleet.stream_reader
            )
        except redis.RedisError as exc:  # Redis down, or GATEWAY_MAX_STREAMS streams open
            yield sse("error", {
                "code": "stream_unavailable",
                "message": f"the job's stream cannot be read now ({exc}); reconnect with "
                f"Last-Event-ID: {after} to resume where it broke off",
            })  # fmt: skip
            return
        for _, entry_id, fields in events:
            after = entry_id
            kind = fields.get("type")
            if kind == "token":
                data = {"delta": fields["delta"], "index": int(fields["index"])}
                yield sse("token", data, entry_id)
            elif kind == "restart":
                yield sse("restart", {}, entry_id)
            elif kind == "end":
                yield sse("done", _final(job), entry_id)
                return
        if events:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= KEEPALIVE_S:
            quiet_since = time.monotonic()
            yield ": keepalive\n\n"


def _whole(job: Job, after: str) -> Iterator[str]:
    model, job_id = job.model, job.id

    def read() -> Job | None:
        return fleet.jobs.get(model, job_id)

    while not job.status.terminal:
        job = fleet.waiter.wait(job_id, KEEPALIVE_S, read) or job
        if not job.status.terminal:
            yield ": keepalive\n\n"
    if after == "0" and job.output is not None and job.output.text:
        yield sse("token", {"delta": job.output.text, "index": 0}, "0-1")
    yield sse("done", job.model_dump(mode="json"), "0-2")


def _final(job: Job) -> dict:
    final = fleet.jobs.get(job.model, job.id) or job
    return final.model_dump(mode="json")
