"""OpenAI's chat and completions on top of the fleet's jobs: each choice is one job.

The same queue, micro-batching, interactive priority, backpressure and metrics as a
native job (``job_serving.submit``). Non-streaming requests wait for every choice's job;
streaming ones read the jobs' token streams (one XREAD for all choices) and turn them into
OpenAI chunks. A client that goes away cancels its jobs.
"""

from __future__ import annotations

import select
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import redis
from flask import request

from gateway import job_serving
from gateway.errors import APIError
from gateway.extensions import fleet
from gateway.job_events import READ_BLOCK_MS
from gateway.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_chunk,
    chat_completion,
    completion,
    completion_chunk,
    new_completion_id,
    openai_error,
    sse,
    to_job_inputs,
    total_usage,
    usage_chunk,
)
from shared.protocol import Job
from shared.states import JobStatus

Request = ChatCompletionRequest | CompletionRequest
WAIT_STEP_S = 1.0  # how often a waiting request looks whether its client is still there

# How a job that did not succeed is told to an OpenAI client: (HTTP status, error type).
_FAILURES = {
    "prompt_too_long": (400, "invalid_request_error"),
    "invalid_input": (400, "invalid_request_error"),
}


@dataclass
class Choices:
    """The jobs of one request, in choice order."""

    request: Request
    jobs: list[Job]
    id: str  # chatcmpl-... or cmpl-...
    created: int = field(default_factory=lambda: int(time.time()))
    cache: list[str] = field(default_factory=list)  # per choice: hit, coalesced, miss or ''

    @property
    def chat(self) -> bool:
        return isinstance(self.request, ChatCompletionRequest)

    @property
    def model(self) -> str:
        return self.jobs[0].model

    def header(self) -> str:
        return ",".join(job.id for job in self.jobs)

    def headers(self) -> dict[str, str]:
        """Its jobs' ids, and whether each came from the result cache (``Fleet-Cache``)."""
        cache = {"Fleet-Cache": ",".join(self.cache)} if any(self.cache) else {}
        return {"Fleet-Job-Id": self.header()} | cache


def submit(req: Request) -> Choices:
    """Queue one job per choice. If one is refused (a full queue, say), the ones queued
    already are canceled, so a request runs whole or not at all."""
    limit = fleet.settings.max_new_tokens_limit
    jobs: list[Job] = []
    cache: list[str] = []
    try:
        for raw in to_job_inputs(req, limit):
            raw["stream"] = bool(req.stream)
            submitted = job_serving.submit(job_serving.parse(raw), raw, None, None)
            jobs.append(submitted.job)
            cache.append(submitted.cache)
    except Exception:
        cancel(jobs)
        raise
    chat = isinstance(req, ChatCompletionRequest)
    return Choices(req, jobs, new_completion_id(chat), cache=cache)


def respond(choices: Choices) -> dict[str, Any]:
    """Wait for every choice, then the whole response; an APIError if one did not succeed
    or the client went away (then its jobs are canceled)."""
    jobs = [_wait(job) for job in choices.jobs]
    for job in jobs:
        if job.status != JobStatus.SUCCEEDED:
            raise failure(job)
    choices.jobs = jobs
    builder = chat_completion if choices.chat else completion
    extra = {} if choices.chat else {"n": choices.request.n}
    return builder(choices.id, choices.created, choices.model, jobs, **extra)


def _wait(job: Job) -> Job:
    model, job_id = job.model, job.id

    def read() -> Job | None:
        return fleet.jobs.get(model, job_id)

    while not job.status.terminal:
        if client_gone():
            fleet.jobs.cancel(model, job_id)
            raise APIError(499, "client_closed_request", "the client went away")
        job = fleet.waiter.wait(job_id, WAIT_STEP_S, read) or job
    return job


