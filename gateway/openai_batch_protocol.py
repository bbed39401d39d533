"""OpenAI's Files and Batch API shapes: the create body, the input file's lines read into
native batch requests, the output and error lines, and the batch and file objects.

Pure data, no Flask or Redis, as :mod:`gateway.openai_protocol` (whose request models
and builders each input line and output body go through: a line's ``body`` is exactly a
``/chat/completions`` or ``/completions`` request, its output ``body`` exactly that
endpoint's answer). Every refusal is an :class:`~gateway.openai_protocol.InvalidRequest`
(a 400 in OpenAI's error shape); a bad input line's names its ``line``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidRequest,
    from_validation_error,
    to_job_inputs,
)
from shared import openai_batches as ob
from shared.protocol import BatchRequest, MetadataKey, MetadataValue, WebhookURL

ENDPOINTS: dict[str, type[ChatCompletionRequest] | type[CompletionRequest]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}
LINE_FIELDS = {"custom_id", "method", "url", "body"}
EXPIRED_ERROR = {
    "code": "batch_expired",
    "message": "This request could not be executed before the completion window expired.",
}
CANCELLED_ERROR = {
    "code": "batch_cancelled",
    "message": "This request was not executed: the batch was cancelled before it ran.",
}


# --- create ------------------------------------------------------------------------------


class BatchCreateBody(BaseModel):
    """Body of ``POST /batches``. ``webhook`` is the fleet's own (``extra_body`` in the SDK):
    it receives batch.completed, batch.failed, batch.expired and batch.cancelled, signed
    with Standard Webhooks as OpenAI's webhooks are."""

    model_config = ConfigDict(extra="forbid", strict=True)

    input_file_id: str
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: str = Field(description='"24h"')
    metadata: dict[MetadataKey, MetadataValue] | None = Field(None, max_length=16)
    webhook: WebhookURL | None = None
    output_expires_after: None = Field(
        None, description="Not supported: output files last RESULT_TTL_S after the batch ends."
    )


def window_of(body: BatchCreateBody, short_windows: bool) -> int:
    """The window's seconds; a 400 for any window but "24h"."""
    window = ob.window_seconds(body.completion_window, short_windows)
    if window is None:
        raise InvalidRequest(
            "completion_window",
            f"Invalid 'completion_window': '{body.completion_window}'; only '24h' is supported",
        )
    return window


class BadLine(InvalidRequest):
    """A line of the input file is not a valid request: the 400 names it (``line``, from 1)."""

    def __init__(
        self, line: int, param: str | None, message: str, code: str = "invalid_value"
    ) -> None:
        super().__init__(param, f"line {line}: {message}", code)
        self.line = line

    def error(self) -> dict[str, Any]:
        body = super().error()
        body["error"]["line"] = self.line
        return body


@dataclass(frozen=True)
class InputFile:
    model: str
    requests: list[BatchRequest]


def parse_input_file(
    content: bytes,
    endpoint: str,
    *,
    served_models: list[str],
    max_new_tokens_limit: int,
    max_requests: int,
) -> InputFile:
    """Every line checked, as ``endpoint`` would check its body; the first bad one raises
    :class:`BadLine`. Each line makes one choice (``n`` is 1, one prompt): one native
    request, its ``custom_id`` the line's. Every line names the same served model."""
    kind = ENDPOINTS[endpoint]
    model: str | None = None
    requests: list[BatchRequest] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(content.split(b"\n"), start=1):
        if not raw.strip():
            continue
        if len(requests) >= max_requests:
            raise BadLine(number, None, f"a batch holds at most {max_requests} requests")
        line = _json_line(number, raw)
        req = _body(number, line, endpoint, kind)
        if model is None and req.model not in served_models:
            raise BadLine(
                number, "body.model", f"model '{req.model}' is not served here; see GET /models",
                "model_not_found",
            )  # fmt: skip
        if model is not None and req.model != model:
            raise BadLine(
                number, "body.model",
                f"every line of a batch names the same model; the first named '{model}'",
            )  # fmt: skip
        model = req.model
        request = _native(number, line["custom_id"], req, max_new_tokens_limit)
        if request.custom_id in seen:
            raise BadLine(
                number, "custom_id",
                f"'{request.custom_id}' is used twice (first on line {seen[request.custom_id]})",
                "duplicate_custom_id",
            )  # fmt: skip
        seen[request.custom_id] = number
        requests.append(request)
    if model is None:
        raise InvalidRequest("input_file_id", "the input file holds no requests", "empty_file")
    return InputFile(model, requests)


