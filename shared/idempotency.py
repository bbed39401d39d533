"""``Idempotency-Key``: a retried submit returns the first job or batch instead of a new one.

The key is stored (per model, for 24 h) as ``"id fingerprint"`` in the same script that
creates the job or batch; the fingerprint tells a retry from another request that reuses
the key.
"""

from __future__ import annotations

import hashlib
import json

IDEMPOTENCY_TTL_S = 86_400


class IdempotencyConflict(Exception):
    """The Idempotency-Key was used before with a different request body."""


class IdempotentResultExpired(Exception):
    """The Idempotency-Key names a job or batch whose record has expired."""


def fingerprint(body: dict) -> str:
    """What makes two submissions with one Idempotency-Key the same request (key order and
    whitespace aside)."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def replayed_id(stored: str, request_fingerprint: str) -> str:
    """The id an Idempotency-Key was stored with; IdempotencyConflict if that request's
    body differed from this one."""
    prior_id, _, prior_fingerprint = stored.partition(" ")
    if prior_fingerprint != request_fingerprint:
        raise IdempotencyConflict(prior_id)
    return prior_id
