"""OpenAI's API under ``/openai/v1``: ``OpenAI(base_url="http://host:8000/openai/v1")``.

Chat completions and completions, streamed or not, and the model list. Every error here
is told in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, so the
``openai`` SDK raises the matching exception (400 BadRequestError, 429 RateLimitError with
``Retry-After``, ...). Each response names its jobs in ``Fleet-Job-Id``.
"""

from __future__ import annotations

import logging
import time

import redis
from flask import Blueprint, Response, jsonify, stream_with_context
from pydantic import ValidationError
from spectree import Response as Spec

from gateway import openai_serving
from gateway.errors import APIError
from gateway.extensions import fleet
from gateway.inputs import json_body
from gateway.job_events import HEADERS
from gateway.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidRequest,
    OpenAIErrorBody,
    from_validation_error,
    models_list,
    openai_error,
)
from gateway.openapi import documented

log = logging.getLogger(__name__)
bp = Blueprint("openai", __name__, url_prefix="/openai/v1")
STARTED = int(time.time())

_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          429: "rate_limit_error"}  # fmt: skip


@bp.post("/chat/completions")
@documented(
    json=ChatCompletionRequest, resp=Spec(HTTP_400=OpenAIErrorBody, HTTP_429=OpenAIErrorBody),
    tags=["openai"]
)  # fmt: skip
def chat_completions():
    """OpenAI chat completions: `messages`, `max_tokens` / `max_completion_tokens`,
    `temperature`, `top_p`, `stop`, `seed`, `n`, `user`, `stream`, `stream_options`.
    Parameters the fleet cannot honour (`tools`, `logprobs`, `response_format`...) are 400s."""
    return _complete(ChatCompletionRequest)


@bp.post("/completions")
@documented(
    json=CompletionRequest, resp=Spec(HTTP_400=OpenAIErrorBody, HTTP_429=OpenAIErrorBody),
    tags=["openai"]
)  # fmt: skip
def completions():
    """OpenAI (legacy) completions: `prompt` (a string or a list: one choice each), and the
    chat fields but `messages`."""
    return _complete(CompletionRequest)


@bp.get("/models")
@documented(tags=["openai"])
def list_models():
    """The served models, in OpenAI's list format."""
    return jsonify(models_list(fleet.served_models(), STARTED))


def _complete(kind: type[ChatCompletionRequest] | type[CompletionRequest]):
    req = kind.model_validate(json_body())
    choices = openai_serving.submit(req)
    headers = choices.headers()
    if req.stream:
        events = stream_with_context(openai_serving.stream(choices))
        return Response(events, mimetype="text/event-stream", headers=HEADERS | headers)
    return jsonify(openai_serving.respond(choices)), 200, headers


def _invalid(exc: ValidationError):
    return jsonify(from_validation_error(exc)), 400


def _unsupported(exc: InvalidRequest):
    return jsonify(exc.error()), exc.status


def answer_in_openai_shape(blueprint: Blueprint) -> None:
    """Tell a blueprint's errors in OpenAI's shape (this one's, and the files' and batches')."""
    blueprint.register_error_handler(ValidationError, _invalid)
    blueprint.register_error_handler(InvalidRequest, _unsupported)
    blueprint.register_error_handler(APIError, _api_error)
    blueprint.register_error_handler(redis.ConnectionError, _redis_down)
    blueprint.register_error_handler(redis.TimeoutError, _redis_down)


def _api_error(exc: APIError):
    """The fleet's own errors (backpressure, unknown model, bad JSON...) in OpenAI's shape."""
    if isinstance(exc, openai_serving.OpenAIError):
        return jsonify(exc.openai_body()), exc.status, exc.headers
    status = exc.status
    if exc.code == "model_not_found":
        status = 404
    elif status == 422:
        status = 400
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    body = openai_error(exc.message, kind, exc.extra.get("param"), exc.code)
    return jsonify(body), status, exc.headers


def _redis_down(exc: redis.RedisError):
    """As the app's own handler (errors.py) says it, in OpenAI's shape: the SDK retries."""
    log.warning("redis error: %s", exc)
    return _api_error(
        APIError(503, "queue_unavailable", "the job store is unreachable; retry shortly",
                 headers={"Retry-After": "2"})
    )  # fmt: skip


answer_in_openai_shape(bp)
