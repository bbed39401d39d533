"""What every request means before it touches a queue, whichever API it came through.

The native routes (:mod:`gateway.jobs`, :mod:`gateway.batches`) and any other protocol
on top of the same queue call these: which model, whether a webhook may be sent there,
what an Idempotency-Key error or an unknown id answers. Each raises
:class:`~gateway.errors.APIError` with a 4xx that says what is wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from gateway import auth
from gateway.errors import APIError
from gateway.extensions import fleet
from shared.idempotency import IdempotencyConflict, IdempotentResultExpired
from webhooks import UnresolvableURLError, UnsafeURLError, check_url


def resolve_model(requested: str | None) -> str:
    """The model a request names (the fleet's own by default); 422 if it is not served."""
    model = requested or fleet.settings.served_model
    if model not in fleet.served_models():
        raise APIError(
            422, "model_not_found", f"model '{model}' is not served here; see GET /v1/models",
            param="model",
        )  # fmt: skip
    return model


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


T = TypeVar("T")


def find(
    kind: str,
    object_id: str,
    is_id: Callable[[str], bool],
    get: Callable[[str, str, str | None], T | None],
) -> T:
    """A job or batch by its id, whichever served model holds it; 404 if none does (the id
    is unknown, malformed, its record expired, or another API key made it: ids leak
    nothing)."""
    if is_id(object_id):
        owner = auth.visible_owner()
        for model in fleet.served_models():
            found = get(model, object_id, owner)
            if found is not None:
                return found
    raise APIError(
        404, f"{kind}_not_found", f"no {kind} '{object_id}' (unknown, or its result expired)"
    )
