"""The OpenAI-compatible protocol layer, unit by unit and against the official SDK: the
bodies ``openai`` sends must parse, become valid native jobs, and what we answer must
parse with the SDK's own types."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import openai
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import ValidationError

from gateway import openai_protocol as op
from gateway.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidRequest,
    Unsupported,
)
from shared.protocol import Job, JobCreate, Output, Usage, new_job_id

try:  # openai >= 3 is built on httpx2; older releases on httpx
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx  # type: ignore[no-redef]

LIMIT = 512
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "once upon a time"}


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({**CHAT, **fields})


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({**COMPLETION, **fields})


def native(req: ChatCompletionRequest | CompletionRequest, limit: int = LIMIT) -> list[dict]:
    """The job bodies, each checked the way POST /v1/jobs checks it."""
    bodies = op.to_job_inputs(req, limit)
    for body in bodies:
        JobCreate.model_validate(body, context={"max_new_tokens_limit": limit})
        assert json.loads(json.dumps(body)) == body
    return bodies


def error_of(model: type, body: Any) -> dict:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    return op.from_validation_error(caught.value)["error"]


def unsupported(model: type, body: Any) -> Unsupported:
    with pytest.raises(Unsupported) as caught:
        model.model_validate(body)
    return caught.value


def job(
    text: str = "out",
    finish: str = "stop",
    prompt_tokens: int = 7,
    completion_tokens: int = 3,
    status: str = "succeeded",
    **input_: Any,
) -> Job:
    output = None
    if status == "succeeded":
        output = Output(
            text=text,
            finish_reason=finish,
            usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens),
        )
    return Job(
        id=new_job_id(),
        status=status,
        model="m",
        created_at="2025-01-01T00:00:00Z",
        input=input_ or {"prompt": "p"},
        output=output,
    )


# --- requests: defaults and conversion ---------------------------------------------------


def test_chat_defaults_follow_openai_not_the_native_api():
    req = chat()
    assert (req.temperature, req.top_p, req.n, req.stream) == (1.0, 1.0, 1, False)
    [body] = native(req)
    assert body == {
        "cache": True,
        "messages": [{"role": "user", "content": "hi"}],
        "max_new_tokens": LIMIT,
        "temperature": 1.0,
        "top_p": 1.0,
        "stop": [],
        "seed": None,
        "model": "m",
        "metadata": {},
    }


def test_completions_default_to_16_tokens_capped_by_the_limit():
    assert native(completion())[0]["max_new_tokens"] == 16
    assert native(completion(), limit=8)[0]["max_new_tokens"] == 8


def test_null_means_the_default():
    nulls = dict.fromkeys(
        ["temperature", "top_p", "n", "stop", "seed", "user", "stream", "max_tokens"]
    )
    req = chat(**nulls, max_completion_tokens=None, stream_options=None, tools=None)
    assert native(req) == native(chat())
    assert native(completion(**nulls, logprobs=None, suffix=None)) == native(completion())


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"max_tokens": 10}, 10),
        ({"max_completion_tokens": 12}, 12),
        ({"max_tokens": 10, "max_completion_tokens": 12}, 12),
        ({"max_tokens": LIMIT}, LIMIT),
    ],
)
def test_chat_max_completion_tokens_wins(fields, expected):
    assert native(chat(**fields))[0]["max_new_tokens"] == expected


@pytest.mark.parametrize(
    ("make", "fields", "param"),
    [
        (chat, {"max_tokens": LIMIT + 1}, "max_tokens"),
        (chat, {"max_completion_tokens": LIMIT + 1, "max_tokens": 1}, "max_completion_tokens"),
        (chat, {"max_tokens": LIMIT + 1, "max_completion_tokens": 5}, None),
        (completion, {"max_tokens": LIMIT + 1}, "max_tokens"),
    ],
)
def test_max_tokens_over_the_limit_names_the_field_given(make, fields, param):
    req = make(**fields)
    if param is None:  # the winning field is within the limit
        native(req)
        return
    with pytest.raises(InvalidRequest) as caught:
        op.to_job_inputs(req, LIMIT)
    error = caught.value.error()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert str(LIMIT) in error["message"]
    assert caught.value.status == 400


def test_sampling_fields_pass_through():
    req = chat(temperature=0.7, top_p=0.9, stop=["\n", "END"], seed=42, max_tokens=20)
    [body] = native(req)
    assert (body["temperature"], body["top_p"], body["stop"], body["seed"]) == (
        0.7,
        0.9,
        ["\n", "END"],
        42,
    )
    assert native(chat(stop="###"))[0]["stop"] == ["###"]
    assert native(chat(temperature=0, top_p=1))[0]["temperature"] == 0


def test_messages_become_native_messages():
    messages = [
        {"role": "developer", "content": "be brief"},
        {
            "role": "system",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        },
        {"role": "user", "content": "hi", "name": None},
        {"role": "assistant", "content": "hello", "tool_calls": [], "refusal": None},
        {"role": "user", "content": [{"type": "text", "text": "again"}]},
    ]
    [body] = native(chat(messages=messages))
    assert body["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "system", "content": "a\nb"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "again"},
    ]


def test_user_goes_to_metadata_truncated_to_the_native_limit():
    assert native(chat(user="alice"))[0]["metadata"] == {"user": "alice"}
    assert native(chat(user="u" * 600))[0]["metadata"] == {"user": "u" * 512}
    assert native(chat(user=""))[0]["metadata"] == {}


def test_parsing_does_not_change_the_callers_body():
    body = {**CHAT, "tools": None, "stream": True, "stream_options": {"include_usage": True}}
    snapshot = json.dumps(body)
    ChatCompletionRequest.model_validate(body)
    assert json.dumps(body) == snapshot


# --- n and seeds -------------------------------------------------------------------------


def test_chat_n_copies_with_consecutive_seeds():
    bodies = native(chat(n=3, seed=10, temperature=0.8))
    assert [b["seed"] for b in bodies] == [10, 11, 12]
    assert all(b["messages"] == bodies[0]["messages"] for b in bodies)
    bodies[0]["messages"][0]["content"] = "changed"
    assert bodies[1]["messages"][0]["content"] == "hi"  # no shared structures


def test_seed_plus_i_wraps_within_the_native_range():
    bodies = native(chat(n=3, seed=op.MAX_SEED))
    assert [b["seed"] for b in bodies] == [op.MAX_SEED, 0, 1]


def test_unseeded_sampled_copies_get_distinct_random_seeds():
    seeds = [b["seed"] for b in native(chat(n=16, temperature=0.5))]
    assert None not in seeds
    assert len(set(seeds)) == 16


def test_greedy_or_single_choices_stay_unseeded():
    assert [b["seed"] for b in native(chat(n=4, temperature=0))] == [None] * 4
    assert native(chat(temperature=0.5))[0]["seed"] is None


def test_completions_order_choices_prompt_major():
    bodies = native(completion(prompt=["a", "b", "c"], n=2, seed=5))
    assert [(b["prompt"], b["seed"]) for b in bodies] == [
        ("a", 5),
        ("a", 6),
        ("b", 5),
        ("b", 6),
        ("c", 5),
        ("c", 6),
    ]


def test_choices_per_request_are_bounded():
    assert len(native(completion(prompt=["p"] * 8, n=16))) == op.MAX_CHOICES
    error = error_of(CompletionRequest, {**COMPLETION, "prompt": ["p"] * 9, "n": 16})
    assert error["param"] == "prompt"


# --- validation errors in OpenAI's shape -------------------------------------------------


MISSING, TYPE, VALUE = "missing_required_parameter", "invalid_type", "invalid_value"


def say(**message: Any) -> dict:
    """A body of one message."""
    return {**CHAT, "messages": [message]}


def without(body: dict, key: str) -> dict:
    return {k: v for k, v in body.items() if k != key}


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (without(CHAT, "model"), "model", MISSING),
        (without(CHAT, "messages"), "messages", MISSING),
        ({**CHAT, "model": 5}, "model", TYPE),
        ({**CHAT, "messages": []}, "messages", VALUE),
        ({**CHAT, "messages": "hi"}, "messages", TYPE),
        ({**CHAT, "messages": ["hi"]}, "messages.0", TYPE),
        ({**CHAT, "temperature": 2.5}, "temperature", VALUE),
        ({**CHAT, "temperature": -0.1}, "temperature", VALUE),
        ({**CHAT, "temperature": "1"}, "temperature", TYPE),
        ({**CHAT, "top_p": 0}, "top_p", VALUE),
        ({**CHAT, "top_p": 1.5}, "top_p", VALUE),
        ({**CHAT, "n": 0}, "n", VALUE),
        ({**CHAT, "n": 17}, "n", VALUE),
        ({**CHAT, "n": "2"}, "n", TYPE),
        ({**CHAT, "n": True}, "n", TYPE),
        ({**CHAT, "n": 1.5}, "n", TYPE),
        ({**CHAT, "seed": -1}, "seed", VALUE),
        ({**CHAT, "seed": 2**63}, "seed", VALUE),
        ({**CHAT, "max_tokens": 0}, "max_tokens", VALUE),
        ({**CHAT, "max_completion_tokens": 0}, "max_completion_tokens", VALUE),
        ({**CHAT, "stop": ""}, "stop", VALUE),
        ({**CHAT, "stop": 5}, "stop", TYPE),
        ({**CHAT, "stop": ["a", ""]}, "stop.1", VALUE),
        ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop", VALUE),
        ({**CHAT, "stop": ["x" * 65]}, "stop.0", VALUE),
        ({**CHAT, "stream": "yes"}, "stream", TYPE),
        ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options", VALUE),
        (
            {**CHAT, "stream": True, "stream_options": {"include_usage": 1}},
            "stream_options.include_usage",
            TYPE,
        ),
        (say(role="bot", content="x"), "messages.0.role", VALUE),
        (say(content="x"), "messages.0.role", MISSING),
        (say(role="user"), "messages.0.content", MISSING),
        (say(role="assistant", content=None), "messages.0.content", TYPE),
        (say(role="user", content=5), "messages.0.content", TYPE),
        (
            say(role="user", content=[{"type": "text", "text": 5}]),
            "messages.0.content.0.text",
            TYPE,
        ),
        (say(role="user", content=[{"type": "text"}]), "messages.0.content.0.text", MISSING),
        (say(role="user", content=["hi"]), "messages.0.content.0", TYPE),
    ],
)
def test_chat_validation_errors_name_the_param(body, param, code):
    error = error_of(ChatCompletionRequest, body)
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    assert param in error["message"]


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (without(COMPLETION, "prompt"), "prompt", MISSING),
        ({**COMPLETION, "prompt": ""}, "prompt", VALUE),
        ({**COMPLETION, "prompt": None}, "prompt", TYPE),
        ({**COMPLETION, "prompt": []}, "prompt", VALUE),
        ({**COMPLETION, "prompt": ["a", ""]}, "prompt.1", VALUE),
        ({**COMPLETION, "prompt": {"text": "a"}}, "prompt", TYPE),
        ({**COMPLETION, "max_tokens": -1}, "max_tokens", VALUE),
        ({**COMPLETION, "n": 20}, "n", VALUE),
    ],
)
def test_completion_validation_errors_name_the_param(body, param, code):
    error = error_of(CompletionRequest, body)
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    assert param in error["message"]


def test_a_body_that_is_not_an_object():
    error = error_of(ChatCompletionRequest, ["not", "an", "object"])
    assert error["param"] is None
    assert error["message"]


def test_openai_error_shape():
    assert op.openai_error("nope") == {
        "error": {"message": "nope", "type": "invalid_request_error", "param": None, "code": None}
    }
    assert op.openai_error("down", "server_error", code="queue_unavailable")["error"] == {
        "message": "down",
        "type": "server_error",
        "param": None,
        "code": "queue_unavailable",
    }


# --- unsupported: refused, never ignored -------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 0),
        ("presence_penalty", 0.0),
        ("frequency_penalty", 0),
        ("logit_bias", {}),
        ("logprobs", False),
        ("tool_choice", "none"),
        ("function_call", "none"),
        ("parallel_tool_calls", True),
        ("parallel_tool_calls", False),
        ("response_format", {"type": "text"}),
        ("modalities", ["text"]),
        ("store", False),
        ("metadata", {}),
        ("service_tier", "auto"),
        ("prompt_cache_key", "abc"),
        ("safety_identifier", "hashed-user"),
        ("tools", None),
        ("audio", None),
        ("reasoning_effort", None),
        ("top_logprobs", None),
    ],
)
def test_chat_no_op_values_are_accepted(field, value):
    assert native(chat(**{field: value})) == native(chat())


@pytest.mark.parametrize(
    ("field", "value", "code"),
    [
        ("presence_penalty", 0.5, "unsupported_value"),
        ("presence_penalty", False, "unsupported_value"),
        ("frequency_penalty", -1, "unsupported_value"),
        ("logit_bias", {"50256": -100}, "unsupported_value"),
        ("logprobs", True, "unsupported_value"),
        ("top_logprobs", 2, "unsupported_parameter"),
        ("tools", [], "unsupported_parameter"),
        ("tools", [{"type": "function", "function": {"name": "f"}}], "unsupported_parameter"),
        ("functions", [{"name": "f"}], "unsupported_parameter"),
        ("tool_choice", "auto", "unsupported_value"),
        ("tool_choice", {"type": "function", "function": {"name": "f"}}, "unsupported_value"),
        ("function_call", "auto", "unsupported_value"),
        ("parallel_tool_calls", "yes", "unsupported_value"),
        ("response_format", {"type": "json_object"}, "unsupported_value"),
        ("response_format", {"type": "json_schema", "json_schema": {}}, "unsupported_value"),
        ("modalities", ["text", "audio"], "unsupported_value"),
        ("store", True, "unsupported_value"),
        ("metadata", {"k": "v"}, "unsupported_value"),
        ("service_tier", "flex", "unsupported_value"),
        ("audio", {"voice": "alloy", "format": "wav"}, "unsupported_parameter"),
        ("prediction", {"type": "content", "content": "x"}, "unsupported_parameter"),
        ("reasoning_effort", "low", "unsupported_parameter"),
        ("verbosity", "low", "unsupported_parameter"),
        ("web_search_options", {}, "unsupported_parameter"),
        ("best_of", 2, "unknown_parameter"),  # a Completions parameter
        ("echo", False, "unknown_parameter"),
        ("temprature", 0.5, "unknown_parameter"),
        ("prompt", "x", "unknown_parameter"),
    ],
)
def test_chat_unsupported_values_are_refused(field, value, code):
    exc = unsupported(ChatCompletionRequest, {**CHAT, field: value})
    assert (exc.param, exc.code, exc.status) == (field, code, 400)
    error = exc.error()["error"]
    assert (error["param"], error["code"], error["type"]) == (field, code, "invalid_request_error")
    assert field in error["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 0),
        ("frequency_penalty", 0.0),
        ("logit_bias", {}),
        ("logprobs", None),
        ("echo", False),
        ("best_of", 1),
        ("suffix", ""),
    ],
)
def test_completion_no_op_values_are_accepted(field, value):
    assert native(completion(**{field: value})) == native(completion())


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logprobs": 0}, "logprobs"),
        ({"logprobs": 5}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"best_of": 3}, "best_of"),
        ({"best_of": 1, "n": 2}, "best_of"),
        ({"suffix": "end"}, "suffix"),
        ({"presence_penalty": 1}, "presence_penalty"),
        ({"prompt": [1, 2, 3]}, "prompt"),
        ({"prompt": [[1, 2], [3]]}, "prompt"),
        ({"messages": []}, "messages"),
        ({"max_completion_tokens": 5}, "max_completion_tokens"),
        ({"tools": []}, "tools"),
    ],
)
def test_completion_unsupported_values_are_refused(fields, param):
    assert unsupported(CompletionRequest, {**COMPLETION, **fields}).param == param


def test_best_of_equal_to_n_is_accepted():
    assert len(native(completion(best_of=3, n=3))) == 3


IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
HI = {"type": "text", "text": "hi"}


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "tool", "content": "42", "tool_call_id": "c1"}, "messages.1.role"),
        ({"role": "function", "content": "42", "name": "f"}, "messages.1.role"),
        ({"role": "user", "content": "x", "name": "bob"}, "messages.1.name"),
        ({"role": "user", "content": "x", "cache_control": {}}, "messages.1.cache_control"),
        ({"role": "assistant", "content": None, "tool_calls": [{}]}, "messages.1.tool_calls"),
        ({"role": "assistant", "content": "x", "refusal": "no"}, "messages.1.refusal"),
        ({"role": "assistant", "content": "x", "audio": {"id": "a"}}, "messages.1.audio"),
        ({"role": "user", "content": [IMAGE]}, "messages.1.content.0.type"),
        ({"role": "user", "content": [HI, {"type": "input_audio"}]}, "messages.1.content.1.type"),
        ({"role": "user", "content": [{**HI, "extra": 1}]}, "messages.1.content.0.extra"),
    ],
)
def test_unsupported_message_content_is_refused(message, param):
    body = {**CHAT, "messages": [*CHAT["messages"], message]}
    assert unsupported(ChatCompletionRequest, body).param == param


def test_stream_options():
    req = chat(stream=True, stream_options={"include_usage": True, "include_obfuscation": False})
    assert req.include_usage
    assert not chat(stream=True).include_usage
    assert not chat(stream=True, stream_options={}).include_usage
    exc = unsupported(
        ChatCompletionRequest,
        {**CHAT, "stream": True, "stream_options": {"include_obfuscation": True}},
    )
    assert exc.param == "stream_options.include_obfuscation"
    exc = unsupported(
        CompletionRequest, {**COMPLETION, "stream": True, "stream_options": {"continuous": True}}
    )
    assert exc.param == "stream_options.continuous"


# --- responses ---------------------------------------------------------------------------


def test_chat_completion_counts_the_shared_prompt_once():
    jobs = [
        job("a", "stop", prompt_tokens=9, completion_tokens=2),
        job("b", "length", prompt_tokens=9, completion_tokens=5),
    ]
    body = op.chat_completion("chatcmpl-1", 1700000000, "m", jobs)
    assert body == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "a", "refusal": None},
                "finish_reason": "stop",
                "logprobs": None,
            },
            {
                "index": 1,
                "message": {"role": "assistant", "content": "b", "refusal": None},
                "finish_reason": "length",
                "logprobs": None,
            },
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16},
    }
    parsed = ChatCompletion.model_validate(body)
    assert [c.message.content for c in parsed.choices] == ["a", "b"]
    assert parsed.usage is not None and parsed.usage.total_tokens == 16


def test_completion_counts_each_prompt_once():
    jobs = [
        job("a0", prompt_tokens=4, completion_tokens=1),
        job("a1", prompt_tokens=4, completion_tokens=2),
        job("b0", "length", prompt_tokens=6, completion_tokens=3),
        job("b1", prompt_tokens=6, completion_tokens=4),
    ]
    body = op.completion("cmpl-1", 1700000000, "m", jobs, n=2)
    assert body["object"] == "text_completion"
    assert body["choices"][2] == {
        "index": 2,
        "text": "b0",
        "finish_reason": "length",
        "logprobs": None,
    }
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20}
    parsed = Completion.model_validate(body)
    assert [c.text for c in parsed.choices] == ["a0", "a1", "b0", "b1"]
    assert op.completion("cmpl-2", 1, "m", jobs)["usage"]["prompt_tokens"] == 20  # n=1


def test_total_usage_needs_whole_groups():
    with pytest.raises(ValueError, match="n=2"):
        op.total_usage([job(), job(), job()], n=2)


@pytest.mark.parametrize("status", ["queued", "running", "failed", "canceled", "expired"])
def test_only_succeeded_jobs_make_a_response(status):
    with pytest.raises(ValueError, match=status):
        op.chat_completion("chatcmpl-1", 1, "m", [job(), job(status=status)])
    with pytest.raises(ValueError, match=status):
        op.completion("cmpl-1", 1, "m", [job(status=status)])


def test_completion_ids():
    assert op.new_completion_id(chat=True).startswith("chatcmpl-")
    assert op.new_completion_id(chat=False).startswith("cmpl-")
    assert op.new_completion_id(chat=True) != op.new_completion_id(chat=True)


# --- streaming ---------------------------------------------------------------------------


def test_chat_chunks():
    first = op.chat_chunk("chatcmpl-1", 5, "m", 0, role="assistant", content="")
    middle = op.chat_chunk("chatcmpl-1", 5, "m", 1, content="Hel")
    last = op.chat_chunk("chatcmpl-1", 5, "m", 1, finish_reason="length")
    assert first == {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 5,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "finish_reason": None,
                "logprobs": None,
            }
        ],
    }
    assert middle["choices"][0]["delta"] == {"content": "Hel"}
    assert last["choices"][0]["delta"] == {}
    assert last["choices"][0]["finish_reason"] == "length"
    for chunk in (first, middle, last):
        ChatCompletionChunk.model_validate(chunk)


def test_completion_chunks():
    chunk = op.completion_chunk("cmpl-1", 5, "m", 3, "lo")
    assert chunk == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 5,
        "model": "m",
        "choices": [{"index": 3, "text": "lo", "finish_reason": None, "logprobs": None}],
    }
    end = op.completion_chunk("cmpl-1", 5, "m", 3, finish_reason="stop")
    assert end["choices"][0]["text"] == ""
    Completion.model_validate(end)
    # OpenAI streams finish_reason null until a choice ends, but the SDK's Completion type
    # (shared by both modes) does not allow null (openai/openai-openapi#100): check the
    # rest of the chunk against it.
    Completion.model_validate(
        {**chunk, "choices": [{**chunk["choices"][0], "finish_reason": "stop"}]}
    )


@pytest.mark.parametrize("chat", [True, False])
def test_usage_chunk(chat):
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    chunk = op.usage_chunk("x-1", 5, "m", usage, chat=chat)
    assert chunk["choices"] == []
    assert chunk["usage"] == usage
    parsed = (ChatCompletionChunk if chat else Completion).model_validate(chunk)
    assert parsed.usage is not None and parsed.usage.total_tokens == 7


def test_sse():
    assert op.sse({"a": [1, "é"]}) == 'data: {"a":[1,"é"]}\n\n'
    assert op.sse("[DONE]") == "data: [DONE]\n\n"
    with pytest.raises(ValueError):
        op.sse({"x": float("nan")})
    with pytest.raises(ValueError):
        op.sse("hello")


def test_models_list():
    body = op.models_list(["a", "b"], 1700000000)
    assert body == {
        "object": "list",
        "data": [
            {"id": "a", "object": "model", "created": 1700000000, "owned_by": "fleet"},
            {"id": "b", "object": "model", "created": 1700000000, "owned_by": "fleet"},
        ],
    }
    assert Model.model_validate(body["data"][0]).id == "a"


# --- against the official SDK ------------------------------------------------------------


class FakeServer:
    """Answers the SDK from a MockTransport: records each body, replies with ``reply``."""

    def __init__(self, reply: Callable[[dict], httpx.Response]) -> None:
        self.reply = reply
        self.requests: list[tuple[str, dict]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        self.requests.append((request.url.path, body))
        return self.reply(body)

    def client(self, strict: bool = True) -> openai.OpenAI:
        """``strict``: the SDK validates every response against its types."""
        return openai.OpenAI(
            api_key="sk-test",
            base_url="http://fleet.test/openai/v1",
            max_retries=0,
            http_client=httpx.Client(transport=httpx.MockTransport(self)),
            _strict_response_validation=strict,
        )


def sse_response(events: list[dict]) -> httpx.Response:
    text = "".join(op.sse(e) for e in events) + op.sse("[DONE]")
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=text.encode())


def fake_chat_reply(body: dict) -> httpx.Response:
    """What the routes will do: parse, convert, answer from (here, fake) finished jobs."""
    req = ChatCompletionRequest.model_validate(body)
    bodies = native(req)
    jobs = [job(f"choice {i}", **b) for i, b in enumerate(bodies)]
    if not req.stream:
        return httpx.Response(200, json=op.chat_completion("chatcmpl-1", 1, req.model, jobs))
    events = []
    for i, done in enumerate(jobs):
        events.append(op.chat_chunk("chatcmpl-1", 1, req.model, i, role="assistant", content=""))
        events.append(op.chat_chunk("chatcmpl-1", 1, req.model, i, content=done.output.text))
        events.append(op.chat_chunk("chatcmpl-1", 1, req.model, i, finish_reason="stop"))
    if req.include_usage:
        usage = op.total_usage(jobs, n=req.n)
        events.append(op.usage_chunk("chatcmpl-1", 1, req.model, usage, chat=True))
    return sse_response(events)


def fake_completion_reply(body: dict) -> httpx.Response:
    req = CompletionRequest.model_validate(body)
    jobs = [job(f"choice {i}", **b) for i, b in enumerate(native(req))]
    if not req.stream:
        return httpx.Response(200, json=op.completion("cmpl-1", 1, req.model, jobs, n=req.n))
    events = [
        op.completion_chunk("cmpl-1", 1, req.model, i, j.output.text) for i, j in enumerate(jobs)
    ]
    events += [
        op.completion_chunk("cmpl-1", 1, req.model, i, finish_reason="stop")
        for i in range(len(jobs))
    ]
    if req.include_usage:
        usage = op.total_usage(jobs, n=req.n)
        events.append(op.usage_chunk("cmpl-1", 1, req.model, usage, chat=False))
    return sse_response(events)


SDK_MESSAGES = [
    {"role": "developer", "content": "be brief"},
    {"role": "system", "content": [{"type": "text", "text": "really"}]},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": [{"type": "text", "text": "again"}]},
]


def test_sdk_chat_request_and_response():
    server = FakeServer(fake_chat_reply)
    result = server.client().chat.completions.create(
        model="m",
        messages=SDK_MESSAGES,
        n=2,
        seed=7,
        stop=["\n\n", "END"],
        temperature=0.3,
        top_p=0.9,
        max_completion_tokens=64,
        max_tokens=32,
        user="alice",
        presence_penalty=0,
        frequency_penalty=0,
        logprobs=False,
        tool_choice="none",
        response_format={"type": "text"},
        store=False,
    )
    [(path, body)] = server.requests
    assert path == "/openai/v1/chat/completions"
    bodies = native(ChatCompletionRequest.model_validate(body))
    assert [(b["seed"], b["max_new_tokens"]) for b in bodies] == [(7, 64), (8, 64)]
    assert bodies[0]["stop"] == ["\n\n", "END"]
    assert bodies[0]["metadata"] == {"user": "alice"}
    assert bodies[0]["messages"][0] == {"role": "system", "content": "be brief"}
    assert [c.message.content for c in result.choices] == ["choice 0", "choice 1"]
    assert result.usage is not None and result.usage.prompt_tokens == 7


def test_sdk_chat_stream_with_usage():
    server = FakeServer(fake_chat_reply)
    stream = server.client().chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        n=2,
        stop="\n",
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    [(_, body)] = server.requests
    assert body["stream"] is True
    req = ChatCompletionRequest.model_validate(body)
    assert req.include_usage and req.n == 2
    text: dict[int, str] = {}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            text[choice.index] = text.get(choice.index, "") + (choice.delta.content or "")
    assert text == {0: "choice 0", 1: "choice 1"}
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


def test_sdk_completion_request_and_response():
    server = FakeServer(fake_completion_reply)
    result = server.client().completions.create(
        model="m",
        prompt=["a", "b"],
        n=2,
        seed=3,
        stop=["x", "y"],
        max_tokens=10,
        temperature=0,
        echo=False,
        best_of=2,
        logit_bias={},
        user="bob",
    )
    [(path, body)] = server.requests
    assert path == "/openai/v1/completions"
    bodies = native(CompletionRequest.model_validate(body))
    assert [(b["prompt"], b["seed"]) for b in bodies] == [("a", 3), ("a", 4), ("b", 3), ("b", 4)]
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert result.usage is not None and result.usage.prompt_tokens == 14


def test_sdk_completion_stream():
    server = FakeServer(fake_completion_reply)
    # Not strict: the SDK's Completion type refuses the null finish_reason OpenAI streams.
    stream = server.client(strict=False).completions.create(
        model="m", prompt="once", stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    req = CompletionRequest.model_validate(server.requests[0][1])
    assert req.stream and req.include_usage
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "choice 0"
    assert chunks[-1].usage is not None


def test_sdk_sees_our_errors_as_its_own():
    def refuse(body: dict) -> httpx.Response:
        try:
            ChatCompletionRequest.model_validate(body)
        except InvalidRequest as exc:
            return httpx.Response(exc.status, json=exc.error())
        except ValidationError as exc:
            return httpx.Response(400, json=op.from_validation_error(exc))
        raise AssertionError("expected an error")

    client = FakeServer(refuse).client()
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=SDK_MESSAGES, tools=tools)
    assert (caught.value.param, caught.value.code) == ("tools", "unsupported_parameter")
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=SDK_MESSAGES, temperature=3)
    assert (caught.value.param, caught.value.code) == ("temperature", "invalid_value")


def test_sdk_lists_models():
    server = FakeServer(lambda _: httpx.Response(200, json=op.models_list(["m"], 1)))
    [model] = list(server.client().models.list())
    assert (model.id, model.owned_by) == ("m", "fleet")
