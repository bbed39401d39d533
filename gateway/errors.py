"""Every error the gateway answers is ``{"error": {"code", "message", ...}}`` with a 4xx/5xx.

Handlers here turn werkzeug's HTTP errors, pydantic's validation errors and Redis outages
into that shape, so no client ever sees an HTML page or a bare 500.
"""

from __future__ import annotations

import logging

import redis
from flask import Flask, jsonify, request
from pydantic import ValidationError
from werkzeug.exceptions import HTTPException

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error the client can act on: raise it from a view with a status and a code."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        headers: dict[str, str] | None = None,
        **extra: object,
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.extra = status, code, message, extra
        self.headers = headers or {}

    def response(self):
        body = jsonify(error={"code": self.code, "message": self.message, **self.extra})
        body.headers.update(self.headers)
        return body, self.status


def describe_validation_error(exc: ValidationError) -> APIError:
    """422 naming the first bad field in words, with every problem listed in ``details``."""
    details = []
    for err in exc.errors(include_url=False, include_input=False):
        field = ".".join(str(part) for part in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        details.append({"param": field or None, "message": message})
    first = details[0]
    where = f"'{first['param']}': " if first["param"] else ""
    return APIError(
        422, "invalid_request", where + first["message"], param=first["param"], details=details
    )


_HTTP_CODES = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    415: "unsupported_media_type",
}


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(APIError)
    def _api_error(exc: APIError):
        return exc.response()

    @app.errorhandler(ValidationError)
    def _validation_error(exc: ValidationError):
        return describe_validation_error(exc).response()

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException):
        status = exc.code or 500
        message = exc.description or exc.name
        if status == 413:
            limit = request.max_content_length
            name = "MAX_REQUEST_BYTES"
            if limit != app.config.get("MAX_CONTENT_LENGTH"):
                name = "BATCH_MAX_BYTES"
            message = f"request body is larger than {limit} bytes ({name})"
        body, _ = response = APIError(
            status, _HTTP_CODES.get(status, "http_error"), message
        ).response()
        if status == 405 and getattr(exc, "valid_methods", None):
            body.headers["Allow"] = ", ".join(exc.valid_methods)
        return response

    @app.errorhandler(redis.ConnectionError)
    @app.errorhandler(redis.TimeoutError)
    def _redis_down(exc: redis.RedisError):
        log.warning("redis error: %s", exc)
        body, _ = response = APIError(
            503, "queue_unavailable", "the job store is unreachable; retry shortly"
        ).response()
        body.headers["Retry-After"] = "2"
        return response

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        log.exception("unhandled error")
        return APIError(500, "internal_error", "unexpected error; it has been logged").response()
