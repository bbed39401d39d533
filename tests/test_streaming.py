"""Token streaming through Redis: the native SSE stream against a real fleet (gateway over
HTTP, a worker running the demo model, Redis)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import requests


@dataclass
class Event:
    id: str | None
    event: str
    data: dict


def events(response: requests.Response) -> Iterator[Event]:
    """Parse a text/event-stream response (comments skipped)."""
    fields: dict[str, str] = {}
    for line in response.iter_lines(decode_unicode=True):
        if line == "":
            if fields:
                yield Event(fields.get("id"), fields.get("event", "message"),
                            json.loads(fields.get("data", "{}")))  # fmt: skip
            fields = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(": ")
            fields[name] = value


def submit_streaming(fleet, body: dict) -> tuple[str, list[Event]]:
    with fleet.http.post(
        fleet.url("/v1/jobs"), json=body | {"stream": True}, stream=True, timeout=120
    ) as response:
        assert response.status_code == 200, response.text
        assert response.headers["Content-Type"].startswith("text/event-stream")
        assert response.headers["Cache-Control"] == "no-cache"
        got = list(events(response))
    assert got[0].event == "created" and got[0].id is None
    return got[0].data["id"], got[1:]


def read_events(fleet, job_id: str, header: str | None = None, query: str | None = None):
    headers = {"Last-Event-ID": header} if header else {}
    params = {"last_event_id": query} if query else {}
    with fleet.http.get(
        fleet.url(f"/v1/jobs/{job_id}/events"), headers=headers, params=params, stream=True,
        timeout=120,
    ) as response:  # fmt: skip
        assert response.status_code == 200, response.text
        return list(events(response))


def text_of(stream: list[Event]) -> str:
    """The text a client builds: deltas joined, dropped again at each restart."""
    text = ""
    for event in stream:
        if event.event == "restart":
            text = ""
        elif event.event == "token":
            text += event.data["delta"]
    return text


def test_streamed_deltas_add_up_to_the_output(fleet):
    job_id, stream = submit_streaming(fleet, {"prompt": "Once upon", "max_new_tokens": 24})
    tokens = [e for e in stream if e.event == "token"]
    assert len(tokens) >= 2, "the text came in pieces, not at the end"
    assert [e.data["index"] for e in tokens] == list(range(len(tokens)))
    done = stream[-1]
    assert done.event == "done" and done.data["id"] == job_id
    assert done.data["status"] == "succeeded" and done.data["stream"] is True
    assert text_of(stream) == done.data["output"]["text"] == fleet.get(job_id)["output"]["text"]
    assert all(e.id for e in stream)


def test_stop_strings_never_leak_into_the_stream(fleet):
    plain = fleet.run({"prompt": "Stop here", "max_new_tokens": 32})["output"]["text"]
    assert len(plain) > 6
    stop = plain[3:5]  # a stop string the greedy text is sure to hold
    _, stream = submit_streaming(
        fleet, {"prompt": "Stop here", "max_new_tokens": 32, "stop": [stop]}
    )
    done = stream[-1].data
    assert done["output"]["finish_reason"] == "stop"
    assert text_of(stream) == done["output"]["text"] == plain[: plain.find(stop)]


def test_sampled_streams_match_their_output(fleet):
    """Sampling wanders through the byte-level vocabulary (multi-byte pieces included): the
    deltas still add up exactly (tests/test_text_stream.py checks characters are never split)."""
    outputs = []
    for seed in range(4):
        body = {"prompt": "Tell me", "max_new_tokens": 40, "temperature": 1.5, "seed": seed}
        _, stream = submit_streaming(fleet, body)
        outputs.append(stream[-1].data["output"]["text"])
        assert text_of(stream) == outputs[-1]
    assert any(ord(char) > 127 for text in outputs for char in text), "multi-byte text seen"


def test_an_ended_job_replays_and_resumes_after_any_event(fleet):
    job_id, live = submit_streaming(fleet, {"prompt": "Resume me", "max_new_tokens": 16})
    replay = read_events(fleet, job_id)
    assert [(e.id, e.event, e.data) for e in replay[:-1]] == [
        (e.id, e.event, e.data) for e in live[:-1]
    ]
    middle = len(live) // 2
    resumed = read_events(fleet, job_id, header=live[middle].id)
    assert [e.id for e in resumed] == [e.id for e in live[middle + 1 :]]
    by_query = read_events(fleet, job_id, query=live[middle].id)
    assert [e.id for e in by_query] == [e.id for e in resumed]


def test_a_stream_read_while_the_job_runs_misses_nothing(fleet):
    response = fleet.submit({"prompt": "Watch me", "max_new_tokens": 48, "stream": True},
                            stream=True)  # fmt: skip
    response.close()  # the submitting client went away at once: the job goes on
    job_id = response.headers["Fleet-Job-Id"]
    stream = read_events(fleet, job_id)
    assert stream[-1].event == "done"
    assert text_of(stream) == fleet.get(job_id)["output"]["text"]


def test_a_reconnecting_client_resumes_a_running_job_where_it_left(fleet):
    with fleet.submit({"prompt": "Go on", "max_new_tokens": 64, "stream": True},
                      stream=True) as response:  # fmt: skip
        job_id = response.headers["Fleet-Job-Id"]
        first = []
        for event in events(response):
            if event.event == "token":
                first.append(event)
            if len(first) == 3:
                break  # the client drops the connection mid-generation
    rest = read_events(fleet, job_id, header=first[-1].id)
    assert rest[0].data["index"] == 3 and rest[-1].event == "done"
    assert text_of(first + rest) == fleet.get(job_id)["output"]["text"]


def test_a_job_that_does_not_stream_is_told_once_it_ends(fleet):
    job = fleet.run({"prompt": "Whole", "max_new_tokens": 8})
    stream = read_events(fleet, job["id"])
    assert [e.event for e in stream] == ["token", "done"]
    assert stream[0].data == {"delta": job["output"]["text"], "index": 0}
    assert [e.event for e in read_events(fleet, job["id"], header=stream[0].id)] == ["done"]


@pytest.mark.parametrize("bad", ["abc", "1-2-3", "-1"])
def test_a_malformed_last_event_id_is_a_400(fleet, bad):
    job = fleet.run({"prompt": "x", "max_new_tokens": 1})
    response = fleet.http.get(
        fleet.url(f"/v1/jobs/{job['id']}/events"), headers={"Last-Event-ID": bad}, timeout=30
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "Last-Event-ID"


@pytest.mark.parametrize("bad", ["1-1\n", "\u0661-\u0661", f"{2**64}-0"])
def test_an_id_redis_would_refuse_is_a_400(fleet, bad):
    """These passed the check, and a streamed job's events then ended in an error event
    saying to resume after the very same id."""
    job = fleet.run({"prompt": "x", "max_new_tokens": 1})
    response = fleet.http.get(
        fleet.url(f"/v1/jobs/{job['id']}/events"), params={"last_event_id": bad}, timeout=30
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_header"


def test_events_of_an_unknown_job_are_a_404(fleet):
    response = fleet.http.get(fleet.url(f"/v1/jobs/job_{'0' * 32}/events"), timeout=30)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "job_not_found"
