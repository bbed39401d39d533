"""Gateway behaviour that needs its own settings: result TTL, Redis outages, settings."""

from __future__ import annotations

import time
import uuid

import pytest
from pydantic import ValidationError

from fleet.processes import free_port
from gateway import create_app
from shared.job_consumer import JobConsumer
from shared.protocol import Output, Usage
from shared.records import terminal_fields
from shared.settings import DEMO_MODEL_ID, Settings
from shared.states import JobStatus


def _client(**settings):
    app = create_app(Settings(key_prefix=f"t{uuid.uuid4().hex[:8]}", **settings))
    return app, app.test_client()


def test_finished_jobs_expire_after_result_ttl(redis_url):
    app, client = _client(redis_url=redis_url, result_ttl_s=1)
    job = client.post("/v1/jobs", json={"prompt": "x"}).get_json()
    state = app.extensions["fleet"]
    model = state.settings.served_model
    queue = JobConsumer(state.jobs.redis, state.keys, state.settings.result_ttl_s)
    [entry] = queue.read(model, "w", 10, None)
    queue.start(model, [entry], "w")
    fields = terminal_fields(
        status=JobStatus.SUCCEEDED,
        output=Output(
            text="t", finish_reason="length", usage=Usage(prompt_tokens=1, completion_tokens=1)
        ),
        inference_seconds=0.0,
        batch_size=1,
    )
    queue.finish(model, [(entry, fields)])
    assert client.get(f"/v1/jobs/{job['id']}").get_json()["status"] == "succeeded"
    time.sleep(2.2)
    gone = client.get(f"/v1/jobs/{job['id']}")
    assert gone.status_code == 404 and gone.get_json()["error"]["code"] == "job_not_found"


def test_unfinished_jobs_do_not_expire(redis_url):
    app, client = _client(redis_url=redis_url, result_ttl_s=1)
    job = client.post("/v1/jobs", json={"prompt": "x"}).get_json()
    state = app.extensions["fleet"]
    assert state.jobs.redis.ttl(state.keys.job(state.settings.served_model, job["id"])) == -1


def test_redis_down_is_503_not_500():
    _, client = _client(redis_url=f"redis://127.0.0.1:{free_port()}/0")
    for response in (
        client.post("/v1/jobs", json={"prompt": "x"}),
        client.get("/v1/jobs/job_" + "a" * 32),
    ):
        assert response.status_code == 503
        assert response.get_json()["error"]["code"] == "queue_unavailable"
        assert response.headers["Retry-After"]
    ready = client.get("/readyz")
    assert ready.status_code == 503 and "redis" in ready.get_json()["reason"]
    assert client.get("/healthz").status_code == 200
    chat = {"model": DEMO_MODEL_ID, "messages": [{"role": "user", "content": "x"}]}
    openai = client.post("/openai/v1/chat/completions", json=chat)  # in OpenAI's shape
    assert openai.status_code == 503 and openai.headers["Retry-After"]
    assert openai.get_json()["error"]["type"] == "server_error"


def test_max_new_tokens_default_is_capped_by_the_limit(redis_url):
    _, client = _client(redis_url=redis_url, max_new_tokens_limit=50)
    job = client.post("/v1/jobs", json={"prompt": "x"}).get_json()
    assert job["input"]["max_new_tokens"] == 50
    too_many = client.post("/v1/jobs", json={"prompt": "x", "max_new_tokens": 51})
    assert too_many.status_code == 422


def test_settings_come_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DATA_DIR", str(tmp_path))  # no embedded Redis password there
    monkeypatch.setenv("GATEWAY_PORT", "8123")
    monkeypatch.setenv("MAX_BATCH_SIZE", "4")
    monkeypatch.setenv("MODEL", "")
    settings = Settings()
    assert (settings.gateway_port, settings.max_batch_size, settings.model) == (8123, 4, None)
    assert settings.served_model == "demo/qwen3.5-tiny-awq"
    assert settings.effective_redis_url == "redis://127.0.0.1:6380/0"
    monkeypatch.setenv("MAX_BATCH_SIZE", "0")
    with pytest.raises(ValidationError, match="max_batch_size"):
        Settings()


def test_a_stream_that_cannot_be_read_says_where_to_resume(redis_url):
    app, client = _client(redis_url=redis_url, gateway_max_streams=1)
    submitted = client.post("/v1/jobs", json={"prompt": "x", "stream": True})
    job_id = submitted.headers["Fleet-Job-Id"]
    submitted.close()
    pool = app.extensions["fleet"].stream_reader.connection_pool
    held = pool.get_connection()  # the one stream this process may hold is taken
    try:
        response = client.get(f"/v1/jobs/{job_id}/events")
        last = response.get_data(as_text=True).strip().split("\n\n")[-1]
    finally:
        pool.release(held)
    assert last.startswith("event: error")
    assert '"code":"stream_unavailable"' in last and "Last-Event-ID: 0" in last
