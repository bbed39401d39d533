"""One delivery attempt: claim it, check the URL again, sign, POST, record the outcome,
and say when the next attempt is due (the policy is in :mod:`webhooks.policy`)."""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime

from standardwebhooks import Webhook

from shared.records import rfc3339
from shared.settings import Settings
from shared.states import DeliveryState
from webhooks import metrics, ssrf, transport
from webhooks.policy import Verdict, classify, next_delay, parse_retry_after
from webhooks.store import Claimed, DeliveryStore

log = logging.getLogger(__name__)

USER_AGENT = "inference-fleet-webhooks/1"


def lease_s(settings: Settings) -> float:
    """How long a claimed attempt is assumed to still be running (then it may be re-run)."""
    return 2 * settings.webhook_timeout_s + 30


def signed_headers(secrets: list[str], delivery_id: str, body: str, now: float) -> dict[str, str]:
    """Standard Webhooks headers; ``webhook-id`` is the delivery id, the same on retries.
    With two secrets (a rotation) ``webhook-signature`` holds both signatures, space
    separated, as the spec allows: a receiver with either secret verifies it."""
    timestamp = datetime.fromtimestamp(int(now), UTC)
    signatures = [Webhook(secret).sign(delivery_id, timestamp, body) for secret in secrets]
    return {
        "webhook-id": delivery_id,
        "webhook-timestamp": str(int(now)),
        "webhook-signature": " ".join(signatures),
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
    }


def attempt_once(settings: Settings, claimed: Claimed) -> Verdict:
    """Resolve and check the URL anew, then POST to exactly the addresses checked."""
    if settings.webhook_secret is None:
        return Verdict(
            None, "WEBHOOK_SECRET is not set on the webhook worker", DeliveryState.FAILED
        )
    try:
        target = ssrf.resolve(claimed.url, settings.webhook_allow_private)
    except ssrf.UnresolvableURLError as exc:  # DNS may be down for a moment: retry
        return Verdict(None, str(exc), None)
    except ssrf.UnsafeURLError as exc:
        return Verdict(None, f"URL refused: {exc}", DeliveryState.FAILED)
    headers = signed_headers(
        settings.webhook_secrets, claimed.delivery_id, claimed.payload, time.time()
    )
    try:
        response = transport.post(
            target, claimed.payload.encode(), headers, settings.webhook_timeout_s
        )
    except transport.TransportError as exc:
        return Verdict(None, str(exc), None)
    return classify(response.status, response.retry_after)


def run_attempt(
    settings: Settings, store: DeliveryStore, delivery_id: str, attempt: int
) -> float | None:
    """Make attempt number ``attempt`` and record it; the seconds until the next attempt,
    or None when the delivery ended (or this attempt was not ours to make)."""
    lease = lease_s(settings)
    claimed = store.claim(delivery_id, attempt, lease)
    if claimed is None:
        log.info("webhook %s attempt %d: not pending or already claimed", delivery_id, attempt)
        return None
    started = time.time()
    verdict = attempt_once(settings, claimed)
    finished = time.time()
    state, delay, error = verdict.final, None, None
    if state is None:
        retry_after = parse_retry_after(verdict.retry_after, finished)
        delay = next_delay(settings.webhook_retry_schedule_s, attempt, retry_after)
        state = DeliveryState.PENDING if delay is not None else DeliveryState.FAILED
        if delay is None:
            error = f"{verdict.error}; gave up after {attempt} attempts"
    elif state is not DeliveryState.DELIVERED:
        error = verdict.error
    next_at = finished + delay if delay is not None else None
    record = {
        "attempt": attempt,
        "at": rfc3339(started),
        "status": verdict.status,
        "error": verdict.error,
        "duration_ms": round((finished - started) * 1000, 1),
        "next_retry_at": rfc3339(next_at),
    }
    ttl = settings.result_ttl_s + (delay or 0) + lease
    store.record_attempt(delivery_id, record, state, next_at, error, ttl)
    metrics.count(state)
    log.info(
        "webhook %s attempt %d: %s -> %s%s",
        delivery_id,
        attempt,
        verdict.status or verdict.error,
        state.value,
        f", retry in {delay:.1f}s" if delay is not None else "",
    )
    return delay