def _json_line(number: int, raw: bytes) -> dict[str, Any]:
    try:
        line = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadLine(number, None, f"not valid JSON: {exc}", "invalid_json_line") from None
    if not isinstance(line, dict):
        raise BadLine(number, None, "a line must be a JSON object", "invalid_json_line")
    unknown = sorted(set(line) - LINE_FIELDS)
    if unknown:
        raise BadLine(number, unknown[0], f"unknown field '{unknown[0]}'", "unknown_parameter")
    for name in ("custom_id", "method", "url", "body"):
        if name not in line:
            raise BadLine(
                number, name, f"Missing required parameter: '{name}'", "missing_required_parameter"
            )
    if not isinstance(line["custom_id"], str):
        raise BadLine(number, "custom_id", "must be a string", "invalid_type")
    if line["method"] != "POST":
        raise BadLine(number, "method", "must be 'POST'")
    if not isinstance(line["body"], dict):
        raise BadLine(number, "body", "must be a JSON object", "invalid_type")
    return line


def _body(
    number: int,
    line: dict[str, Any],
    endpoint: str,
    kind: type[ChatCompletionRequest] | type[CompletionRequest],
) -> ChatCompletionRequest | CompletionRequest:
    if line["url"] != endpoint:
        raise BadLine(
            number, "url", f"'{line['url']}' is not the batch's endpoint '{endpoint}'",
            "invalid_url",
        )  # fmt: skip
    try:
        req = kind.model_validate(line["body"])
    except ValidationError as exc:
        error = from_validation_error(exc)["error"]
        param, message = error["param"], error["message"]
        if param:  # name it as a field of the line
            message = message.replace(f"'{param}'", f"'body.{param}'", 1)
        raise BadLine(number, _in_body(param), message, error["code"]) from None
    except InvalidRequest as exc:
        raise BadLine(number, _in_body(exc.param), exc.message, exc.code) from None
    if req.stream:
        raise BadLine(number, "body.stream", "a batch request cannot stream", "unsupported_value")
    choices = req.n * (len(req.prompts) if isinstance(req, CompletionRequest) else 1)
    if choices > 1:
        raise BadLine(
            number, "body.n" if req.n > 1 else "body.prompt",
            "a batch line makes one choice (n 1, one prompt): give each its own line",
            "unsupported_parameter",
        )  # fmt: skip
    return req


def _native(
    number: int,
    custom_id: str,
    req: ChatCompletionRequest | CompletionRequest,
    max_new_tokens_limit: int,
) -> BatchRequest:
    try:
        [job] = to_job_inputs(req, max_new_tokens_limit)
    except InvalidRequest as exc:
        raise BadLine(number, _in_body(exc.param), exc.message, exc.code) from None
    fields = {k: v for k, v in job.items() if k not in ("model", "metadata")}
    try:
        return BatchRequest.model_validate(
            {**fields, "custom_id": custom_id},
            context={"max_new_tokens_limit": max_new_tokens_limit},
        )
    except ValidationError as exc:
        err = exc.errors(include_url=False, include_input=False)[0]
        param = ".".join(str(part) for part in err["loc"]) or None
        raise BadLine(number, param, err["msg"].removeprefix("Value error, ")) from None


def _in_body(param: str | None) -> str:
    return f"body.{param}" if param else "body"


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


# --- output and error lines --------------------------------------------------------------


def output_line(
    request_id: str, custom_id: str, status_code: int, body: dict[str, Any]
) -> dict[str, Any]:
    """A request that ran: its answer (``status_code`` 200, or a 4xx/5xx with an error
    body, for the error file). ``request_id`` is the fleet's job id."""
    response = {"status_code": status_code, "request_id": request_id, "body": body}
    return {"id": line_id(request_id), "custom_id": custom_id, "response": response, "error": None}


def unrun_line(request_id: str, custom_id: str, error: dict[str, str]) -> dict[str, Any]:
    """A request that never ran (expired or cancelled): no response, an error."""
    return {"id": line_id(request_id), "custom_id": custom_id, "response": None, "error": error}


def line_id(job_id: str) -> str:
    return "batch_req_" + job_id.removeprefix("job_")


