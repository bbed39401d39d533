"""The webhook worker's Prometheus ``/metrics``, on its own port (WEBHOOK_METRICS_PORT).

``fleet_webhook_deliveries_total{outcome}``, the series the FleetWebhookFailureRateHigh alert
reads (k8s/monitoring): one count per attempt, by what it came to. The counter lives in this
process's default registry; :func:`serve` exposes that registry over HTTP when the worker
starts (k8s/webhooks.yaml declares the port as ``metrics`` for the PodMonitor).
"""

from __future__ import annotations

import logging

from prometheus_client import Counter, start_http_server

from shared.states import DeliveryState

log = logging.getLogger(__name__)

DELIVERIES = Counter(
    "fleet_webhook_deliveries",
    "Webhook delivery attempts, by outcome: delivered, retrying, failed, gone.",
    ["outcome"],
)
_OUTCOME = {DeliveryState.PENDING: "retrying"}


def count(state: DeliveryState) -> None:
    DELIVERIES.labels(outcome=_OUTCOME.get(state, state.value)).inc()


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Serve this process's metrics on ``addr:port`` (0: not at all), from a daemon thread.

    A port already taken is logged, not raised: deliveries matter more than their metrics.
    """
    if not port:
        return
    try:
        start_http_server(port, addr=addr)
    except OSError as exc:
        log.warning("no webhook /metrics: port %s: %s", port, exc)
        return
    log.info("webhook metrics on %s:%d/metrics", addr, port)
