"""``GET /v1/fleet``: the fleet at a glance as JSON, for the console's Fleet page.

The same sources as ``make status`` (:mod:`fleet.status`) and ``/metrics``: the workers'
heartbeats, the backlog of each lane, dead letters, and the queue's list of the last ended
jobs, summed up over the last minute. Any valid key may read it (it names no job).
"""

from __future__ import annotations

import time

from flask import Blueprint, jsonify
from pydantic import BaseModel, Field
from spectree import Response

from gateway.extensions import fleet
from gateway.openapi import ErrorBody, documented
from shared.states import LANES
from shared.stats import recent_jobs

bp = Blueprint("fleet_view", __name__)
WINDOW_S = 60


class LaneBacklog(BaseModel):
    waiting: int = Field(description="Entries not yet read by any worker.")
    running: int = Field(description="Entries read and not yet acknowledged.")
    oldest_waiting_s: float = Field(description="Age of the oldest waiting entry (0: none).")


class Recent(BaseModel):
    window_s: int
    jobs: int = Field(description="Interactive jobs that ended in the window.")
    jobs_per_second: float
    failed: int = Field(description="Of those, the ones that did not succeed.")
    latency_p50_s: float | None = Field(description="Submit to end; null: no job ended.")
    latency_p95_s: float | None


class ModelFleet(BaseModel):
    id: str
    ready_workers: int
    lanes: dict[str, LaneBacklog]
    dead_letters: int
    recent: Recent


class FleetView(BaseModel):
    object: str = "fleet"
    at: float = Field(description="Server time (unix seconds) of these numbers.")
    models: list[ModelFleet]


@bp.get("/v1/fleet")
@documented(resp=Response(HTTP_200=FleetView, HTTP_503=ErrorBody), tags=["models"])
def fleet_view():
    """Per served model: ready workers, the backlog of each lane with its oldest waiting
    job, dead letters, and the last minute's interactive throughput and latency."""
    now = time.time()
    models = [_model(model, now) for model in fleet.served_models()]
    return jsonify(FleetView(at=now, models=models).model_dump())


def _model(model: str, now: float) -> ModelFleet:
    lanes = {}
    for lane in LANES:
        backlog = fleet.stats.backlog(model, lane)
        lanes[lane.value] = LaneBacklog(
            waiting=backlog.undelivered,
            running=backlog.pending,
            oldest_waiting_s=round(backlog.oldest_age_s, 3),
        )
    return ModelFleet(
        id=model,
        ready_workers=fleet.registry.ready_workers(model, fleet.settings.worker_max_age_s),
        lanes=lanes,
        dead_letters=fleet.stats.dead_letter_count(model),
        recent=_recent(fleet.stats.recent(model), now),
    )


def _recent(rows: list[tuple[float, float, str]], now: float) -> Recent:
    summary = recent_jobs(rows, now, WINDOW_S)
    return Recent(
        window_s=WINDOW_S,
        jobs=summary.jobs,
        jobs_per_second=round(summary.jobs_per_second, 4),
        failed=summary.failed,
        latency_p50_s=_rounded(summary.latency_p50_s),
        latency_p95_s=_rounded(summary.latency_p95_s),
    )


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 4)
