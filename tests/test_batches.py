"""Batches and webhook events end to end: a real gateway, GPU worker (demo model), webhook
worker and Redis, and a real HTTP receiver on loopback that verifies every signature."""

from __future__ import annotations

import base64
import json
import os
import time
import uuid
from collections import Counter
from collections.abc import Iterator

import pytest
import redis
import requests
from standardwebhooks import Webhook

from fleet import commands
from fleet.processes import Process, free_port, wait_until
from shared.batch_store import BatchStore
from shared.dead_letters import DeadLetters
from shared.job_consumer import JobConsumer
from shared.job_store import JobStore
from shared.keys import Keys
from shared.protocol import BatchOptions, BatchRequest, JobInput, Output, Usage
from shared.records import terminal_fields, webhook_fields
from shared.settings import Settings
from shared.states import JobStatus, Lane
from shared.stats import QueueStats
from tests.conftest import Fleet, fleet_env, start_fleet
from tests.webhook_receiver import Receiver
from webhooks.dispatcher import EventDispatcher

MAX_REQUESTS = 600


@pytest.fixture(scope="module")
def secret() -> str:
    return "whsec_" + base64.b64encode(os.urandom(32)).decode()


@pytest.fixture(scope="module")
def bfleet(redis_url, demo_model_path, tmp_path_factory, secret) -> Iterator[Fleet]:
    """A fleet with webhooks on (loopback receivers allowed, short retries) and its webhook
    worker, under its own key prefix."""
    logs = tmp_path_factory.mktemp("batch-logs")
    prefix = f"b-{uuid.uuid4().hex[:6]}"
    settings = dict(
        webhook_secret=secret,
        webhook_allow_private=1,
        webhook_retry_schedule_s="0.5,0.5,0.5",
        webhook_timeout_s=2,
        webhook_metrics_port=free_port(),
        batch_max_requests=MAX_REQUESTS,
    )
    running, worker, gateway = start_fleet(redis_url, logs, prefix, **settings)
    env = fleet_env(redis_url, key_prefix=prefix, **settings)
    name = f"webhooks-{prefix}@localhost"
    hooks = Process("webhooks", commands.webhook_worker(name), env, logs / "webhooks.log")
    running.webhook_metrics_url = f"http://127.0.0.1:{settings['webhook_metrics_port']}/metrics"
    running.webhook_worker = hooks
    try:
        wait_until(lambda: _metrics_up(running.webhook_metrics_url), 60, "no webhook worker", hooks)
        yield running
    finally:
        hooks.stop()
        gateway.stop()
        worker.stop()


def _metrics_up(url: str) -> bool:
    try:
        return requests.get(url, timeout=1).status_code == 200
    except requests.ConnectionError:
        return False


def _create(fleet: Fleet, body=None, jsonl: str | None = None, params=None, headers=None):
    if jsonl is not None:
        headers = {"Content-Type": "application/x-ndjson"} | (headers or {})
        return fleet.http.post(
            fleet.url("/v1/batches"), data=jsonl.encode(), params=params, headers=headers,
            timeout=60,
        )  # fmt: skip
    return fleet.http.post(fleet.url("/v1/batches"), json=body, headers=headers, timeout=60)


def _get(fleet: Fleet, batch_id: str) -> dict:
    response = fleet.http.get(fleet.url(f"/v1/batches/{batch_id}"), timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def _wait_batch(fleet: Fleet, batch_id: str, statuses=("completed",), timeout_s=300) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = _get(fleet, batch_id)
        if batch["status"] in statuses:
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} still {batch['status']}: {batch}")


