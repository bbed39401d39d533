"""Submit, poll and wait over real HTTP, through the real worker and the demo AWQ model."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import requests


def _ts(value: str) -> datetime:
    assert value.endswith("Z")
    return datetime.fromisoformat(value)


def test_submit_then_poll(fleet):
    body = {"prompt": "The queue worker", "max_new_tokens": 12, "metadata": {"user": "42"}}
    response = fleet.submit(body)
    assert response.status_code == 202
    job = response.json()
    assert response.headers["Location"] == f"/v1/jobs/{job['id']}"
    assert job["status"] == "queued" and job["output"] is None
    assert job["model"] == "demo/qwen3.5-tiny-awq"

    done = fleet.wait_done(job["id"])
    assert done["status"] == "succeeded", done
    out = done["output"]
    assert out["finish_reason"] in ("stop", "length")
    assert out["usage"]["prompt_tokens"] > 0
    assert 0 < out["usage"]["completion_tokens"] <= 12
    assert isinstance(out["text"], str)
    assert done["error"] is None
    assert done["metadata"] == {"user": "42"}
    assert done["worker"] == fleet.worker
    assert _ts(done["created_at"]) <= _ts(done["started_at"]) <= _ts(done["completed_at"])
    metrics = done["metrics"]
    assert metrics["queue_seconds"] >= 0 and metrics["inference_seconds"] > 0
    assert metrics["batch_size"] >= 1
    defaults = {"temperature": 0.0, "top_p": 1.0, "stop": []}
    assert done["input"] == {"prompt": body["prompt"], "max_new_tokens": 12, **defaults}


def test_messages_use_the_chat_template(fleet):
    short = fleet.run({"messages": [{"role": "user", "content": "hi"}], "max_new_tokens": 4})
    assert short["status"] == "succeeded"
    plain = fleet.run({"prompt": "hi", "max_new_tokens": 4})
    # The template wraps the message in role markers, so the prompt is longer than the text.
    assert short["output"]["usage"]["prompt_tokens"] > plain["output"]["usage"]["prompt_tokens"] + 4


def test_prefer_wait_returns_the_finished_job(fleet):
    response = fleet.submit({"prompt": "Hello", "max_new_tokens": 8}, wait=30)
    assert response.status_code == 200
    assert response.headers["Preference-Applied"] == "wait=30"
    assert response.json()["status"] == "succeeded"
    assert response.json()["output"]["usage"]["completion_tokens"] > 0


def test_prefer_wait_times_out_with_the_job_as_it_stands(fleet):
    # A long job and a 1-second wait: the answer is 202 with a job that has not ended.
    response = fleet.submit({"prompt": "Long", "max_new_tokens": 200}, wait=1)
    assert response.status_code == 202
    job = response.json()
    assert job["status"] in ("queued", "running")
    assert fleet.wait_done(job["id"])["status"] == "succeeded"


def test_many_waiting_clients_do_not_block_others(fleet):
    """300 held requests must not stop others from submitting and polling."""
    held = 300
    body = {"prompt": "Hold", "max_new_tokens": 16}
    with ThreadPoolExecutor(max_workers=held) as pool:
        waiters = [
            pool.submit(
                requests.post,
                fleet.url("/v1/jobs"),
                json=body,
                headers={"Prefer": "wait=60"},
                timeout=90,
            )
            for _ in range(held)
        ]
        # While they are held (the worker needs many seconds for 300 jobs), a new submit
        # and a poll each answer promptly.
        probe = requests.post(
            fleet.url("/v1/jobs"), json={"prompt": "probe", "max_new_tokens": 1}, timeout=5
        )
        assert probe.status_code == 202
        assert (
            requests.get(fleet.url(f"/v1/jobs/{probe.json()['id']}"), timeout=5).status_code == 200
        )
        assert requests.get(fleet.url("/healthz"), timeout=5).status_code == 200
        assert sum(not w.done() for w in waiters) > held // 2, "the waiters should still be held"
        results = [w.result() for w in waiters]
    assert all(r.status_code in (200, 202) for r in results)
    jobs = [r.json() for r in results]
    for job in jobs:
        if job["status"] != "succeeded":
            job.update(fleet.wait_done(job["id"], timeout_s=300))
    assert all(j["status"] == "succeeded" for j in jobs)
    assert max(j["metrics"]["batch_size"] for j in jobs) > 1  # they were micro-batched


def test_health_readiness_models_and_openapi(fleet):
    assert fleet.http.get(fleet.url("/healthz"), timeout=5).json() == {"status": "ok"}
    ready = fleet.http.get(fleet.url("/readyz"), timeout=5)
    assert ready.status_code == 200 and ready.json()["workers"] == {"demo/qwen3.5-tiny-awq": 1}
    models = fleet.http.get(fleet.url("/v1/models"), timeout=5).json()
    assert [m["id"] for m in models["data"]] == ["demo/qwen3.5-tiny-awq"]
    assert models["data"][0]["ready_workers"] == 1
    spec = fleet.http.get(fleet.url("/openapi.json"), timeout=5).json()
    assert spec["openapi"].startswith("3.")
    assert {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/models"} <= set(spec["paths"])
    create = spec["paths"]["/v1/jobs"]["post"]
    assert {"200", "202", "413", "415", "422"} <= set(create["responses"])
    schema = spec["components"]["schemas"]["JobCreate"]
    assert {
        "prompt",
        "messages",
        "max_new_tokens",
        "temperature",
        "top_p",
        "stop",
        "seed",
        "metadata",
    } <= set(schema["properties"])
    assert schema["additionalProperties"] is False
