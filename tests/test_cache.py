"""The result cache and in-flight coalescing on a real fleet: gateway over HTTP, a Celery
worker with the demo model, Redis. The worker's own counters prove what it computed."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from fleet import commands
from fleet.processes import Process, wait_until
from tests.conftest import Fleet, fleet_env, start_fleet

CACHE_TTL_S = 5


@pytest.fixture(scope="module")
def cached(redis_url, demo_model_path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("cache-logs")
    running, worker, gateway = start_fleet(
        redis_url, logs, "cache", cache_enabled=1, cache_ttl_s=CACHE_TTL_S
    )
    running.worker_process = worker
    yield running
    gateway.stop()
    running.worker_process.stop()  # a test may have replaced it


def greedy(**fields) -> dict:
    """A cacheable request no other test asks."""
    return {"prompt": f"cache test {uuid.uuid4().hex}", "max_new_tokens": 12} | fields


def submit(fleet: Fleet, body: dict, **headers) -> requests.Response:
    response = fleet.submit(body, wait=60, headers=headers)
    assert response.status_code in (200, 202), response.text
    return response


def worker_counter(fleet: Fleet, name: str) -> float:
    """A worker counter summed over its labels (fleet_worker_jobs_total: every status)."""
    total = 0.0
    for line in requests.get(fleet.worker_metrics_url, timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rpartition(" ")[2])
    return total


def test_a_hit_after_a_miss_is_a_succeeded_job_of_its_own(cached):
    body = greedy(metadata={"run": "first"})
    first = submit(cached, body)
    assert first.headers["Fleet-Cache"] == "miss"
    assert first.json()["status"] == "succeeded" and not first.json()["metrics"]["cache_hit"]
    computed = worker_counter(cached, "fleet_worker_jobs_total")
    second = submit(cached, body | {"metadata": {"run": "second"}})
    assert second.status_code == 200 and second.headers["Fleet-Cache"] == "hit"
    job = second.json()
    assert job["id"] != first.json()["id"] and job["status"] == "succeeded"
    assert job["output"] == first.json()["output"]
    assert job["metadata"] == {"run": "second"}
    assert job["metrics"]["cache_hit"] is True
    assert job["metrics"]["queue_seconds"] == 0 and job["metrics"]["inference_seconds"] == 0
    assert cached.get(job["id"])["metrics"]["cache_hit"]  # as read back later, too
    assert worker_counter(cached, "fleet_worker_jobs_total") == computed  # it never ran


def test_a_sampled_request_without_a_seed_is_never_cached(cached):
    body = greedy(temperature=0.9)
    first = submit(cached, body)
    assert "Fleet-Cache" not in first.headers
    second = submit(cached, body)
    assert "Fleet-Cache" not in second.headers and not second.json()["metrics"]["cache_hit"]
    seeded = greedy(temperature=0.9, seed=7)
    submit(cached, seeded)
    assert submit(cached, seeded).headers["Fleet-Cache"] == "hit"


def test_no_hit_after_a_generation_field_changes_or_when_opted_out(cached):
    body = greedy()
    submit(cached, body)
    for changed in ({"max_new_tokens": 11}, {"stop": ["zz"]}, {"top_p": 0.5}, {"seed": 3}):
        assert submit(cached, body | changed).headers["Fleet-Cache"] == "miss", changed
    opted_out = submit(cached, body | {"cache": False})
    assert "Fleet-Cache" not in opted_out.headers
    assert not opted_out.json()["metrics"]["cache_hit"]
    no_cache = submit(cached, body, **{"Cache-Control": "no-cache"})
    assert "Fleet-Cache" not in no_cache.headers
    assert submit(cached, body).headers["Fleet-Cache"] == "hit"


def test_twenty_identical_concurrent_requests_run_the_model_once(cached):
    body = greedy(max_new_tokens=64)
    generated = worker_counter(cached, "fleet_worker_generated_tokens_total")
    jobs = worker_counter(cached, "fleet_worker_jobs_total")
    with ThreadPoolExecutor(20) as pool:
        responses = list(pool.map(lambda _: submit(cached, body), range(20)))
    done = [cached.wait_done(r.json()["id"]) for r in responses]
    assert {j["status"] for j in done} == {"succeeded"}
    assert len({j["output"]["text"] for j in done}) == 1
    assert len({j["id"] for j in done}) == 20
    outcomes = [r.headers["Fleet-Cache"] for r in responses]
    assert outcomes.count("miss") == 1, outcomes
    assert worker_counter(cached, "fleet_worker_jobs_total") == jobs + 1
    tokens = done[0]["output"]["usage"]["completion_tokens"]
    assert worker_counter(cached, "fleet_worker_generated_tokens_total") == generated + tokens


def test_canceling_the_leader_leaves_its_followers_running_to_success(cached):
    body = greedy(max_new_tokens=200)
    leader = cached.submit(body).json()
    followers = [cached.submit(body).json() for _ in range(2)]
    assert all(f["metrics"]["coalesced"] for f in followers)
    canceled = cached.http.post(cached.url(f"/v1/jobs/{leader['id']}/cancel"), timeout=30)
    assert canceled.status_code == 200 and canceled.json()["status"] == "canceled"
    for follower in followers:
        job = cached.wait_done(follower["id"])
        assert job["status"] == "succeeded", job
        assert job["output"]["usage"]["completion_tokens"] > 0
    assert cached.get(leader["id"])["status"] == "canceled"


def test_a_failed_leader_fails_its_followers_and_is_not_cached(cached):
    body = greedy(prompt="word " * 6000)  # past the demo model's context: prompt_too_long
    responses = [cached.submit(body).json() for _ in range(3)]
    jobs = [cached.wait_done(r["id"]) for r in responses]
    assert [j["status"] for j in jobs] == ["failed"] * 3
    assert {j["error"]["code"] for j in jobs} == {"prompt_too_long"}
    assert submit(cached, body).headers["Fleet-Cache"] == "miss"


def test_a_cached_result_expires_after_cache_ttl(cached):
    body = greedy()
    submit(cached, body)
    assert submit(cached, body).headers["Fleet-Cache"] == "hit"
    time.sleep(CACHE_TTL_S + 0.5)
    assert submit(cached, body).headers["Fleet-Cache"] == "miss"


def test_a_streaming_hit_streams_its_whole_text(cached):
    body = greedy()
    text = submit(cached, body).json()["output"]["text"]
    events = cached.http.post(cached.url("/v1/jobs"), json=body | {"stream": True}, timeout=60)
    assert events.headers["Fleet-Cache"] == "hit"
    assert '"delta":' in events.text and "event: done" in events.text
    data = [json.loads(line[6:]) for line in events.text.splitlines() if line.startswith("data:")]
    assert [d["delta"] for d in data if "delta" in d] == [text]


def test_a_batch_of_100_lines_with_10_distinct_computes_10(cached):
    tag = uuid.uuid4().hex
    lines = [
        {"custom_id": str(i), "prompt": f"batch {tag} {i % 10}", "max_new_tokens": 8}
        for i in range(100)
    ]
    jobs = worker_counter(cached, "fleet_worker_jobs_total")
    created = cached.http.post(cached.url("/v1/batches"), json={"requests": lines}, timeout=60)
    assert created.status_code == 202, created.text
    batch_id = created.json()["id"]

    def completed() -> bool:
        batch = cached.http.get(cached.url(f"/v1/batches/{batch_id}"), timeout=30).json()
        return batch["status"] == "completed"

    wait_until(completed, 120, "the batch did not complete")
    batch = cached.http.get(cached.url(f"/v1/batches/{batch_id}"), timeout=30).json()
    assert batch["request_counts"]["completed"] == 100
    results = cached.http.get(cached.url(f"/v1/batches/{batch_id}/results"), timeout=30)
    texts = {}
    for line in results.text.splitlines():
        result = json.loads(line)
        texts.setdefault(int(result["custom_id"]) % 10, set()).add(result["output"]["text"])
    assert len(texts) == 10 and all(len(t) == 1 for t in texts.values())
    assert worker_counter(cached, "fleet_worker_jobs_total") == jobs + 10


def test_openai_requests_share_the_cache_and_can_opt_out(cached):
    client = openai.OpenAI(base_url=cached.url("/openai/v1"), api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    ask = {"model": model, "messages": [{"role": "user", "content": greedy()["prompt"]}],
           "temperature": 0, "max_tokens": 8}  # fmt: skip
    first = client.chat.completions.with_raw_response.create(**ask)
    assert first.headers["Fleet-Cache"] == "miss"
    again = client.chat.completions.with_raw_response.create(**ask)
    assert again.headers["Fleet-Cache"] == "hit"
    assert again.parse().choices[0].message.content == first.parse().choices[0].message.content
    opted_out = client.chat.completions.with_raw_response.create(**ask, extra_body={"cache": False})
    assert "Fleet-Cache" not in opted_out.headers
    sampled = client.chat.completions.with_raw_response.create(**ask | {"temperature": 1.0})
    assert "Fleet-Cache" not in sampled.headers


def test_cache_counters_in_metrics_and_status(cached, redis_url):
    body = greedy()
    submit(cached, body)
    submit(cached, body)
    metrics = requests.get(cached.url("/metrics"), timeout=10).text
    for name in ("hits", "misses", "coalesced", "evictions", "expired"):
        assert f'fleet_cache_{name}_total{{model="' in metrics, name
    hits = [line for line in metrics.splitlines() if line.startswith("fleet_cache_hits_total{")]
    assert float(hits[0].rpartition(" ")[2]) >= 1
    assert "fleet_cache_bytes{" in metrics
    env = fleet_env(redis_url, key_prefix=cached.prefix)
    status = subprocess.run([commands.PYTHON, "-m", "fleet.status"], env=env, cwd=commands.ROOT,
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert status.returncode == 0, status.stderr
    assert "result cache: hit ratio" in status.stdout


def test_a_new_model_version_never_serves_old_answers(cached, redis_url, tmp_path):
    """The worker is replaced by one serving another checkpoint (MODEL_VERSION names it)."""
    body = greedy()
    submit(cached, body)
    assert submit(cached, body).headers["Fleet-Cache"] == "hit"
    cached.worker_process.stop()
    env = fleet_env(redis_url, key_prefix=cached.prefix, model_version="next-checkpoint",
                    cache_enabled=1)  # fmt: skip
    cached.worker_process = Process(
        "worker", commands.worker("next@localhost"), env, tmp_path / "next.log"
    )
    version_key = f"{cached.prefix}:{{{_model(cached)}}}:model-version"
    wait_until(lambda: cached.redis.get(version_key) == "next-checkpoint", 180,
               "the new worker did not load its model", cached.worker_process)  # fmt: skip
    assert submit(cached, body).headers["Fleet-Cache"] == "miss"
    assert submit(cached, body).headers["Fleet-Cache"] == "hit"  # the new version's own


def _model(fleet: Fleet) -> str:
    return fleet.http.get(fleet.url("/v1/models"), timeout=10).json()["data"][0]["id"]
