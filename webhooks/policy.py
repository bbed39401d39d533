"""What an answer means and when to try again: the retry policy, free of I/O.

Standard Webhooks semantics: any 2xx is delivered; 410 means the receiver is gone; 429,
5xx, timeouts and connection errors are retried with backoff (honouring ``Retry-After``);
any other answer (3xx included: redirects are not followed) fails at once.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import UTC
from email.utils import parsedate_to_datetime

from shared.states import DeliveryState

JITTER = 0.2  # each scheduled delay is scaled by a random factor in [0.8, 1.2]
MIN_RETRY_AFTER_CAP_S = 3600.0


@dataclass(frozen=True)
class Verdict:
    """What one attempt came to, before the retry budget is taken into account."""

    status: int | None
    error: str | None
    final: DeliveryState | None  # None: retry if the schedule allows
    retry_after: str | None = None


def classify(status: int, retry_after: str | None) -> Verdict:
    if 200 <= status < 300:
        return Verdict(status, None, DeliveryState.DELIVERED)
    if status == 410:
        return Verdict(status, "HTTP 410: the receiver is gone", DeliveryState.GONE)
    if status == 429 or status >= 500:
        return Verdict(status, f"HTTP {status}", None, retry_after)
    if 300 <= status < 400:
        return Verdict(status, f"HTTP {status}: redirects are not followed", DeliveryState.FAILED)
    return Verdict(status, f"HTTP {status}", DeliveryState.FAILED)


def retry_after_cap_s(schedule: tuple[float, ...]) -> float:
    """The longest wait a ``Retry-After`` may impose. The broker's visibility timeout must
    exceed the longest countdown (see :mod:`webhooks.broker`), so this bounds it."""
    return max([MIN_RETRY_AFTER_CAP_S, *(s * (1 + JITTER) for s in schedule)])


def parse_retry_after(value: str | None, now: float) -> float | None:
    """Seconds to wait from a ``Retry-After`` of delay-seconds or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, when.timestamp() - now)


def next_delay(
    schedule: tuple[float, ...],
    attempts_made: int,
    retry_after_s: float | None,
    rng: random.Random | None = None,
) -> float | None:
    """Seconds until the next attempt, or None when the schedule is used up.

    ``schedule[n-1]`` is the wait after the n-th attempt failed, scaled by +/-20% jitter so
    receivers that failed together are not all retried in the same second; a Retry-After
    longer than that wins (up to :func:`retry_after_cap_s`).
    """
    if attempts_made > len(schedule):
        return None
    factor = (rng or random).uniform(1 - JITTER, 1 + JITTER)
    delay = schedule[attempts_made - 1] * factor
    if retry_after_s is not None:
        delay = max(delay, min(retry_after_s, retry_after_cap_s(schedule)))
    return delay
