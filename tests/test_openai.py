"""The OpenAI-compatible surface, driven by the official ``openai`` SDK against a running fleet
(gateway over HTTP, a worker with the demo model, Redis)."""

from __future__ import annotations

import time
import uuid

import openai
import pytest
import requests

from fleet import commands
from fleet.processes import Process, free_port, wait_until
from tests.conftest import fleet_env


def client_for(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/openai/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def client(fleet) -> openai.OpenAI:
    return client_for(fleet.base_url)


@pytest.fixture(scope="module")
def model(client) -> str:
    [only] = client.models.list().data
    return only.id


CHAT = [{"role": "user", "content": "Tell me a story"}]


def test_chat_streamed_deltas_join_to_the_same_text_as_not_streamed(client, model):
    whole = client.chat.completions.create(model=model, messages=CHAT, max_tokens=24,
                                           temperature=0)  # fmt: skip
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    [choice] = whole.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 24
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 24
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=24,
                                                 temperature=0, stream=True))  # fmt: skip
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == choice.message.content
    assert len([c for c in chunks if c.choices[0].delta.content]) >= 2, "streamed in pieces"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completions_with_a_list_of_prompts_streamed_and_not(client, model):
    prompts = ["Once upon", "In a land"]
    whole = client.completions.create(model=model, prompt=prompts, max_tokens=12,
                                      temperature=0)  # fmt: skip
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert [c.index for c in whole.choices] == [0, 1]
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(model=model, prompt=prompts, max_tokens=12,
                                           temperature=0, stream=True):  # fmt: skip
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == {c.index: c.text for c in whole.choices}


def test_n_choices_run_with_distinct_seeds(client, model):
    whole = client.chat.completions.create(model=model, messages=CHAT, max_tokens=16,
                                           temperature=1.0, seed=7, n=2)  # fmt: skip
    assert [c.index for c in whole.choices] == [0, 1]
    first, second = (c.message.content for c in whole.choices)
    assert first != second
    again = client.chat.completions.create(model=model, messages=CHAT, max_tokens=16,
                                           temperature=1.0, seed=7, n=2)  # fmt: skip
    assert [c.message.content for c in again.choices] == [first, second]  # seeded: the same


def test_stop_strings_and_usage_in_the_stream(client, model):
    plain = client.completions.create(model=model, prompt="Stop me", max_tokens=32, temperature=0)
    text = plain.choices[0].text
    stop = text[4:6]
    chunks = list(client.completions.create(
        model=model, prompt="Stop me", max_tokens=32, temperature=0, stop=[stop], stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    streamed = "".join(c.text for chunk in chunks for c in chunk.choices)
    assert streamed == text[: text.find(stop)]
    finishes = [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert finishes == ["stop"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens == plain.usage.prompt_tokens
    assert 0 < usage.completion_tokens <= 32


def test_unsupported_and_bad_parameters_are_bad_requests(client, model):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model, messages=CHAT, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {}}}])  # fmt: skip
    assert exc.value.param == "tools" and exc.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model, messages=CHAT, max_tokens=10**6)
    assert exc.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=CHAT, logprobs=True)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=CHAT)


def test_an_oversized_body_is_a_413_in_openais_shape(fleet, model):
    """Found by tests/test_fuzz.py: werkzeug's 413 was told in the native shape here."""
    big = [{"role": "user", "content": "a" * 600_000}] * 2
    response = requests.post(
        fleet.url("/openai/v1/chat/completions"),
        json={"model": model, "messages": big},
        timeout=30,
    )
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    assert "MAX_REQUEST_BYTES" in error["message"]


def test_a_full_queue_is_a_rate_limit_error_with_retry_after(redis_url, tmp_path):
    """A gateway with no worker and MAX_QUEUE_DEPTH 1: the second request is refused."""
    port = free_port()
    env = fleet_env(redis_url, key_prefix=f"oai-{uuid.uuid4().hex[:6]}", gateway_port=port,
                    max_queue_depth=1, gateway_processes=1)  # fmt: skip
    gateway = Process("gateway", commands.gateway(), env, tmp_path / "gateway.log")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _up(base), 60, "gateway did not start", gateway)
        client = client_for(base)
        model = client.models.list().data[0].id
        queued = requests.post(base + "/v1/jobs", json={"prompt": "x"}, timeout=10)
        assert queued.status_code == 202
        with pytest.raises(openai.RateLimitError) as exc:
            client.completions.create(model=model, prompt="y", max_tokens=2)
        assert int(exc.value.response.headers["Retry-After"]) >= 1
        assert exc.value.body["type"] == "rate_limit_error"
    finally:
        gateway.stop()


def _up(base: str) -> bool:
    try:
        return requests.get(base + "/healthz", timeout=2).status_code == 200
    except requests.ConnectionError:
        return False


def test_a_streaming_client_that_goes_away_cancels_its_job(model, fleet):
    client = client_for(fleet.base_url)  # its own connection, closed below
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=CHAT, max_tokens=500, temperature=0, stream=True
    )
    job_id = raw.headers["Fleet-Job-Id"]
    stream = raw.parse()
    next(iter(stream))
    stream.close()
    client.close()
    wait_until(lambda: fleet.get(job_id)["status"] == "canceled", 30, "job was not canceled")
    assert fleet.get(job_id)["output"] is None


def test_a_waiting_client_that_gives_up_cancels_its_job(fleet, model):
    user = f"gives-up-{uuid.uuid4().hex[:8]}"
    body = {"model": model, "prompt": "Long", "max_tokens": 500, "temperature": 0, "user": user}
    with pytest.raises(requests.Timeout):
        requests.post(fleet.url("/openai/v1/completions"), json=body, timeout=1.5)
    job = _job_of_user(fleet, user)
    deadline = time.monotonic() + 30
    while fleet.get(job)["status"] != "canceled" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert fleet.get(job)["status"] == "canceled"


def _job_of_user(fleet, user: str) -> str:
    for key in fleet.redis.scan_iter(f"{fleet.prefix}:*:job:*", count=1000):
        if user in (fleet.redis.hget(key, "metadata") or ""):
            return fleet.redis.hget(key, "id")
    raise AssertionError(f"no job of user {user}")
