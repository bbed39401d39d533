"""The OpenAI-compatible protocol: Chat Completions and (legacy) Completions requests,
their conversion into native jobs, and the response, chunk, error and model-list shapes.

Pure data, no Flask or Redis: the ``/openai/v1`` routes parse a body with
:class:`ChatCompletionRequest` / :class:`CompletionRequest`, submit the bodies of
:func:`to_job_inputs` as native jobs (one per choice, in choice order) and answer with the
builders below. Every failure here is a 400 in OpenAI's error shape: pydantic's
``ValidationError`` through :func:`from_validation_error`, :class:`InvalidRequest` (and its
:class:`Unsupported`) through :meth:`InvalidRequest.error`.

Nothing a client sends is silently dropped: a parameter the fleet cannot honour is accepted
only at a value that changes nothing (``presence_penalty: 0``, ``tool_choice: "none"``,
``null`` for any known parameter); any other value, and any unknown parameter, raises
:class:`Unsupported` naming it.
"""

from __future__ import annotations

import copy
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from shared.protocol import Job, Output, StopString
from shared.states import JobStatus

MAX_N = 16
MAX_CHOICES = 128  # prompts x n of one request: each choice is a job
MAX_SEED = 2**63 - 1  # the native seed's range
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # as OpenAI's legacy Completions
METADATA_VALUE_MAX = 512  # the native metadata value limit


# --- errors ------------------------------------------------------------------------------