def stream(choices: Choices) -> Iterator[str]:
    """The choices' text as OpenAI chunks, then usage (if asked) and ``[DONE]``."""
    chat, head = choices.chat, (choices.id, choices.created, choices.model)
    after = {job.id: "0" for job in choices.jobs}
    index = {job.id: i for i, job in enumerate(choices.jobs)}
    sent = {job.id: "" for job in choices.jobs}  # text sent per choice
    skip = dict.fromkeys(after, 0)  # after a restart: text already sent, generated again
    ended: dict[str, Job] = {}
    try:
        if chat:
            for i in range(len(choices.jobs)):
                yield sse(chat_chunk(*head, i, role="assistant", content=""))
        while len(ended) < len(choices.jobs):
            if client_gone():
                return
            open_jobs = {job_id: entry for job_id, entry in after.items() if job_id not in ended}
            try:
                events = fleet.jobs.read_tokens(
                    choices.model, open_jobs, READ_BLOCK_MS, fleet.stream_reader
                )
            except redis.RedisError as exc:  # its jobs are canceled below: nothing resumes
                message = f"the stream broke off ({exc}); retry the request"
                yield sse(openai_error(message, "server_error", None, "stream_unavailable"))
                return
            for job_id, entry_id, fields in events:
                after[job_id] = entry_id
                kind = fields.get("type")
                if kind == "restart":
                    skip[job_id] = len(sent[job_id])
                    sent[job_id] = ""
                elif kind == "token":
                    text = _unsent(fields["delta"], sent, skip, job_id)
                    if text:
                        yield sse(_chunk(choices, index[job_id], text=text))
                elif kind == "end":
                    job = fleet.jobs.get(choices.model, job_id)
                    if job is None or job.status != JobStatus.SUCCEEDED:
                        yield sse(failure(job).openai_body())
                        return
                    ended[job_id] = job
                    reason = job.output.finish_reason if job.output else "stop"
                    yield sse(_chunk(choices, index[job_id], reason=reason))
        if choices.request.include_usage:
            jobs = [ended[job.id] for job in choices.jobs]
            usage = total_usage(jobs, 1 if chat else choices.request.n)
            yield sse(usage_chunk(*head, usage, chat))
        yield sse("[DONE]")
    finally:  # done, or the client went away (its writes failed, or it closed)
        cancel([job for job in choices.jobs if job.id not in ended])


def _chunk(choices: Choices, index: int, text: str = "", reason: str | None = None) -> dict:
    head = (choices.id, choices.created, choices.model, index)
    if choices.chat:
        return chat_chunk(*head, content=text or None, finish_reason=reason)
    return completion_chunk(*head, text, finish_reason=reason)


def _unsent(delta: str, sent: dict[str, str], skip: dict[str, int], job_id: str) -> str:
    """The part of a delta the client has not seen: after a restart the new run's text is
    only sent past what the first run sent (the same text, for a greedy or seeded job)."""
    if skip[job_id]:
        cut = min(skip[job_id], len(delta))
        skip[job_id] -= cut
        delta = delta[cut:]
    sent[job_id] += delta
    return delta


def cancel(jobs: list[Job]) -> None:
    for job in jobs:
        fleet.jobs.cancel(job.model, job.id)


def client_gone() -> bool:
    """Whether the client closed its connection (seen through gunicorn's socket: readable
    with nothing to read). Unknown elsewhere: False."""
    sock = request.environ.get("gunicorn.socket")
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, 2) == b""  # 2: MSG_PEEK
    except OSError:
        return True


class OpenAIError(APIError):
    """An error told in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str, code: str | None = None) -> None:
        super().__init__(status, code or type_, message)
        self.type = type_

    def openai_body(self) -> dict[str, Any]:
        return openai_error(self.message, self.type, None, self.code)


def failure(job: Job | None) -> OpenAIError:
    if job is None:
        return OpenAIError(500, "the job's record is gone", "server_error")
    if job.error is not None:
        status, kind = _FAILURES.get(job.error.code, (500, "server_error"))
        return OpenAIError(status, job.error.message, kind, job.error.code)
    return OpenAIError(500, f"the job ended '{job.status}'", "server_error", f"job_{job.status}")
