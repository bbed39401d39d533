"""The autoscaler: reads each model's backlog, decides (:mod:`fleet.scaling`), applies.

Locally, :mod:`fleet.up` runs it on a :class:`fleet.worker_pool.WorkerPool`. In a cluster
without KEDA, ``python -m fleet.autoscaler`` (AUTOSCALER_MODE=kubernetes) patches the
worker Deployment's ``/scale`` with its service account. Every decision is logged with
the numbers behind it, and exported on AUTOSCALER_METRICS_PORT.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Protocol

import redis
import requests
from prometheus_client import Gauge, start_http_server

from fleet.scaling import Load, Policy, decide
from shared.settings import Settings, get_settings
from shared.stats import QueueStats

log = logging.getLogger("fleet.autoscaler")

BACKLOG = Gauge("fleet_autoscaler_backlog", "Backlog the last decision saw.", ["model"])
OLDEST = Gauge("fleet_autoscaler_oldest_job_age_seconds", "Oldest waiting job seen.", ["model"])
CURRENT = Gauge("fleet_autoscaler_workers_current", "Workers before the last decision.", ["model"])
DESIRED = Gauge(
    "fleet_autoscaler_workers_desired", "Workers the last decision asked for.", ["model"]
)


class Scaler(Protocol):
    max_workers: int

    def count(self) -> int: ...
    def scale_to(self, n: int) -> None: ...


class Autoscaler:
    def __init__(self, settings: Settings, stats: QueueStats, scaler: Scaler) -> None:
        self.model = settings.served_model
        self.stats = stats
        self.scaler = scaler
        self.policy = Policy(
            settings.target_backlog_per_worker,
            min(settings.min_workers, scaler.max_workers),
            scaler.max_workers,
            settings.scale_down_cooldown_s,
        )
        self.interval_s = settings.autoscaler_interval_s
        self.low_since: float | None = None
        self._next = 0.0

    def tick(self) -> None:
        """Decide now if the interval has passed; Redis being away skips a round."""
        if time.monotonic() < self._next:
            return
        self._next = time.monotonic() + self.interval_s
        try:
            depth = self.stats.backlog(self.model)
            load = Load(depth.total, depth.oldest_age_s)
        except redis.RedisError as exc:
            log.warning("autoscaler: no backlog reading (%s); keeping the workers", exc)
            return
        current = self.scaler.count()
        decision = decide(current, load, self.policy, time.monotonic(), self.low_since)
        self.low_since = decision.low_since
        for gauge, value in ((BACKLOG, load.backlog), (OLDEST, load.oldest_age_s),
                             (CURRENT, current), (DESIRED, decision.desired)):  # fmt: skip
            gauge.labels(self.model).set(value)
        if decision.desired != current:
            log.info(
                "autoscale %s: backlog=%d oldest=%.1fs workers %d -> %d (%s; target %d/worker,"
                " min %d, max %d)", self.model, load.backlog, load.oldest_age_s, current,
                decision.desired, decision.reason, self.policy.target_backlog_per_worker,
                self.policy.min_workers, self.policy.max_workers,
            )  # fmt: skip
            self.scaler.scale_to(decision.desired)


class DeploymentScaler:
    """Scales a Deployment through the Kubernetes API's /scale subresource (in-cluster)."""

    SA = Path("/var/run/secrets/kubernetes.io/serviceaccount")

    def __init__(self, settings: Settings) -> None:
        namespace = settings.autoscaler_namespace or (self.SA / "namespace").read_text().strip()
        self.url = (
            "https://kubernetes.default.svc/apis/apps/v1/namespaces/"
            f"{namespace}/deployments/{settings.autoscaler_deployment}/scale"
        )
        self.max_workers = settings.max_workers or 1
        self.session = requests.Session()
        self.session.verify = str(self.SA / "ca.crt")

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {(self.SA / 'token').read_text().strip()}"}

    def count(self) -> int:
        response = self.session.get(self.url, headers=self._headers(), timeout=10)
        response.raise_for_status()
        return int(response.json()["spec"].get("replicas", 0))

    def scale_to(self, n: int) -> None:
        headers = self._headers() | {"Content-Type": "application/merge-patch+json"}
        response = self.session.patch(
            self.url, json={"spec": {"replicas": n}}, headers=headers, timeout=10
        )
        response.raise_for_status()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = get_settings()
    if settings.autoscaler_mode != "kubernetes":
        print("python -m fleet.autoscaler runs in a cluster (AUTOSCALER_MODE=kubernetes); "
              "`make up` scales local workers itself.", file=sys.stderr)  # fmt: skip
        return 2
    if settings.autoscaler_metrics_port:
        start_http_server(settings.autoscaler_metrics_port)
    autoscaler = Autoscaler(
        settings, QueueStats.from_settings(settings), DeploymentScaler(settings)
    )
    while True:
        try:
            autoscaler.tick()
        except requests.RequestException as exc:
            log.warning("kubernetes API: %s", exc)
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())
