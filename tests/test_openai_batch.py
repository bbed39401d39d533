"""OpenAI's Files and Batch API on a real fleet (gateway, worker with the demo model, webhook
worker, Redis, API keys on), driven by the ``openai`` SDK alone: upload, create, retrieve,
list, cancel, download, and the signed webhooks read back with ``client.webhooks.unwrap``."""

from __future__ import annotations

import base64
import json
import os
import time
import uuid
from collections.abc import Iterator

import openai
import pytest
import redis
import requests
from openai.types import Completion
from openai.types.chat import ChatCompletion

from fleet import commands
from fleet.processes import Process, free_port, wait_until
from shared.api_keys import ApiKeyStore
from shared.keys import Keys
from tests.conftest import fleet_env, start_fleet
from tests.webhook_receiver import Receiver

PREFIX = f"oab-{uuid.uuid4().hex[:6]}"
FILES_MAX_BYTES = 262_144
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
EXPIRING = 96  # requests of 64 tokens: far more than a worker generates in a 3 s window
TOO_LONG = "word " * 6000  # past the demo model's context: the job fails prompt_too_long


@pytest.fixture(scope="module")
def secret() -> str:
    return "whsec_" + base64.b64encode(os.urandom(32)).decode()


@pytest.fixture(scope="module")
def ofleet(redis_url, demo_model_path, tmp_path_factory, secret) -> Iterator:
    """A fleet with API keys, webhooks (and their worker), short completion windows and a
    small file size limit, under its own key prefix."""
    logs = tmp_path_factory.mktemp("openai-batch-logs")
    settings = dict(
        require_api_keys=1,
        webhook_secret=secret,
        webhook_allow_private=1,
        webhook_retry_schedule_s="0.5,0.5",
        webhook_metrics_port=free_port(),
        openai_batch_short_windows=1,
        files_max_bytes=FILES_MAX_BYTES,
    )
    running, worker, gateway = start_fleet(redis_url, logs, PREFIX, **settings)
    env = fleet_env(redis_url, key_prefix=PREFIX, **settings)
    hooks = Process("webhooks", commands.webhook_worker(f"webhooks-{PREFIX}@localhost"), env,
                    logs / "webhooks.log")  # fmt: skip
    metrics = f"http://127.0.0.1:{settings['webhook_metrics_port']}/metrics"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    running.keys = ApiKeyStore(client, Keys(PREFIX), 60)
    try:
        wait_until(lambda: _up(metrics), 60, "no webhook worker", hooks)
        yield running
    finally:
        hooks.stop()
        gateway.stop()
        worker.stop()


def _up(url: str) -> bool:
    try:
        return requests.get(url, timeout=1).status_code == 200
    except requests.ConnectionError:
        return False


def client_of(fleet, name: str = "team") -> openai.OpenAI:
    """The SDK with a new API key of its own."""
    secret = fleet.keys.create(name, ("jobs", "batches")).secret
    return openai.OpenAI(base_url=fleet.base_url + "/openai/v1", api_key=secret, max_retries=0)


@pytest.fixture(scope="module")
def client(ofleet) -> openai.OpenAI:
    return client_of(ofleet)


@pytest.fixture(scope="module")
def model(client) -> str:
    [only] = client.models.list().data
    return only.id


def chat_line(custom_id: str, model: str, content: str, **body) -> dict:
    messages = [{"role": "user", "content": content}]
    body = {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0} | body
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}


def upload(client: openai.OpenAI, lines: list[dict | str]) -> str:
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
    return client.files.create(file=("in.jsonl", text.encode()), purpose="batch").id


def wait_for(client: openai.OpenAI, batch_id: str, statuses: set[str], timeout_s: float = 60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} is still {batch.status}: {batch}")


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def events(receiver: Receiver, path: str, client: openai.OpenAI, secret: str, count: int):
    """The events on ``path``, each verified and parsed by the SDK's own unwrap."""
    deadline = time.monotonic() + 30
    while len(receiver.requests(path)) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    return [
        client.webhooks.unwrap(r.body, r.headers, secret=secret) for r in receiver.requests(path)
    ]