def openai_error(
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """OpenAI's error body; the SDK raises it as ``openai.BadRequestError`` etc."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class InvalidRequest(Exception):
    """A request OpenAI's API would answer with a 400 ``invalid_request_error``."""

    status = 400

    def __init__(self, param: str | None, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param, self.message, self.code = param, message, code

    def error(self) -> dict[str, Any]:
        return openai_error(self.message, param=self.param, code=self.code)


class Unsupported(InvalidRequest):
    """A parameter (or a value of one) this fleet cannot honour: refused, never ignored."""

    def __init__(self, param: str, message: str, code: str = "unsupported_parameter") -> None:
        super().__init__(param, message, code)


# Tags of the str-or-list unions (below); they are no part of a parameter's path.
_ONE, _MANY = "(one)", "(many)"


def from_validation_error(exc: ValidationError) -> dict[str, Any]:
    """OpenAI's error body for the first problem, ``param`` a dotted path (``messages.0.role``)."""
    err = exc.errors(include_url=False, include_input=False)[0]
    path = [str(part) for part in err["loc"] if part not in (_ONE, _MANY)]
    param = ".".join(path) or None
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == "missing":
        message = f"Missing required parameter: '{param}'"
    elif param:
        message = f"Invalid '{param}': {message}"
    return openai_error(message, param=param, code=_error_code(err["type"]))


def _error_code(pydantic_type: str) -> str:
    if pydantic_type == "missing":
        return "missing_required_parameter"
    if pydantic_type.endswith("_type"):
        return "invalid_type"
    return "invalid_value"


# --- parameters accepted only where they change nothing ----------------------------------


@dataclass(frozen=True)
class NoOp:
    """A known OpenAI parameter the fleet does not implement, accepted at values that
    change nothing (``null`` always). ``accepts(value, body)``; ``None``: only null."""

    allowed: str  # the accepted values, in words, for the error message
    accepts: Callable[[Any, dict[str, Any]], bool] | None = None


def _equals(*values: Any) -> Callable[[Any, dict[str, Any]], bool]:
    """Equal and of the same type: ``False`` is not ``0`` here."""
    return lambda v, _: any(type(v) is type(x) and v == x for x in values)


def _is(kind: type) -> Callable[[Any, dict[str, Any]], bool]:
    return lambda v, _: isinstance(v, kind)


def _best_of_is_n(value: Any, body: dict[str, Any]) -> bool:
    """``best_of`` equal to ``n`` returns every candidate: no server-side ranking."""
    return type(value) is int and value == (body.get("n") or 1)


NULL_ONLY = NoOp("null")

_PENALTIES = {
    "presence_penalty": NoOp("0", _equals(0, 0.0)),
    "frequency_penalty": NoOp("0", _equals(0, 0.0)),
    "logit_bias": NoOp("{}", _equals({})),
}
CHAT_NO_OPS: dict[str, NoOp] = {
    **_PENALTIES,
    "logprobs": NoOp("false", _equals(False)),
    "top_logprobs": NULL_ONLY,
    "tools": NULL_ONLY,
    "functions": NULL_ONLY,
    "tool_choice": NoOp('"none"', _equals("none")),
    "function_call": NoOp('"none"', _equals("none")),
    "parallel_tool_calls": NoOp("true or false (there are no tools)", _is(bool)),
    "response_format": NoOp('{"type": "text"}', _equals({"type": "text"})),
    "modalities": NoOp('["text"]', _equals(["text"])),
    "store": NoOp("false", _equals(False)),
    "metadata": NoOp("{} (nothing is stored)", _equals({})),
    "service_tier": NoOp('"auto" or "default"', _equals("auto", "default")),
    # A cache-routing hint and an abuse-monitoring id: neither changes the output.
    "prompt_cache_key": NoOp("a string", _is(str)),
    "safety_identifier": NoOp("a string", _is(str)),
    "audio": NULL_ONLY,
    "prediction": NULL_ONLY,
    "reasoning_effort": NULL_ONLY,
    "verbosity": NULL_ONLY,
    "web_search_options": NULL_ONLY,
}
COMPLETION_NO_OPS: dict[str, NoOp] = {
    **_PENALTIES,
    "logprobs": NULL_ONLY,
    "echo": NoOp("false", _equals(False)),
    "best_of": NoOp("equal to n", _best_of_is_n),
    "suffix": NoOp('""', _equals("")),
}
MESSAGE_NO_OPS: dict[str, NoOp] = {
    "name": NoOp('null or "" (the chat template has no place for names)', _equals("")),
    "tool_calls": NoOp("[]", _equals([])),
    "function_call": NULL_ONLY,
    "tool_call_id": NULL_ONLY,
    "refusal": NULL_ONLY,
    "audio": NULL_ONLY,
}
STREAM_OPTIONS_NO_OPS: dict[str, NoOp] = {
    "include_obfuscation": NoOp("false", _equals(False)),  # chunks carry no padding
}


def _screen(data: Any, model: type[BaseModel], no_ops: dict[str, NoOp], where: str = "") -> Any:
    """``data`` without its no-op parameters and its nulls for optional fields (null means
    the default, as OpenAI reads it); Unsupported for anything else the model lacks."""
    if not isinstance(data, dict):
        return data  # pydantic reports the type
    kept: dict[str, Any] = {}
    for key, value in data.items():
        param = f"{where}{key}"
        field = model.model_fields.get(key)
        if field is not None:
            if value is not None or field.is_required():
                kept[key] = value
        elif key not in no_ops:
            raise Unsupported(param, f"Unrecognized parameter '{param}'", "unknown_parameter")
        elif value is not None:
            _check_no_op(param, no_ops[key], value, data)
    return kept


def _check_no_op(param: str, no_op: NoOp, value: Any, body: dict[str, Any]) -> None:
    if no_op.accepts is None:
        raise Unsupported(param, f"'{param}' is not supported by this server")
    if not no_op.accepts(value, body):
        raise Unsupported(
            param,
            f"'{param}' is only supported as {no_op.allowed} by this server",
            "unsupported_value",
        )


# --- requests ----------------------------------------------------------------------------


def _shape(value: Any) -> str | None:
    return _ONE if isinstance(value, str) else _MANY if isinstance(value, list) else None


def _one_or_many(one: Any, many: Any, what: str) -> Any:
    """``one | list``, dispatched on the JSON type so an error names only the branch taken
    (a plain union would report both)."""
    return Annotated[
        Union[Annotated[one, Tag(_ONE)], Annotated[many, Tag(_MANY)]],  # noqa: UP007
        Discriminator(_shape, custom_error_type="one_or_many_type", custom_error_message=what),
    ]


PromptText = Annotated[str, Field(min_length=1, max_length=1_000_000)]  # as JobInput.prompt
Prompt = _one_or_many(
    PromptText,
    Annotated[list[PromptText], Field(min_length=1)],
    "Input should be a string or a list of strings",
)
Stop = _one_or_many(
    StopString,
    Annotated[list[StopString], Field(max_length=4)],
    "Input should be a string or a list of up to 4 strings",
)


class _Strict(BaseModel):
    """No coercions ("5" for 5); unknown fields never get here (see _screen)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


MessageContent = _one_or_many(
    Annotated[str, Field(max_length=1_000_000)],
    list[TextPart],
    "Input should be a string or a list of content parts",
)


class ChatMessage(_Strict):
    """A message; ``developer`` is the newer name of ``system``. Tool and function
    messages are refused (there are no tools)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: MessageContent

    def native(self) -> dict[str, str]:
        """The native message. Text parts are joined with newlines, as vLLM does."""
        role = "system" if self.role == "developer" else self.role
        text = self.content
        if not isinstance(text, str):
            text = "\n".join(part.text for part in text)
        return {"role": role, "content": text}


class StreamOptions(_Strict):
    include_usage: bool = False


class _Request(_Strict):
    """What both endpoints take.

    ``temperature`` defaults to 1, as OpenAI's does: the native API's default is 0
    (greedy), so a client of this surface samples unless it asks for 0.
    """

    no_ops: ClassVar[dict[str, NoOp]]

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: Stop | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    n: int = Field(1, ge=1, le=MAX_N)
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache: bool = True  # the fleet's own: false never answers from the result cache

    @model_validator(mode="before")
    @classmethod
    def _screen_body(cls, data: Any) -> Any:
        data = _screen(data, cls, cls.no_ops)
        if isinstance(data, dict) and "stream_options" in data:
            data["stream_options"] = _screen(
                data["stream_options"], StreamOptions, STREAM_OPTIONS_NO_OPS, "stream_options."
            )
        return cls._screen_more(data)

    @classmethod
    def _screen_more(cls, data: Any) -> Any:
        return data

    @field_validator("stream_options")
    @classmethod
    def _options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> Any:
        if value is not None and not info.data.get("stream"):
            raise ValueError("only allowed when 'stream' is true")
        return value

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def max_tokens_param(self) -> tuple[str, int | None]:
        """The field that sets the most tokens to generate, and its value."""
        return "max_tokens", self.max_tokens


class ChatCompletionRequest(_Request):
    """Body of ``POST /chat/completions``. ``max_completion_tokens`` wins over
    ``max_tokens``; without either a choice may run to MAX_NEW_TOKENS_LIMIT."""

    no_ops: ClassVar[dict[str, NoOp]] = CHAT_NO_OPS

    messages: list[ChatMessage] = Field(min_length=1, max_length=512)  # as JobInput
    max_completion_tokens: int | None = Field(None, ge=1)

    @classmethod
    def _screen_more(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("messages"), list):
            messages = data["messages"]
            data["messages"] = [
                _screen_message(m, f"messages.{i}.") for i, m in enumerate(messages)
            ]
        return data

    def max_tokens_param(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens


def _screen_message(message: Any, where: str) -> Any:
    if not isinstance(message, dict):
        return message
    role = message.get("role")
    if role in ("tool", "function"):
        raise Unsupported(
            f"{where}role", f"'{role}' messages are not supported (no tools)", "unsupported_value"
        )
    message = _screen(message, ChatMessage, MESSAGE_NO_OPS, where)
    if isinstance(message.get("content"), list):
        parts = message["content"]
        message["content"] = [_screen_part(p, f"{where}content.{j}.") for j, p in enumerate(parts)]
    return message


def _screen_part(part: Any, where: str) -> Any:
    if isinstance(part, dict) and isinstance(part.get("type"), str) and part["type"] != "text":
        raise Unsupported(
            f"{where}type",
            f"content parts of type '{part['type']}' are not supported, only 'text'",
            "unsupported_value",
        )
    return _screen(part, TextPart, {}, where)


class CompletionRequest(_Request):
    """Body of ``POST /completions``: text prompts only (token arrays are refused).
    ``max_tokens`` defaults to 16, as OpenAI's."""

    no_ops: ClassVar[dict[str, NoOp]] = COMPLETION_NO_OPS

    prompt: Prompt

    @classmethod
    def _screen_more(cls, data: Any) -> Any:
        prompt = data.get("prompt") if isinstance(data, dict) else None
        if isinstance(prompt, list) and any(_is_tokens(p) for p in prompt):
            raise Unsupported(
                "prompt", "token ids are not supported as 'prompt'; send text", "unsupported_value"
            )
        return data

    @field_validator("prompt")
    @classmethod
    def _few_enough_choices(cls, value: str | list[str], info: ValidationInfo) -> Any:
        count = (1 if isinstance(value, str) else len(value)) * info.data.get("n", 1)
        if count > MAX_CHOICES:
            raise ValueError(f"prompts x n is {count}; at most {MAX_CHOICES} per request")
        return value

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


def _is_tokens(item: Any) -> bool:
    return (isinstance(item, int) and not isinstance(item, bool)) or isinstance(item, list)


# --- to native jobs ----------------------------------------------------------------------


def to_job_inputs(
    req: ChatCompletionRequest | CompletionRequest, max_new_tokens_limit: int
) -> list[dict[str, Any]]:
    """Native ``JobCreate`` bodies, one per choice, in choice order: for completions
    choice ``prompt_index * n + i``, as OpenAI orders them. InvalidRequest naming
    ``max_tokens`` / ``max_completion_tokens`` when it is over ``max_new_tokens_limit``."""
    common = _generation(req, max_new_tokens_limit)
    seeds = _seeds(req.seed, req.n, req.temperature)
    if isinstance(req, ChatCompletionRequest):
        inputs = [{"messages": [m.native() for m in req.messages]}]
    else:
        inputs = [{"prompt": prompt} for prompt in req.prompts]
    return [copy.deepcopy({**one, **common, "seed": seed}) for one in inputs for seed in seeds]


def _generation(req: ChatCompletionRequest | CompletionRequest, limit: int) -> dict[str, Any]:
    metadata = {"user": req.user[:METADATA_VALUE_MAX]} if req.user else {}
    return {
        "max_new_tokens": _max_new_tokens(req, limit),
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stop": req.stops,
        "model": req.model,
        "metadata": metadata,
        "cache": req.cache,
    }


def _max_new_tokens(req: ChatCompletionRequest | CompletionRequest, limit: int) -> int:
    """The given value if within ``limit``; absent: the limit (chat) or 16 (completions)."""
    param, value = req.max_tokens_param()
    if value is None:
        default = COMPLETIONS_DEFAULT_MAX_TOKENS if isinstance(req, CompletionRequest) else limit
        return min(default, limit)
    if value > limit:
        raise InvalidRequest(
            param, f"'{param}' is too large: {value}; this server generates at most {limit} tokens"
        )
    return value


def _seeds(seed: int | None, n: int, temperature: float) -> list[int | None]:
    """One seed per copy of a prompt. Copies must differ, so a given seed becomes
    ``seed + i`` (the first copy reproduces an n=1 request); unseeded sampled copies get
    distinct random seeds; greedy copies are identical whatever the seed."""
    if seed is not None:
        return [(seed + i) % (MAX_SEED + 1) for i in range(n)]
    if n == 1 or temperature == 0:
        return [None] * n
    drawn: set[int] = set()
    while len(drawn) < n:
        drawn.add(secrets.randbelow(MAX_SEED + 1))
    return list(drawn)


# --- responses ---------------------------------------------------------------------------
# The shapes the builders below return, as models for the OpenAPI document
# (:mod:`gateway.openapi`); tests/test_fuzz.py checks every answer against them.


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIErrorBody(BaseModel):
    """Every error of ``/openai/v1``, as :func:`openai_error` builds it."""

    error: OpenAIErrorDetail


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str
    refusal: None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None


class ChatCompletion(BaseModel):
    """``POST /chat/completions`` without ``stream``: :func:`chat_completion`."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: None


class Completion(BaseModel):
    """``POST /completions`` without ``stream``: :func:`completion`."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage


class OpenAIModel(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class OpenAIModelList(BaseModel):
    """``GET /models``: :func:`models_list`."""

    object: Literal["list"]
    data: list[OpenAIModel]


def new_completion_id(chat: bool) -> str:
    """``chatcmpl-…`` or ``cmpl-…``, as OpenAI names them."""
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(16)


def total_usage(jobs: list[Job], n: int) -> dict[str, int]:
    """OpenAI's usage for choices in order, ``n`` per prompt: each prompt's tokens counted
    once (its n copies share it), completion tokens summed."""
    if n < 1 or len(jobs) % n:
        raise ValueError(f"{len(jobs)} jobs are not whole groups of n={n}")
    outputs = [_output(job) for job in jobs]
    prompt = sum(out.usage.prompt_tokens for out in outputs[::n])
    completion = sum(out.usage.completion_tokens for out in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _output(job: Job) -> Output:
    """A succeeded job's output. Any other end is the route's error to answer: OpenAI has
    no finish_reason for a failed, canceled or expired choice."""
    if job.status != JobStatus.SUCCEEDED or job.output is None:
        raise ValueError(f"job {job.id} is {job.status}, not succeeded")
    return job.output


def chat_completion(
    completion_id: str, created: int, model: str, jobs: list[Job]
) -> dict[str, Any]:
    """A ``chat.completion`` from the succeeded jobs of its choices, in order."""
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": out.text, "refusal": None},
            "finish_reason": out.finish_reason,
            "logprobs": None,
        }
        for i, out in enumerate(_output(job) for job in jobs)
    ]
    return {
        **_head(completion_id, created, model, "chat.completion"),
        "choices": choices,
        "usage": total_usage(jobs, n=len(jobs)),  # one prompt
    }


def completion(
    completion_id: str, created: int, model: str, jobs: list[Job], *, n: int = 1
) -> dict[str, Any]:
    """A ``text_completion`` from the succeeded jobs of its choices, in order (``n`` per
    prompt, for usage)."""
    choices = [
        {"index": i, "text": out.text, "finish_reason": out.finish_reason, "logprobs": None}
        for i, out in enumerate(_output(job) for job in jobs)
    ]
    return {
        **_head(completion_id, created, model, "text_completion"),
        "choices": choices,
        "usage": total_usage(jobs, n),
    }


def _head(completion_id: str, created: int, model: str, kind: str) -> dict[str, Any]:
    return {"id": completion_id, "object": kind, "created": created, "model": model}


# --- streaming ---------------------------------------------------------------------------


def chat_chunk(
    completion_id: str,
    created: int,
    model: str,
    index: int,
    *,
    role: str | None = None,
    content: str | None = None,
    finish_reason: str | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk`` for choice ``index``: the first carries the role, the
    last (with an empty delta) the finish reason."""
    delta: dict[str, str] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
    return {**_head(completion_id, created, model, "chat.completion.chunk"), "choices": [choice]}


def completion_chunk(
    completion_id: str,
    created: int,
    model: str,
    index: int,
    text: str = "",
    *,
    finish_reason: str | None = None,
) -> dict[str, Any]:
    """One streamed ``text_completion`` for choice ``index`` (the same shape as the whole).
    ``finish_reason`` is null until the choice ends, as OpenAI streams it (the SDK's
    ``Completion`` type does not allow null; its stream parser does not check)."""
    choice = {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": None}
    return {**_head(completion_id, created, model, "text_completion"), "choices": [choice]}


def usage_chunk(
    completion_id: str, created: int, model: str, usage: dict[str, int], chat: bool
) -> dict[str, Any]:
    """The last chunk before ``[DONE]`` when ``stream_options.include_usage``: no choices."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {**_head(completion_id, created, model, kind), "choices": [], "usage": usage}


DONE = "[DONE]"


def sse(data: dict | str) -> str:
    """One server-sent event: compact JSON (no NaN), or the ``[DONE]`` sentinel."""
    if isinstance(data, str):
        if data != DONE:
            raise ValueError("the only string event is '[DONE]'")
        return f"data: {DONE}\n\n"
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return f"data: {text}\n\n"


# --- models ------------------------------------------------------------------------------


def models_list(model_ids: list[str], created: int) -> dict[str, Any]:
    """``GET /models`` as OpenAI answers it."""
    data = [
        {"id": m, "object": "model", "created": created, "owned_by": "fleet"} for m in model_ids
    ]
    return {"object": "list", "data": data}
