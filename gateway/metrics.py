"""Prometheus ``/metrics`` for the gateway.

Two kinds of series:

* per gateway process: ``fleet_http_request_duration_seconds``. Under gunicorn the
  processes share them through prometheus_client's multiprocess mode
  (PROMETHEUS_MULTIPROC_DIR, set up in ``gateway/gunicorn_conf.py``).
* fleet-wide, read from Redis at scrape time by :class:`FleetCollector`: jobs submitted
  and finished, end-to-end latency and queue-wait histograms (recorded atomically by the
  queue scripts; interactive jobs only), batch requests submitted and finished, backlog
  and age of the oldest waiting job per lane, ready workers, dead letters, and the result
  cache (hits, misses, coalesced requests, evictions, bytes).
  Every gateway replica reports the same values: aggregate them with ``max``, not ``sum``.
"""

from __future__ import annotations

import os
import time

from flask import Blueprint, Flask, Response, g, request
from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from gateway import auth
from gateway.errors import APIError
from gateway.extensions import Fleet, fleet
from shared.states import LANES, TERMINAL_STATUSES
from shared.stats import LATENCY_BUCKETS, bucket_name

HTTP_LATENCY = Histogram(
    "fleet_http_request_duration_seconds",
    "Gateway HTTP request latency.",
    ["route", "method", "status"],
)

CACHE_COUNTERS = {
    "hits": "Requests answered from the result cache.",
    "misses": "Cacheable requests that ran (each leads the identical ones that follow it).",
    "coalesced": "Requests that followed an identical queued or running job.",
    "evictions": "Cached results evicted to stay under CACHE_MAX_BYTES.",
    "expired": "Cached results past CACHE_TTL_S, forgotten.",
}

bp = Blueprint("metrics", __name__)


@bp.get("/metrics")
def metrics() -> Response:
    if not auth.metrics_allowed():
        raise APIError(
            401, "invalid_metrics_token", "/metrics needs 'Authorization: Bearer <METRICS_TOKEN>'",
            headers={"WWW-Authenticate": 'Bearer realm="metrics"'},
        )  # fmt: skip
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    else:
        registry = REGISTRY
    body = generate_latest(registry) + generate_latest(_fleet_registry(fleet._get_current_object()))
    return Response(body, mimetype="text/plain; version=0.0.4; charset=utf-8")


def _fleet_registry(state: Fleet) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(state))
    return registry


def init_app(app: Flask) -> None:
    app.register_blueprint(bp)

    @app.before_request
    def _start_timer() -> None:
        g.request_started = time.perf_counter()

    @app.after_request
    def _observe(response):
        started = g.pop("request_started", None)
        if started is not None:
            route = request.url_rule.rule if request.url_rule else "unmatched"
            HTTP_LATENCY.labels(route, request.method, str(response.status_code)).observe(
                time.perf_counter() - started
            )
        return response


class FleetCollector:
    """Reads the fleet's job statistics from Redis at each scrape."""

    def __init__(self, state: Fleet) -> None:
        self.state = state

    def collect(self):
        stats, registry = self.state.stats, self.state.registry
        max_age = self.state.settings.worker_max_age_s
        submitted = CounterMetricFamily(
            "fleet_jobs_submitted", "Jobs accepted by the gateway.", labels=["model"]
        )
        finished = CounterMetricFamily(
            "fleet_jobs_finished", "Jobs that reached a terminal state.", labels=["model", "status"]
        )
        latency = HistogramMetricFamily(
            "fleet_job_latency_seconds", "Submit to terminal state.", labels=["model"]
        )
        wait = HistogramMetricFamily(
            "fleet_job_queue_wait_seconds", "Submit to start of inference.", labels=["model"]
        )
        batch_submitted = CounterMetricFamily(
            "fleet_batch_requests_submitted", "Batch requests accepted.", labels=["model"]
        )
        batch_finished = CounterMetricFamily(
            "fleet_batch_requests_finished",
            "Batch requests that reached a terminal state.",
            labels=["model", "status"],
        )
        backlog = GaugeMetricFamily(
            "fleet_queue_backlog",
            "Stream entries not yet done, by lane (interactive, batch).",
            labels=["model", "lane", "state"],
        )
        oldest = GaugeMetricFamily(
            "fleet_queue_oldest_job_age_seconds",
            "Age of the oldest unread job, by lane.",
            labels=["model", "lane"],
        )
        ready = GaugeMetricFamily(
            "fleet_workers_ready", "Workers with the model loaded.", labels=["model"]
        )
        dead = GaugeMetricFamily("fleet_dead_letters", "Dead-lettered entries.", labels=["model"])
        cache = {
            name: CounterMetricFamily(f"fleet_cache_{name}", help_, labels=["model"])
            for name, help_ in CACHE_COUNTERS.items()
        }
        cache_bytes = GaugeMetricFamily(
            "fleet_cache_bytes",
            "Bytes of cached results (counted as the scripts keep CACHE_MAX_BYTES).",
            labels=["model"],
        )
        for model in self.state.served_models():
            counters = stats.counters(model)
            submitted.add_metric([model], float(counters.get("submitted", 0)))
            for status in sorted(TERMINAL_STATUSES):
                finished.add_metric([model, status], float(counters.get(f"finished:{status}", 0)))
            latency.add_metric([model], *_histogram(counters, "latency"))
            wait.add_metric([model], *_histogram(counters, "wait"))
            batch_submitted.add_metric([model], float(counters.get("batch:submitted", 0)))
            for status in sorted(TERMINAL_STATUSES):
                count = float(counters.get(f"batch:finished:{status}", 0))
                batch_finished.add_metric([model, status], count)
            for lane in LANES:
                depth = stats.backlog(model, lane)
                backlog.add_metric([model, lane, "undelivered"], depth.undelivered)
                backlog.add_metric([model, lane, "pending"], depth.pending)
                oldest.add_metric([model, lane], depth.oldest_age_s)
            ready.add_metric([model], registry.ready_workers(model, max_age))
            dead.add_metric([model], stats.dead_letter_count(model))
            for name, family in cache.items():
                family.add_metric([model], float(counters.get(f"cache:{name}", 0)))
            cache_bytes.add_metric([model], max(0.0, float(counters.get("cache:bytes", 0))))
        yield from (
            submitted, finished, latency, wait, batch_submitted, batch_finished,
            backlog, oldest, ready, dead, *cache.values(), cache_bytes,
        )  # fmt: skip


def _histogram(counters: dict[str, str], name: str) -> tuple[list[tuple[str, float]], float]:
    """Cumulative buckets and sum from the stats hash's per-bucket counts."""
    buckets, total = [], 0.0
    for bound in LATENCY_BUCKETS:
        total += float(counters.get(f"{name}:{bucket_name(bound)}", 0))
        buckets.append((str(float(bound)), total))
    total += float(counters.get(f"{name}:+Inf", 0))
    buckets.append(("+Inf", total))
    return buckets, float(counters.get(f"{name}:sum", 0))