# --- batches end to end ------------------------------------------------------------------


def test_a_chat_batch_runs_and_its_output_parses_as_chat_completions(
    client, model, receiver, secret
):
    lines = [chat_line(f"q{i}", model, f"Question number {i}") for i in range(6)]
    lines.append(chat_line("too-long", model, TOO_LONG))
    file_id = upload(client, lines)
    hook = receiver.script("/completed", 200)
    batch = client.batches.create(
        input_file_id=file_id, endpoint=CHAT, completion_window="24h",
        metadata={"run": "nightly"}, extra_body={"webhook": hook},
    )  # fmt: skip
    assert batch.status == "in_progress" and batch.id.startswith("batch_")
    assert batch.input_file_id == file_id and batch.endpoint == CHAT and batch.model == model
    assert batch.request_counts.total == 7 and batch.metadata == {"run": "nightly"}
    assert batch.expires_at - batch.created_at == 86_400

    done = wait_for(client, batch.id, {"completed"})
    assert done.request_counts.completed == 6 and done.request_counts.failed == 1
    assert done.completed_at >= done.created_at and done.output_file_id and done.error_file_id
    outputs = lines_of(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in outputs) == [f"q{i}" for i in range(6)]
    for out in outputs:
        assert out["error"] is None and out["response"]["status_code"] == 200
        assert out["response"]["request_id"].startswith("job_")
        completion = ChatCompletion.model_validate(out["response"]["body"])
        assert completion.object == "chat.completion" and completion.model == model
        assert completion.choices[0].finish_reason == "length"
        assert completion.usage.completion_tokens == 4
    assert done.usage.output_tokens == 24

    # The same (greedy) request through /chat/completions: the same body but its id and time.
    live = client.chat.completions.with_raw_response.create(**lines[0]["body"]).http_response
    [batched] = [o["response"]["body"] for o in outputs if o["custom_id"] == "q0"]
    anew = {"id": "", "created": 0}
    assert live.json() | anew == batched | anew
    # The failed one is in the error file, as /chat/completions answers it.
    [failed] = lines_of(client, done.error_file_id)
    assert failed["custom_id"] == "too-long" and failed["response"]["status_code"] == 400
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**lines[-1]["body"])
    assert failed["response"]["body"]["error"] | {"message": ""} == refused.value.body | {
        "message": ""
    }
    assert failed["response"]["body"]["error"]["code"] == "prompt_too_long"

    output_file = client.files.retrieve(done.output_file_id)
    assert output_file.purpose == "batch_output"
    assert output_file.bytes == len(client.files.content(done.output_file_id).content)
    [event] = events(receiver, "/completed", client, secret, 1)
    assert event.type == "batch.completed" and event.data.id == batch.id


def test_completions_batches_are_listed_newest_first_in_pages(client, model):
    made = []
    for i in range(3):
        line = {"custom_id": "only", "method": "POST", "url": COMPLETIONS,
                "body": {"model": model, "prompt": f"Once upon {i}", "max_tokens": 3}}  # fmt: skip
        batch = client.batches.create(
            input_file_id=upload(client, [line]), endpoint=COMPLETIONS, completion_window="24h"
        )
        made.append(batch.id)
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == made[::-1][:2] and first.has_more
    listed = [b.id for b in client.batches.list(limit=2)]  # the SDK follows `after`
    assert listed[:3] == made[::-1]
    done = wait_for(client, made[0], {"completed"})
    [out] = lines_of(client, done.output_file_id)
    text = Completion.model_validate(out["response"]["body"])
    assert text.object == "text_completion" and text.usage.completion_tokens == 3


