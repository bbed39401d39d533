"""schemathesis hooks for tests/test_fuzz.py, loaded by ``st run`` (SCHEMATHESIS_HOOKS):
JSONL request bodies, and checks the built-in ones cannot make. A check runs only when
``--checks`` names it."""

from __future__ import annotations

import json

import schemathesis
from pydantic import ValidationError

from shared.protocol import Job

# A JSONL batch is documented as a string body (one request per line): sent as it is.
schemathesis.serializer.alias(["application/x-ndjson"], "text/plain")

PROTECTED = ("/v1/", "/openai/v1/")
JOB_EVENTS = {"created", "token", "restart", "done", "error"}
OPENAI_CHUNKS = {"chat.completion.chunk", "text_completion"}


def _events(body: bytes) -> list[dict[str, str]]:
    """The events of a text/event-stream body, comments (keepalives) left out."""
    events = []
    for block in body.decode("utf-8").replace("\r\n", "\n").split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.split("\n"):
            if line and not line.startswith(":"):
                name, _, value = line.partition(":")
                fields[name] = fields.get(name, "") + value.removeprefix(" ")
        if "data" in fields:
            fields.setdefault("event", "message")
            events.append(fields)
    return events


@schemathesis.check
def event_data_conforms(ctx, response, case):
    """The data of each Server-Sent Event is what the document says: the job object in
    ``created`` and ``done`` (last), ``{"delta", "index"}`` in ``token``; on OpenAI's routes
    chunk objects (or an error), then ``[DONE]``."""
    content_type = response.headers.get("content-type", [""])[0]
    if response.status_code != 200 or not content_type.startswith("text/event-stream"):
        return
    events = _events(response.content)
    assert events, "an event stream with no event"
    # schemathesis reads at most 20 events of a stream (or for its request timeout): then
    # the last one may be cut, and the stream has not ended.
    whole = not response.stream_cut_short
    if not whole:
        events = events[:-1]
    if case.path.startswith("/openai/"):
        _check_openai(events, whole)
    else:
        _check_job(events, whole)


def _check_job(events: list[dict[str, str]], whole: bool) -> None:
    for number, event in enumerate(events):
        kind, data = event["event"], json.loads(event["data"])
        assert kind in JOB_EVENTS, f"event {number}: unknown event {kind!r}"
        if kind in ("created", "done"):
            try:
                Job.model_validate(data)
            except ValidationError as exc:
                raise AssertionError(f"event {number} ({kind}): not a job object: {exc}") from None
        elif kind == "token":
            assert isinstance(data.get("delta"), str) and isinstance(data.get("index"), int), (
                f"event {number}: token data is not {{delta, index}}: {data}"
            )
    if whole:
        assert events[-1]["event"] in ("done", "error"), f"the stream ends with {events[-1]}"


def _check_openai(events: list[dict[str, str]], whole: bool) -> None:
    chunks = events
    if whole:
        *chunks, last = events
        assert last["data"] == "[DONE]" or "error" in json.loads(last["data"]), (
            f"the stream ends with {last['data']!r}, not [DONE] or an error"
        )
    for number, event in enumerate(chunks):
        chunk = json.loads(event["data"])
        assert chunk.get("object") in OPENAI_CHUNKS, f"event {number} is not a chunk: {chunk}"
        assert isinstance(chunk.get("choices"), list), f"event {number} has no choices: {chunk}"


@schemathesis.check
def refused_without_a_key(ctx, response, case):
    """With REQUIRE_API_KEYS on and no valid key, every protected route answers 401 with
    WWW-Authenticate and the JSON error shape, whatever else the request holds."""
    if not case.path.startswith(PROTECTED):
        return
    assert response.status_code == 401, f"{response.status_code} without a valid key, not 401"
    assert response.headers.get("www-authenticate"), "a 401 without WWW-Authenticate"
    error = json.loads(response.content)["error"]
    assert isinstance(error["code"], str) and isinstance(error["message"], str), error
