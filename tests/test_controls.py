"""Cancel, deadlines, idempotency and backpressure, through the gateway and a real worker."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import requests

from gateway import create_app
from shared.keys import Keys
from shared.settings import Settings

LONG = {"prompt": "Long", "max_new_tokens": 400}


def _wait_status(fleet, job_id: str, status: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while fleet.get(job_id)["status"] != status:
        assert time.monotonic() < deadline, fleet.get(job_id)
        time.sleep(0.02)


def test_cancel_a_running_job_stops_it_and_spares_its_batch_mates(fleet):
    with ThreadPoolExecutor(2) as pool:
        victim, mate = pool.map(
            lambda b: fleet.submit(b).json(), [LONG, dict(LONG, max_new_tokens=60)]
        )
    _wait_status(fleet, victim["id"], "running")
    time.sleep(0.3)
    response = fleet.http.post(fleet.url(f"/v1/jobs/{victim['id']}/cancel"), timeout=10)
    assert response.status_code == 202 and response.json()["cancel_requested"] is True
    canceled = fleet.wait_done(victim["id"])
    assert canceled["status"] == "canceled" and canceled["output"] is None
    finished_mate = fleet.wait_done(mate["id"])
    assert finished_mate["status"] == "succeeded"
    assert finished_mate["started_at"] == canceled["started_at"], "they should share a batch"
    assert finished_mate["output"]["usage"]["completion_tokens"] == 60
    # Canceling a job that already ended is a conflict.
    again = fleet.http.post(fleet.url(f"/v1/jobs/{victim['id']}/cancel"), timeout=10)
    assert again.status_code == 409 and again.json()["error"]["code"] == "job_already_ended"


def test_cancel_a_queued_job_means_it_never_runs(fleet):
    blocker = fleet.submit(LONG).json()
    _wait_status(fleet, blocker["id"], "running")
    queued = fleet.submit({"prompt": "never", "max_new_tokens": 4}).json()
    response = fleet.http.post(fleet.url(f"/v1/jobs/{queued['id']}/cancel"), timeout=10)
    assert response.status_code == 200 and response.json()["status"] == "canceled"
    fleet.http.post(fleet.url(f"/v1/jobs/{blocker['id']}/cancel"), timeout=10)
    fleet.wait_done(blocker["id"])
    time.sleep(1)  # the worker has read past the canceled entry by now
    job = fleet.get(queued["id"])
    assert job["status"] == "canceled" and job["started_at"] is None and job["worker"] is None
    missing = fleet.http.post(fleet.url("/v1/jobs/job_" + "0" * 32 + "/cancel"), timeout=10)
    assert missing.status_code == 404


def test_deadlines_expire_queued_jobs_and_stop_running_ones(fleet):
    running = fleet.submit(dict(LONG, timeout_s=1.5)).json()
    _wait_status(fleet, running["id"], "running")
    late = fleet.submit({"prompt": "late", "max_new_tokens": 4, "timeout_s": 0.3}).json()
    stopped = fleet.wait_done(running["id"])
    assert stopped["status"] == "expired", stopped
    assert stopped["error"]["code"] == "deadline_exceeded"
    assert stopped["started_at"] is not None
    expired = fleet.wait_done(late["id"])
    assert expired["status"] == "expired" and expired["started_at"] is None
    assert expired["deadline"] is not None


def test_idempotency_key_returns_the_first_job(fleet):
    key = str(uuid.uuid4())
    body = {"prompt": "once", "max_new_tokens": 4}
    first = fleet.submit(body, headers={"Idempotency-Key": key})
    again = fleet.submit({"max_new_tokens": 4, "prompt": "once"}, headers={"Idempotency-Key": key})
    assert first.status_code == 202 and again.status_code in (200, 202)
    assert again.json()["id"] == first.json()["id"]
    assert again.headers["Idempotent-Replayed"] == "true"
    other = fleet.submit({"prompt": "twice", "max_new_tokens": 4}, headers={"Idempotency-Key": key})
    assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused"


def test_concurrent_duplicates_create_exactly_one_job(fleet):
    key = str(uuid.uuid4())
    before = len(fleet.redis.keys(Keys(fleet.prefix).job("*", "*")))

    def post(_):
        return requests.post(
            fleet.url("/v1/jobs"), json={"prompt": "dup", "max_new_tokens": 2},
            headers={"Idempotency-Key": key}, timeout=30,
        )  # fmt: skip

    with ThreadPoolExecutor(20) as pool:
        responses = list(pool.map(post, range(20)))
    assert {r.status_code for r in responses} <= {200, 202}
    assert len({r.json()["id"] for r in responses}) == 1
    assert sum(r.headers.get("Idempotent-Replayed") == "true" for r in responses) == 19
    assert len(fleet.redis.keys(Keys(fleet.prefix).job("*", "*"))) == before + 1


def test_backpressure_refuses_with_retry_after_and_keeps_what_it_accepted(redis_url):
    settings = Settings(
        redis_url=redis_url, key_prefix=f"bp{uuid.uuid4().hex[:6]}", max_queue_depth=5
    )
    client = create_app(settings).test_client()
    accepted = [client.post("/v1/jobs", json={"prompt": str(i)}) for i in range(5)]
    assert all(r.status_code == 202 for r in accepted)
    refused = client.post("/v1/jobs", json={"prompt": "one too many"})
    assert refused.status_code == 429
    assert refused.get_json()["error"]["code"] == "queue_full"
    assert 1 <= int(refused.headers["Retry-After"]) <= 600
    for response in accepted:  # accepted jobs are still there, still queued
        assert client.get(f"/v1/jobs/{response.get_json()['id']}").get_json()["status"] == "queued"
