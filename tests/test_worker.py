"""The Celery worker process: responsive while generating, describes itself, acks its work."""

from __future__ import annotations

import time

from celery import Celery

from shared.keys import JOBS_GROUP as CONSUMER_GROUP
from shared.keys import Keys


def _broker_url(fleet) -> str:
    kwargs = fleet.redis.connection_pool.connection_kwargs
    return f"redis://{kwargs['host']}:{kwargs['port']}/{kwargs.get('db', 0)}"


def test_worker_answers_control_while_a_batch_runs(fleet):
    app = Celery(broker=_broker_url(fleet))
    job = fleet.submit({"prompt": "Busy", "max_new_tokens": 300}).json()
    while fleet.get(job["id"])["status"] != "running":
        time.sleep(0.02)
    replies = []
    for _ in range(3):  # several round trips, all while the batch generates
        started = time.monotonic()
        reply = app.control.ping(destination=[fleet.worker], timeout=3)
        replies.append((reply, time.monotonic() - started))
    stats = app.control.inspect(destination=[fleet.worker], timeout=5).stats()
    still_running = fleet.get(job["id"])["status"] == "running"
    assert still_running, "the batch should still be generating while we talked to the worker"
    assert all(reply == [{fleet.worker: {"ok": "pong"}}] for reply, _ in replies), replies
    info = stats[fleet.worker]["fleet"]
    assert info["state"] == "busy"
    assert info["model"] == "demo/qwen3.5-tiny-awq"
    assert info["device"] == "cpu"
    assert info["quantization"].startswith("awq 4-bit")
    assert fleet.wait_done(job["id"])["status"] == "succeeded"


def test_stats_count_work_and_stream_is_left_clean(fleet):
    app = Celery(broker=_broker_url(fleet))
    before = app.control.inspect(destination=[fleet.worker], timeout=5).stats()[fleet.worker][
        "fleet"
    ]
    fleet.run({"prompt": "Count me", "max_new_tokens": 7})
    after = app.control.inspect(destination=[fleet.worker], timeout=5).stats()[fleet.worker][
        "fleet"
    ]
    assert after["batches"] > before["batches"]
    assert after["generated_tokens"] >= before["generated_tokens"] + 1
    assert after["jobs_succeeded"] > before["jobs_succeeded"]
    stream = Keys(fleet.prefix).stream("demo/qwen3.5-tiny-awq")
    deadline = time.monotonic() + 30
    while fleet.redis.xpending(stream, CONSUMER_GROUP)["pending"] and time.monotonic() < deadline:
        time.sleep(0.1)
    [group] = fleet.redis.xinfo_groups(stream)
    assert group["name"] == CONSUMER_GROUP and group["pending"] == 0
    assert fleet.redis.xlen(stream) == group["lag"]  # only unread entries remain


def test_inspect_fleet_model_describes_the_loaded_model(fleet):
    app = Celery(broker=_broker_url(fleet))
    reply = app.control.broadcast("fleet_model", destination=[fleet.worker], reply=True, timeout=5)
    [answer] = reply
    model = answer[fleet.worker]
    assert model["model"] == "demo/qwen3.5-tiny-awq"
    assert model["architecture"] == "Qwen3_5ForCausalLM"
    assert model["quantization"].startswith("awq 4-bit")
    assert model["device"] == "cpu" and model["parameters"] > 0