def _results(fleet: Fleet, batch_id: str) -> tuple[list[dict], str]:
    response = fleet.http.get(fleet.url(f"/v1/batches/{batch_id}/results"), timeout=60)
    assert response.status_code == 200, response.text
    assert response.headers["Content-Type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in response.text.splitlines()]
    return lines, response.headers["Batch-Status"]


def _events(receiver: Receiver, path: str, secret: str) -> list[dict]:
    """Every request the receiver got on ``path``, signature verified, as (id, payload)."""
    out = []
    for request in receiver.requests(path):
        payload = Webhook(secret).verify(request.body, request.headers)
        out.append({"webhook_id": request.headers["webhook-id"], **payload})
    return out


def _wait_events(receiver, path, secret, count, timeout_s=30) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events = _events(receiver, path, secret)
        if len(events) >= count:
            return events
        time.sleep(0.1)
    raise AssertionError(f"{path}: {len(events)} events, expected {count}: {events}")


def _requests(n: int, tag: str, **fields) -> list[dict]:
    return [
        {"custom_id": f"{tag}-{i}", "prompt": f"request {i} of {tag}", "max_new_tokens": 4} | fields
        for i in range(n)
    ]


# --- batches end to end ------------------------------------------------------------------


def test_batch_of_200_completes_with_full_results_and_one_event(bfleet, receiver, secret):
    url = receiver.script("/batch-200", 200)
    body = {"requests": _requests(200, "b200"), "webhook": url, "metadata": {"team": "data"}}
    response = _create(bfleet, body)
    assert response.status_code == 202, response.text
    batch = response.json()
    assert batch["status"] == "queued"
    assert batch["request_counts"] == {"total": 200, "completed": 0, "failed": 0, "cancelled": 0}
    assert batch["metadata"] == {"team": "data"}
    assert response.headers["Location"] == batch["urls"]["get"]

    partial_seen = None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        lines, status = _results(bfleet, batch["id"])
        if status == "completed":
            break
        if 0 < len(lines) < 200:
            partial_seen = len(lines)
        time.sleep(0.3)
    done = _get(bfleet, batch["id"])
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": 200, "completed": 200, "failed": 0, "cancelled": 0}
    assert done["in_progress_at"] and done["completed_at"]
    assert partial_seen, "results were not served while the batch was in progress"

    lines, status = _results(bfleet, batch["id"])
    assert status == "completed" and len(lines) == 200
    assert {line["custom_id"] for line in lines} == {f"b200-{i}" for i in range(200)}
    for line in lines:
        assert set(line) == {"custom_id", "job_id", "status", "output", "error"}
        assert line["status"] == "succeeded" and line["error"] is None
        assert line["output"]["usage"]["completion_tokens"] >= 1
    job = bfleet.get(lines[0]["job_id"])  # each request is a job of the batch
    assert job["batch_id"] == batch["id"] and job["custom_id"] == lines[0]["custom_id"]

    events = _wait_events(receiver, "/batch-200", secret, 1)
    time.sleep(2)  # a duplicate would have arrived by now
    events = _events(receiver, "/batch-200", secret)
    assert [e["type"] for e in events] == ["batch.completed"]  # no per-request events
    assert events[0]["data"]["id"] == batch["id"]
    assert events[0]["data"]["status"] == "completed"
    assert events[0]["data"]["request_counts"]["completed"] == 200

    deliveries = bfleet.http.get(bfleet.url(done["urls"]["webhook_deliveries"]), timeout=30)
    [delivery] = deliveries.json()["data"]
    assert delivery["id"] == events[0]["webhook_id"]
    assert delivery["state"] == "delivered" and delivery["attempts"][0]["status"] == 200
    metrics = requests.get(bfleet.webhook_metrics_url, timeout=5).text
    assert 'fleet_webhook_deliveries_total{outcome="delivered"}' in metrics


def test_jsonl_batch_with_query_options_and_per_request_events(bfleet, receiver, secret):
    url = receiver.script("/jsonl", 200)
    jsonl = "\n".join(json.dumps(r) for r in _requests(5, "nd")) + "\n\n"  # blank lines: ok
    params = {
        "webhook": url,
        "webhook_events": "batch.completed,job.completed",
        "metadata[run]": "nightly",
    }
    response = _create(bfleet, jsonl=jsonl, params=params)
    assert response.status_code == 202, response.text
    batch = response.json()
    assert batch["metadata"] == {"run": "nightly"}
    assert batch["webhook_events"] == ["batch.completed", "job.completed"]
    _wait_batch(bfleet, batch["id"])
    events = _wait_events(receiver, "/jsonl", secret, 6)
    kinds = Counter(e["type"] for e in events)
    assert kinds == {"job.completed": 5, "batch.completed": 1}
    jobs = [e["data"] for e in events if e["type"] == "job.completed"]
    assert {j["custom_id"] for j in jobs} == {f"nd-{i}" for i in range(5)}
    assert all(j["batch_id"] == batch["id"] and "input" not in j for j in jobs)


@pytest.mark.parametrize(
    ("jsonl", "line", "param"),
    [
        ('{"custom_id": "a", "prompt": "x"}\n{"custom_id": "b", "prompt": "y"}\n'
         '{"custom_id": "c"}\n', 3, None),
        ('{"custom_id": "a", "prompt": "x"}\n{"custom_id": "b", "prompt": "y", '
         '"max_new_tokens": "5"}\n', 2, "max_new_tokens"),
        ('{"custom_id": "a", "prompt": "x"}\n{"custom_id": "a", "prompt": "y"}\n', 2, "custom_id"),
        ('{"custom_id": "a", "prompt": "x"}\nnot json\n', 2, None),
        ('{"custom_id": "a", "prompt": "x", "temperature": 9}\n', 1, "temperature"),
        ('["custom_id"]\n', 1, None),
    ],
)  # fmt: skip
def test_a_bad_line_rejects_the_batch_and_queues_nothing(bfleet, jsonl, line, param):
    stream = Keys(bfleet.prefix).stream("demo/qwen3.5-tiny-awq", Lane.BATCH)
    before_len = bfleet.redis.xlen(stream)
    before_keys = len(bfleet.redis.keys(Keys(bfleet.prefix).job("*", "*")))
    before_batches = len(bfleet.redis.keys(Keys(bfleet.prefix).batch("*", "*")))
    response = _create(bfleet, jsonl=jsonl)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["line"] == line and error["param"] == param
    assert error["message"].startswith(f"line {line}: ")
    assert bfleet.redis.xlen(stream) == before_len
    assert len(bfleet.redis.keys(Keys(bfleet.prefix).job("*", "*"))) == before_keys
    assert len(bfleet.redis.keys(Keys(bfleet.prefix).batch("*", "*"))) == before_batches


def test_json_batch_errors_name_the_index_and_field(bfleet):
    requests_ = _requests(3, "j")
    requests_[1]["stop"] = ["ok", ""]
    response = _create(bfleet, {"requests": requests_})
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["index"] == 1 and error["param"] == "stop.1"
    assert error["message"].startswith("requests[1]: 'stop.1': ")
    cases = [
        ({"requests": []}, "at least one"),
        ({"prompt": "x"}, "'requests'"),
        ({"requests": _requests(MAX_REQUESTS + 1, "big")}, "BATCH_MAX_REQUESTS"),
        ({"requests": _requests(1, "w"), "webhook": "http://169.254.169.254/x"}, "webhook"),
        ({"requests": _requests(1, "w"), "webhook_events": ["batch.completed"]}, "webhook"),
        ({"requests": _requests(1, "w"), "webhook": "ftp://example.com/"}, "scheme"),
        ({"requests": _requests(1, "m"), "model": "nope"}, "not served"),
        ({"requests": _requests(1, "u"), "priority": 1}, "priority"),
    ]
    for body, words in cases:
        response = _create(bfleet, body)
        assert response.status_code == 422, (body, response.text)
        assert words in response.json()["error"]["message"], response.text
    response = _create(bfleet, jsonl="{}", params={"colour": "red"})
    assert response.status_code == 422 and "colour" in response.text
    response = bfleet.http.post(bfleet.url("/v1/batches"), data="x", timeout=10)
    assert response.status_code == 415


def test_idempotency_key_makes_one_batch(bfleet):
    body, key = {"requests": _requests(2, "idem")}, f"k-{uuid.uuid4().hex}"
    first = _create(bfleet, body, headers={"Idempotency-Key": key})
    again = _create(bfleet, body, headers={"Idempotency-Key": key})
    assert first.status_code == again.status_code == 202
    assert first.json()["id"] == again.json()["id"]
    assert again.headers["Idempotent-Replayed"] == "true"
    other = _create(bfleet, {"requests": _requests(3, "idem")}, headers={"Idempotency-Key": key})
    assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused"
    _wait_batch(bfleet, first.json()["id"])


def test_interactive_jobs_overtake_a_queued_batch_then_cancel(bfleet, receiver, secret):
    url = receiver.script("/cancelled", 200)
    body = {"requests": _requests(MAX_REQUESTS, "bulk", max_new_tokens=8), "webhook": url}
    batch = _create(bfleet, body).json()
    _wait_batch(bfleet, batch["id"], ("in_progress",))
    for _ in range(5):
        job = bfleet.submit({"prompt": "interactive", "max_new_tokens": 4}, wait=60).json()
        assert job["status"] == "succeeded"
        progress = _get(bfleet, batch["id"])["request_counts"]
        # Served ahead of the batch's backlog: at most the micro-batches already running
        # (and those filled meanwhile) ran before it, never the bulk of the batch.
        assert progress["completed"] < MAX_REQUESTS // 2, progress

    response = bfleet.http.post(bfleet.url(batch["urls"]["cancel"]), timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["status"] in ("cancelling", "cancelled")
    done = _wait_batch(bfleet, batch["id"], ("cancelled",), timeout_s=60)
    counts = done["request_counts"]
    assert counts["cancelled"] > 0
    assert counts["completed"] + counts["failed"] + counts["cancelled"] == MAX_REQUESTS
    assert done["cancelling_at"] and done["cancelled_at"]
    lines, status = _results(bfleet, batch["id"])
    assert status == "cancelled" and len(lines) == MAX_REQUESTS
    assert Counter(line["status"] for line in lines)["canceled"] == counts["cancelled"]
    again = bfleet.http.post(bfleet.url(batch["urls"]["cancel"]), timeout=30)
    assert again.status_code == 409
    events = _wait_events(receiver, "/cancelled", secret, 1)
    time.sleep(1)
    assert [e["type"] for e in _events(receiver, "/cancelled", secret)] == ["batch.cancelled"]
    assert events[0]["data"]["status"] == "cancelled"


def test_unknown_batch_is_404(bfleet):
    for path in ("/v1/batches/batch_x", f"/v1/batches/batch_{uuid.uuid4().hex}/results"):
        response = bfleet.http.get(bfleet.url(path), timeout=10)
        assert response.status_code == 404 and response.json()["error"]["code"] == "batch_not_found"


# --- webhooks on single jobs -------------------------------------------------------------


def test_job_webhook_events_are_signed_and_retried_with_one_id(bfleet, receiver, secret):
    url = receiver.script("/job", 200, 500, 503, 200)  # job.started ok; completed: 2 fails
    body = {"prompt": "hello", "max_new_tokens": 4, "webhook": url,
            "webhook_events": ["job.started", "job.completed"]}  # fmt: skip
    job = bfleet.submit(body, wait=60).json()
    assert job["status"] == "succeeded"
    assert job["webhook"] == url and job["webhook_events"] == ["job.started", "job.completed"]
    events = _wait_events(receiver, "/job", secret, 4)
    by_type: dict[str, list[dict]] = {}
    for event in events:
        by_type.setdefault(event["type"], []).append(event)
    assert len(by_type["job.started"]) == 1 and len(by_type["job.completed"]) == 3
    assert len({e["webhook_id"] for e in by_type["job.completed"]}) == 1  # same id on retries
    completed = by_type["job.completed"][-1]["data"]
    assert completed["id"] == job["id"] and completed["status"] == "succeeded"
    assert completed["output"]["text"] == job["output"]["text"] and "input" not in completed

    def delivered() -> bool:
        response = bfleet.http.get(bfleet.url(job["urls"]["webhook_deliveries"]), timeout=10)
        rows = response.json()["data"]
        return len(rows) == 2 and all(d["state"] == "delivered" for d in rows)

    wait_until(delivered, 30, "deliveries not recorded as delivered")
    rows = bfleet.http.get(bfleet.url(job["urls"]["webhook_deliveries"]), timeout=10).json()
    attempts = {d["type"]: [a["status"] for a in d["attempts"]] for d in rows["data"]}
    assert attempts == {"job.started": [200], "job.completed": [500, 503, 200]}
    assert rows["data"][1]["attempts"][0]["next_retry_at"]


def test_job_webhook_is_checked_at_submit(bfleet):
    cases = [
        ({"webhook": "http://169.254.169.254/latest"}, "invalid_webhook"),
        ({"webhook": "file:///etc/passwd"}, "invalid_webhook"),
        ({"webhook_events": ["job.completed"]}, "invalid_request"),
        ({"webhook": "http://127.0.0.1/x", "webhook_events": ["batch.completed"]},
         "invalid_request"),
    ]  # fmt: skip
    for extra, code in cases:
        response = bfleet.submit({"prompt": "x"} | extra)
        assert response.status_code == 422, response.text
        assert response.json()["error"]["code"] == code


def test_webhooks_are_refused_when_the_fleet_has_no_secret(fleet):
    response = fleet.submit({"prompt": "x", "webhook": "https://example.com/hook"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "webhooks_disabled"


# --- against Redis alone -----------------------------------------------------------------


class Queue:
    """The queue's roles over one client: the gateway's stores, a worker's consumer."""

    def __init__(self, client: redis.Redis, prefix: str) -> None:
        keys = self.keys = Keys(prefix)
        self.store = JobStore(client, keys, 60)
        self.consumer = JobConsumer(client, keys, 60)
        self.batches = BatchStore(client, keys, 60)
        self.stats = QueueStats(client, keys, 60)
        self.dead = DeadLetters(client, keys, 60)


def test_a_cancelled_batch_request_read_before_the_sweep_never_starts(redis_url):
    """Cancel races a worker that already read entries: the start script refuses them."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    q = Queue(client, f"race-{uuid.uuid4().hex[:6]}")
    requests_ = [BatchRequest(custom_id=str(i), prompt="p") for i in range(4)]
    batch = q.batches.create("m", requests_, BatchOptions()).batch
    entries = q.consumer.read_next("m", "w", 2, None)
    client.hset(q.keys.batch("m", batch.id), "status", "cancelling")  # the sweep has not run
    started, dropped = q.consumer.start("m", entries, "w")
    assert started == [] and len(dropped) == 2
    final = q.batches.cancel("m", batch.id)
    assert final.status == "cancelled"
    assert final.request_counts.cancelled == 4


def test_interactive_entries_are_read_before_batch_entries(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    q = Queue(client, f"prio-{uuid.uuid4().hex[:6]}")
    q.batches.create("m", [BatchRequest(custom_id=str(i), prompt="p") for i in range(5)],
                     BatchOptions())  # fmt: skip
    interactive = [q.store.submit("m", JobInput(prompt="now"), {}).job.id for _ in range(2)]
    first = q.consumer.read_next("m", "w", 4, None)
    assert [e.job_id for e in first[:2]] == interactive
    assert [e.lane for e in first] == [Lane.INTERACTIVE] * 2 + [Lane.BATCH] * 2
    assert q.stats.backlog("m", Lane.BATCH).undelivered == 3
    assert q.stats.backlog("m").total == 7  # 4 read (pending) + 3 unread


def test_an_event_processed_twice_makes_one_delivery(redis_url):
    prefix = f"ev-{uuid.uuid4().hex[:6]}"
    settings = Settings(
        redis_url=redis_url, key_prefix=prefix, webhook_allow_private=True, model_name="m",
        webhook_secret="whsec_" + base64.b64encode(os.urandom(32)).decode(),
    )  # fmt: skip
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    q = Queue(client, prefix)
    extra = webhook_fields("http://127.0.0.1:9/x", ["job.canceled"])
    job = q.store.submit("m", JobInput(prompt="p"), {}, extra=extra).job
    q.store.cancel("m", job.id)  # ends it: one job.canceled event in the outbox
    events = q.keys.events("m")
    [(entry_id, fields)] = client.xrange(events)
    dispatcher = EventDispatcher(settings, client, "test")
    dispatcher.dispatch(events, entry_id, fields)
    dispatcher.dispatch(events, entry_id, fields)  # as after a crash before the ack
    owned = client.lrange(q.keys.webhook_owner(job.id), 0, -1)
    assert len(owned) == 1
    payload = json.loads(client.hget(q.keys.webhook(owned[0]), "payload"))
    assert payload["type"] == "job.canceled" and payload["data"]["status"] == "canceled"
    assert client.xlen(events) == 0


def test_a_requeued_dead_letter_of_a_batch_is_counted_once(redis_url):
    """Dead-lettered (failed), then re-queued by an operator and run: the batch counts the
    request once, keeps one result line for it, and completes again."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    q = Queue(client, f"dl-{uuid.uuid4().hex[:6]}")
    batches = q.batches
    batch = batches.create("m", [BatchRequest(custom_id="only", prompt="p")], BatchOptions())
    [entry] = q.consumer.read_next("m", "w", 1, None)
    q.consumer.dead_letter("m", entry, times_delivered=4)
    failed = batches.get("m", batch.batch.id)
    assert failed.status == "completed" and failed.request_counts.failed == 1
    [letter] = q.dead.list("m")
    assert q.dead.requeue("m", letter["id"])
    reopened = batches.get("m", batch.batch.id)
    assert reopened.status == "in_progress" and reopened.request_counts.failed == 0
    assert list(batches.results("m", batch.batch.id)) == []
    [again] = q.consumer.read_next("m", "w", 1, None)
    assert again.lane == Lane.BATCH
    [started], _ = q.consumer.start("m", [again], "w")
    assert started.entry == again
    output = Output(
        text="ok", finish_reason="length", usage=Usage(prompt_tokens=1, completion_tokens=1)
    )
    q.consumer.finish("m", [(again, terminal_fields(status=JobStatus.SUCCEEDED, output=output))])
    done = batches.get("m", batch.batch.id)
    assert done.status == "completed"
    assert done.request_counts.model_dump() == {
        "total": 1,
        "completed": 1,
        "failed": 0,
        "cancelled": 0,
    }
    [line] = [json.loads(x) for x in batches.results("m", batch.batch.id)]
    assert line["custom_id"] == "only" and line["status"] == "succeeded"
