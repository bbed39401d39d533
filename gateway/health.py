"""Liveness, readiness and the list of served models."""

from __future__ import annotations

import redis
from flask import Blueprint, jsonify
from pydantic import BaseModel
from spectree import Response

from gateway.extensions import fleet
from gateway.openapi import ErrorBody, documented

bp = Blueprint("health", __name__)


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    ready_workers: int
    queued: int
    running: int


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


@bp.get("/healthz")
def healthz():
    """The gateway process is alive (it does not look at Redis or workers)."""
    return jsonify(status="ok")


@bp.get("/readyz")
def readyz():
    """Redis is reachable and at least one worker has its model loaded."""
    try:
        fleet.registry.redis.ping()
        max_age = fleet.settings.worker_max_age_s
        ready = {m: fleet.registry.ready_workers(m, max_age) for m in fleet.served_models()}
    except redis.RedisError as exc:
        return jsonify(status="unavailable", reason=f"redis unreachable: {exc}"), 503
    if not any(ready.values()):
        return jsonify(
            status="unavailable", reason="no worker has its model loaded", workers=ready
        ), 503
    return jsonify(status="ready", workers=ready)


@bp.get("/v1/models")
@documented(resp=Response(HTTP_200=ModelList, HTTP_503=ErrorBody), tags=["models"])
def list_models():
    """Models this fleet serves, with their ready workers and backlog."""
    cards = []
    for model in fleet.served_models():
        backlog = fleet.stats.backlog(model)
        cards.append(
            ModelCard(
                id=model,
                ready_workers=fleet.registry.ready_workers(model, fleet.settings.worker_max_age_s),
                queued=backlog.undelivered,
                running=backlog.pending,
            )
        )
    return jsonify(ModelList(data=cards).model_dump())
