"""Reading what a client sent over HTTP, shared by the views: bodies and headers.

Each helper raises :class:`~gateway.errors.APIError` with a 4xx that says what is wrong.
What the request then means is checked by the serving layer (:mod:`gateway.serving`).
"""

from __future__ import annotations

import json
import re

from flask import request
from werkzeug.exceptions import RequestEntityTooLarge

from gateway.errors import APIError

_IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")  # visible ASCII, as Stripe's
MAX_WAIT_S = 60
_PREFER_WAIT = re.compile(r"(?:^|[,;]\s*)wait(?:=(\d+))?\s*(?:$|[,;])", re.IGNORECASE)


def json_body(max_bytes: int | None = None, accepted: str = "application/json") -> dict:
    """The body as a JSON object; 415 for another media type (naming the ``accepted`` ones),
    400 for bad JSON, 413 if big."""
    if request.mimetype != "application/json":
        raise APIError(
            415,
            "unsupported_media_type",
            f"send the body as {accepted} (got '{request.mimetype or 'none'}')",
        )
    try:
        body = json.loads(raw_body(max_bytes), parse_constant=reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, "invalid_json", f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "invalid_json", "body must be a JSON object")
    return body


def raw_body(max_bytes: int | None = None) -> bytes:
    """The body bytes; 413 past ``max_bytes`` (default MAX_REQUEST_BYTES).

    The 413 is an APIError, not werkzeug's: a blueprint's handler tells it in its API's
    shape (OpenAI's under /openai/v1, where werkzeug's got the native one)."""
    if max_bytes is not None:
        request.max_content_length = max_bytes
    try:
        return request.get_data(cache=False)
    except RequestEntityTooLarge:
        name = "BATCH_MAX_BYTES" if max_bytes is not None else "MAX_REQUEST_BYTES"
        raise APIError(
            413, "request_too_large",
            f"request body is larger than {request.max_content_length} bytes ({name})",
        ) from None  # fmt: skip


def reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def idempotency_key() -> str | None:
    key = request.headers.get("Idempotency-Key")
    if key is None:
        return None
    if not _IDEMPOTENCY_KEY.match(key):
        raise APIError(
            400, "invalid_header", "Idempotency-Key must be 1-255 visible ASCII characters"
        )
    return key


def cache_allowed() -> bool:
    """False when the request says ``Cache-Control: no-cache`` or ``no-store`` (as the body
    field ``"cache": false``): run it anew, whatever the result cache holds."""
    directives = request.headers.get("Cache-Control", "").lower()
    return not re.search(r"\bno-(cache|store)\b", directives)


def prefer_wait() -> int | None:
    """Seconds asked for by ``Prefer: wait=N``; None if absent. Bare ``wait`` means 60."""
    prefer = request.headers.get("Prefer")
    if not prefer:
        return None
    match = _PREFER_WAIT.search(prefer.strip())
    if match is None:
        if re.search(r"\bwait\b", prefer, re.IGNORECASE):
            raise APIError(
                400, "invalid_header", "Prefer: wait must be 'wait' or 'wait=N' with 1 <= N <= 60"
            )
        return None  # other preferences are not ours to reject
    seconds = int(match.group(1)) if match.group(1) else MAX_WAIT_S
    if not 1 <= seconds <= MAX_WAIT_S:
        raise APIError(
            400, "invalid_header", f"Prefer: wait=N needs 1 <= N <= {MAX_WAIT_S} (got {seconds})"
        )
    return seconds
