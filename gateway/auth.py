"""Who is calling: every ``/v1`` and ``/openai/v1`` request's API key, its scope and its
requests per minute, checked before the view runs.

With REQUIRE_API_KEYS off every caller is :data:`ANONYMOUS`, an admin without limits (and
the gateway says so in its log at start). A missing or bad key is a 401 with
``WWW-Authenticate`` (RFC 6750), the same answer for a key that never existed and one that
was revoked; a key without the route's scope is a 403. What a key made, only it (and admin
keys) can see: the stores answer None for another key's job or batch (a 404).
"""

from __future__ import annotations

import hmac

from flask import Flask, Response, g, request

from gateway.errors import APIError
from gateway.extensions import fleet
from gateway.rate_limits import RateLimited, Standing, headers
from shared.api_keys import ApiKey, Scope

PROTECTED = ("/v1/", "/openai/v1/")
# The scope each blueprint's routes need; /v1/models (health) needs only a valid key.
SCOPE_OF_BLUEPRINT = {
    "jobs": Scope.JOBS,
    "openai": Scope.JOBS,
    "batches": Scope.BATCHES,
    "openai_files": Scope.BATCHES,
    "openai_batches": Scope.BATCHES,
    "admin": Scope.ADMIN,
}
ANONYMOUS = ApiKey(id="", name="anonymous", scopes=frozenset({Scope.ADMIN}))
_CHALLENGE = 'Bearer realm="fleet"'


def init_app(app: Flask) -> None:
    app.before_request(_authenticate)
    app.after_request(_rate_limit_headers)


def caller() -> ApiKey:
    return g.get("api_key", ANONYMOUS)


def visible_owner() -> str | None:
    """Whose jobs and batches the caller may see: its own (its key id), or everyone's
    (None) for admin keys and when keys are off."""
    key = caller()
    return None if key.admin else key.id


def queue_cap(key: ApiKey) -> int:
    """Unfinished interactive jobs the key may have (0: no cap)."""
    if key is ANONYMOUS:
        return 0
    return fleet.settings.default_key_max_queued if key.max_queued is None else key.max_queued


def charge_tokens(tokens: int) -> int:
    """Take ``tokens`` from the caller's tokens per minute; 429 ``rate_limited`` past it.
    Returns what was charged (0: the key has no such limit)."""
    key = caller()
    if key is ANONYMOUS:
        return 0
    try:
        standing = fleet.rate_limits.tokens(key, tokens)
    except RateLimited as limited:
        raise _too_many(limited, f"{tokens} tokens (max_new_tokens)") from None
    _note(standing)
    return tokens if standing is not None else 0


def give_back_tokens(tokens: int) -> None:
    """Undo :func:`charge_tokens` for a request that was refused after all."""
    if tokens and caller() is not ANONYMOUS:
        fleet.rate_limits.give_back(caller(), tokens)


def metrics_allowed() -> bool:
    """/metrics is open unless METRICS_TOKEN is set; then it needs that bearer token."""
    token = fleet.settings.metrics_token
    if token is None:
        return True
    given = _bearer() or ""
    return hmac.compare_digest(given.encode(), token.get_secret_value().encode())


def _authenticate() -> None:
    if not request.path.startswith(PROTECTED) or not fleet.settings.require_api_keys:
        return
    secret = _bearer()
    if secret is None:
        raise APIError(
            401, "missing_api_key",
            "this fleet needs an API key: send 'Authorization: Bearer <key>' (make up prints "
            "the first one; an operator makes more: python -m fleet.keys create --name NAME)",
            headers={"WWW-Authenticate": _CHALLENGE},
        )  # fmt: skip
    key = fleet.api_keys.authenticate(secret)
    if key is None:
        raise APIError(
            401, "invalid_api_key", "the API key is not valid (mistyped, or revoked)",
            headers={"WWW-Authenticate": f'{_CHALLENGE}, error="invalid_token"'},
        )  # fmt: skip
    g.api_key = key
    scope = SCOPE_OF_BLUEPRINT.get(request.blueprint or "")
    if scope is not None and not key.allows(scope):
        raise APIError(
            403, "permission_denied",
            f"this API key lacks the '{scope}' scope (it has: {', '.join(sorted(key.scopes))})",
        )  # fmt: skip
    fleet.token_refunds.ensure_running()
    try:
        _note(fleet.rate_limits.request(key))
    except RateLimited as limited:
        raise _too_many(limited, "requests") from None


def _bearer() -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _note(standing: Standing | None) -> None:
    if standing is not None:
        g.setdefault("rate_limits", {})[standing.policy] = standing


def _too_many(limited: RateLimited, what: str) -> APIError:
    _note(Standing(limited.policy, limited.limit, 0, max(1, limited.retry_after_s)))
    if limited.retry_after_s < 0:
        return APIError(
            429, "rate_limited",
            f"{what} is more than this API key's {limited.policy} per minute "
            f"({limited.limit}) allow at all; ask for less",
        )  # fmt: skip
    return APIError(
        429, "rate_limited",
        f"this API key is over its {limited.policy} per minute ({limited.limit}); "
        f"retry after {limited.retry_after_s} s",
        headers={"Retry-After": str(limited.retry_after_s)},
    )  # fmt: skip


def _rate_limit_headers(response: Response) -> Response:
    standings = g.get("rate_limits")
    if standings:
        response.headers.update(headers(list(standings.values())))
    return response
