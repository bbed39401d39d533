"""Webhook delivery: signed (Standard Webhooks), retried with backoff, SSRF-guarded.

The fleet calls :func:`enqueue_event` and reads outcomes with :func:`deliveries_of`; the
webhook worker (:mod:`webhooks.celery_app`, queue ``webhooks``) makes the attempts.
"""

from webhooks.deliveries import WebhookConfigError, deliveries_of, delivery, enqueue_event
from webhooks.ssrf import UnresolvableURLError, UnsafeURLError, check_url

__all__ = [
    "UnresolvableURLError",
    "UnsafeURLError",
    "WebhookConfigError",
    "check_url",
    "deliveries_of",
    "delivery",
    "enqueue_event",
]