def completion_id(job_id: str, chat: bool) -> str:
    """The chatcmpl- / cmpl- id of a request's answer: the same on every read."""
    return ("chatcmpl-" if chat else "cmpl-") + job_id.removeprefix("job_")


def dumps(line: dict[str, Any]) -> str:
    return json.dumps(line, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


# --- files -------------------------------------------------------------------------------

OUTPUT, ERRORS = "output", "errors"


def generated_file_id(batch_id: str, kind: str) -> str:
    """The id of a batch's output or error file (made from its results when read)."""
    return f"file-{batch_id}-{kind}"


def parse_generated_file_id(file_id: str) -> tuple[str, str] | None:
    """(batch id, kind) of a generated file's id; None for any other id."""
    rest = file_id.removeprefix("file-")
    batch_id, _, kind = rest.rpartition("-")
    if rest == file_id or kind not in (OUTPUT, ERRORS) or not batch_id.startswith("batch_"):
        return None
    return batch_id, kind


def file_object(
    file_id: str,
    filename: str,
    purpose: str,
    size: int,
    created_at: float,
    expires_at: float | None,
) -> dict[str, Any]:
    """OpenAI's file object (``status`` is deprecated there; always ``processed``)."""
    return {
        "id": file_id,
        "object": "file",
        "bytes": size,
        "created_at": int(created_at),
        "expires_at": int(expires_at) if expires_at is not None else None,
        "filename": filename,
        "purpose": purpose,
        "status": "processed",
        "status_details": None,
    }


def cursor_list(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


# --- the batch object --------------------------------------------------------------------


def batch_object(record: dict[str, str], summary: dict[str, Any] | None) -> dict[str, Any]:
    """OpenAI's batch object of a native batch's record (shared.openai_batches says how
    statuses map); ``summary`` (files' sizes, usage) once it ended."""
    status = ob.status_of(record)
    ended = ob.ended_at(record)
    counts = {
        "total": int(record["total"]),
        "completed": int(record.get("completed") or 0),
        "failed": int(record.get("failed") or 0),
    }
    deleted = (record.get(ob.DELETED) or "").split()

    def at(*statuses: ob.OpenAIBatchStatus) -> int | None:
        return int(ended) if ended is not None and status in statuses else None

    def file_id(kind: str, count: int) -> str | None:
        if status not in ob.ENDED or not count or kind in deleted:
            return None
        return generated_file_id(record["id"], kind)

    done = (
        ob.OpenAIBatchStatus.COMPLETED,
        ob.OpenAIBatchStatus.FAILED,
        ob.OpenAIBatchStatus.EXPIRED,
    )
    unrun = counts["total"] - counts["completed"] - int(record.get("failed") or 0)
    errors = None
    if status == ob.OpenAIBatchStatus.FAILED:
        errors = {
            "object": "list",
            "data": [{"code": "all_requests_failed", "line": None, "param": None,
                      "message": "every request of the batch failed; see error_file_id"}],
        }  # fmt: skip
    return {
        "id": record["id"],
        "object": "batch",
        "endpoint": record[ob.ENDPOINT],
        "model": record["model"],
        "errors": errors,
        "input_file_id": record[ob.INPUT_FILE],
        "completion_window": record[ob.WINDOW],
        "status": status.value,
        "output_file_id": file_id(OUTPUT, counts["completed"]),
        "error_file_id": file_id(ERRORS, counts["failed"] + unrun),
        "created_at": int(float(record["created_at"])),
        "in_progress_at": int(float(record["created_at"])),
        "expires_at": int(ob.expires_at(record)),
        "finalizing_at": at(*done),
        "completed_at": at(ob.OpenAIBatchStatus.COMPLETED),
        "failed_at": at(ob.OpenAIBatchStatus.FAILED),
        "expired_at": at(ob.OpenAIBatchStatus.EXPIRED),
        "cancelling_at": _int(record.get("cancelling_at")),
        "cancelled_at": at(ob.OpenAIBatchStatus.CANCELLED),
        "request_counts": counts,
        "usage": summary["usage"] if summary else None,
        "metadata": json.loads(record.get("metadata") or "{}") or None,
    }


def _int(value: str | None) -> int | None:
    return int(float(value)) if value else None


def usage_of(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    """A batch's usage, as OpenAI reports it (no cached or reasoning tokens here)."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }
