"""Reading what a client sent, shared by the job and batch views: bodies, headers, webhooks.

Each helper raises :class:`~gateway.errors.APIError` with a 4xx that says what is wrong.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager

from flask import request

from gateway.errors import APIError
from gateway.extensions import fleet
from shared.queue import IdempotencyConflict, IdempotentResultExpired
from webhooks import UnresolvableURLError, UnsafeURLError, check_url

_IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")  # visible ASCII, as Stripe's


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
    """The body bytes; 413 past ``max_bytes`` (default MAX_REQUEST_BYTES)."""
    if max_bytes is not None:
        request.max_content_length = max_bytes
    return request.get_data(cache=False)


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


@contextmanager
def idempotency_errors(kind: str) -> Iterator[None]:
    """The 4xx for an Idempotency-Key reused with another body, or naming an expired
    ``kind`` (job or batch)."""
    try:
        yield
    except IdempotencyConflict as exc:
        raise APIError(
            422, "idempotency_key_reused",
            f"Idempotency-Key was used for a different request ({kind} {exc}); use a new key",
        ) from None  # fmt: skip
    except IdempotentResultExpired as exc:
        raise APIError(
            409, f"idempotent_{kind}_expired",
            f"Idempotency-Key names {kind} {exc}, which has expired; use a new key",
        ) from None  # fmt: skip


def check_webhook(url: str | None) -> None:
    """Refuse, at submit, a webhook this fleet could not or must not call."""
    if url is None:
        return
    settings = fleet.settings
    if settings.webhook_secret is None:
        raise APIError(
            400, "webhooks_disabled",
            "this fleet has no WEBHOOK_SECRET, so it sends no webhooks; omit 'webhook'",
            param="webhook",
        )  # fmt: skip
    try:
        check_url(url, settings.webhook_allow_private)
    except UnresolvableURLError as exc:
        raise APIError(
            422, "invalid_webhook", f"'webhook': {exc}; check the host name", param="webhook"
        ) from None
    except UnsafeURLError as exc:
        hint = "give a public http(s) URL"
        if not settings.webhook_allow_private:
            hint += " (loopback and private ones need WEBHOOK_ALLOW_PRIVATE=1 on the fleet)"
        raise APIError(
            422, "invalid_webhook", f"'webhook': {exc}; {hint}", param="webhook"
        ) from None