def test_a_bad_line_is_named_and_nothing_is_queued(client, model):
    before = [b.id for b in client.batches.list()]
    lines = [chat_line("a", model, "hi"), chat_line("b", model, "hi"),
             chat_line("c", model, "hi") | {"body": {"model": model, "messages": "hi"}},
             "not json"]  # fmt: skip
    with pytest.raises(openai.BadRequestError) as bad:
        client.batches.create(input_file_id=upload(client, lines), endpoint=CHAT,
                              completion_window="24h")  # fmt: skip
    assert bad.value.body["line"] == 3 and bad.value.body["param"] == "body.messages"
    assert "line 3" in bad.value.body["message"]
    for lines, line, code in (
        ([chat_line("a", model, "hi"), "{"], 2, "invalid_json_line"),
        ([chat_line("a", model, "hi"), chat_line("a", model, "hi")], 2, "duplicate_custom_id"),
        ([chat_line("a", model, "hi", n=2)], 1, "unsupported_parameter"),
        ([chat_line("a", "no-such-model", "hi")], 1, "model_not_found"),
    ):
        with pytest.raises(openai.BadRequestError) as bad:
            client.batches.create(input_file_id=upload(client, lines), endpoint=CHAT,
                                  completion_window="24h")  # fmt: skip
        assert (bad.value.body["line"], bad.value.body["code"]) == (line, code)
    with pytest.raises(openai.BadRequestError) as window:
        client.batches.create(input_file_id=upload(client, [chat_line("a", model, "hi")]),
                              endpoint=CHAT, completion_window="48h")  # fmt: skip
    assert window.value.body["param"] == "completion_window"
    assert [b.id for b in client.batches.list()] == before


def test_a_batch_whose_every_request_failed_is_failed(client, model, receiver, secret):
    hook = receiver.script("/failed", 200)
    batch = client.batches.create(
        input_file_id=upload(client, [chat_line("long", model, TOO_LONG)]), endpoint=CHAT,
        completion_window="24h", extra_body={"webhook": hook},
    )  # fmt: skip
    done = wait_for(client, batch.id, {"failed", "completed"})
    assert done.status == "failed" and done.failed_at and done.output_file_id is None
    assert done.errors.data[0].code == "all_requests_failed"
    assert [e["custom_id"] for e in lines_of(client, done.error_file_id)] == ["long"]
    [event] = events(receiver, "/failed", client, secret, 1)
    assert event.type == "batch.failed" and event.data.id == batch.id


def test_the_window_ends_queued_requests_expired_and_keeps_what_finished(
    client, model, receiver, secret
):
    lines = [chat_line(f"e{i}", model, f"Expire {i}", max_tokens=64) for i in range(EXPIRING)]
    hook = receiver.script("/expired", 200)
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint=CHAT, completion_window="3s",
        extra_body={"webhook": hook},
    )  # fmt: skip
    assert batch.expires_at - batch.created_at == 3
    done = wait_for(client, batch.id, {"expired", "completed"}, timeout_s=60)
    assert done.status == "expired" and done.expired_at and done.completed_at is None
    counts = done.request_counts
    assert counts.failed > 0 and counts.completed + counts.failed == EXPIRING
    expired = lines_of(client, done.error_file_id)
    assert len(expired) == counts.failed
    assert {e["error"]["code"] for e in expired} == {"batch_expired"}
    assert all(e["response"] is None for e in expired)
    finished = lines_of(client, done.output_file_id)
    assert len(finished) == counts.completed
    assert {o["custom_id"] for o in finished} | {e["custom_id"] for e in expired} == {
        f"e{i}" for i in range(EXPIRING)
    }
    [event] = events(receiver, "/expired", client, secret, 1)
    assert event.type == "batch.expired" and event.data.id == batch.id


