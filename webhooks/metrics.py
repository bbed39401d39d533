"""``fleet_webhook_deliveries_total{outcome}``, the series the FleetWebhookFailureRateHigh
alert reads (k8s/monitoring): one count per attempt, by what it came to.

The counter lives in this process's default registry; serving it over HTTP (a port for the
webhook worker) is left to whoever wires the worker into ``make up`` and Kubernetes.
"""

from __future__ import annotations

from prometheus_client import Counter

from webhooks.store import State

DELIVERIES = Counter(
    "fleet_webhook_deliveries",
    "Webhook delivery attempts, by outcome: delivered, retrying, failed, gone.",
    ["outcome"],
)
_OUTCOME = {State.PENDING: "retrying"}


def count(state: State) -> None:
    DELIVERIES.labels(outcome=_OUTCOME.get(state, state.value)).inc()