def test_cancel_stops_what_has_not_started(client, model, receiver, secret):
    lines = [chat_line(f"c{i}", model, f"Cancel {i}", max_tokens=48) for i in range(48)]
    hook = receiver.script("/cancelled", 200)
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint=CHAT, completion_window="24h",
        extra_body={"webhook": hook},
    )  # fmt: skip
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = wait_for(client, batch.id, {"cancelled"})
    assert done.cancelled_at and done.request_counts.completed < 48
    unrun = lines_of(client, done.error_file_id)
    assert unrun and {e["error"]["code"] for e in unrun} <= {"batch_cancelled"}
    assert len(unrun) + done.request_counts.completed + done.request_counts.failed == 48
    with pytest.raises(openai.BadRequestError):
        client.batches.cancel(batch.id)
    [event] = events(receiver, "/cancelled", client, secret, 1)
    assert event.type == "batch.cancelled" and event.data.id == batch.id


# --- files and ownership -----------------------------------------------------------------


def test_files_upload_read_list_delete_and_the_size_limit(client):
    content = b'{"custom_id": "x"}\n\xff not utf-8 is kept as sent\n'
    made = client.files.create(file=("mine.jsonl", content), purpose="batch")
    assert made.object == "file" and made.bytes == len(content) and made.filename == "mine.jsonl"
    assert made.purpose == "batch" and made.expires_at - made.created_at == 86_400
    assert client.files.retrieve(made.id).bytes == len(content)
    assert client.files.content(made.id).content == content
    assert made.id in [f.id for f in client.files.list(purpose="batch")]
    assert client.files.delete(made.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(made.id)
    with pytest.raises(openai.APIStatusError) as too_big:
        client.files.create(file=("big.jsonl", b"x" * (FILES_MAX_BYTES + 1)), purpose="batch")
    assert too_big.value.status_code == 413 and too_big.value.body["code"] == "file_too_large"
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("a.jsonl", b"{}"), purpose="fine-tune")


def test_another_key_sees_nothing(ofleet, client, model):
    file_id = upload(client, [chat_line("mine", model, "hi")])
    batch = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    other = client_of(ofleet, "other")
    for call in (
        lambda: other.files.retrieve(file_id),
        lambda: other.files.content(file_id),
        lambda: other.files.delete(file_id),
        lambda: other.batches.retrieve(batch.id),
        lambda: other.batches.cancel(batch.id),
        lambda: other.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h"),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert other.batches.list().data == [] and other.files.list().data == []
    done = wait_for(client, batch.id, {"completed"})
    with pytest.raises(openai.NotFoundError):
        other.files.content(done.output_file_id)
    assert client.files.retrieve(done.output_file_id).bytes > 0


# --- the mapping, without a fleet --------------------------------------------------------


def test_native_records_map_onto_openai_statuses():
    from shared.openai_batches import status_of, webhook_event, window_seconds

    record = {"id": "batch_x", "status": "queued", "total": "3", "completed": "0",
              "failed": "0", "created_at": "100.5", "openai_endpoint": CHAT,
              "openai_completion_window": "24h"}  # fmt: skip
    assert status_of(record) == "in_progress" and webhook_event(record, "evt_1") is None
    ended = record | {"status": "completed", "completed_at": "160.2"}
    assert status_of(ended | {"completed": "2", "failed": "1"}) == "completed"
    assert status_of(ended | {"failed": "3"}) == "failed"
    assert status_of(ended | {"completed": "1", "failed": "2", "expired": "1"}) == "expired"
    assert status_of(record | {"status": "cancelling"}) == "cancelling"
    event = webhook_event(ended | {"failed": "3"}, "evt_1")
    assert event == {"id": "evt_1", "object": "event", "type": "batch.failed",
                     "created_at": 160, "data": {"id": "batch_x"}}  # fmt: skip
    assert webhook_event({k: v for k, v in ended.items() if k != "openai_endpoint"}, "e") is None
    assert window_seconds("24h") == 86_400 and window_seconds("5s") is None
    assert window_seconds("5s", short_windows=True) == 5
    assert window_seconds("7200s", short_windows=True) is None
