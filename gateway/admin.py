"""``/v1/admin``: API keys, dead letters and workers over HTTP, for keys with the ``admin``
scope (the same operations as ``python -m fleet.keys``, ``python -m fleet.deadletters`` and
``celery -A workers.celery_app control fleet_drain``)."""

from __future__ import annotations

import re
from datetime import UTC, datetime

from flask import Blueprint, jsonify, request
from pydantic import BaseModel, ConfigDict, Field
from spectree import Response

from gateway import worker_control
from gateway.errors import APIError
from gateway.extensions import fleet
from gateway.inputs import json_body
from gateway.openapi import ErrorBody, documented
from gateway.serving import resolve_model
from shared.api_keys import Scope

bp = Blueprint("admin", __name__, url_prefix="/v1/admin")
_STREAM_ID = re.compile(r"^\d{1,20}-\d{1,20}$")


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=100)
    scopes: list[Scope] = Field(default=[Scope.JOBS, Scope.BATCHES], min_length=1)
    # strict: `false` is not 0 (which would mean no limit)
    rpm: int | None = Field(
        None, ge=0, strict=True, description="Requests per minute (0: none; null: KEY_RPM)."
    )
    tpm: int | None = Field(
        None, ge=0, strict=True, description="Generated tokens per minute (0: none; null: KEY_TPM)."
    )
    max_queued: int | None = Field(
        None, ge=0, strict=True,
        description="Unfinished interactive jobs (0: no cap; null: KEY_MAX_QUEUED).",
    )  # fmt: skip


class KeyInfo(BaseModel):
    id: str
    object: str = "api_key"
    name: str
    scopes: list[str]
    rpm: int | None
    tpm: int | None
    max_queued: int | None
    created_at: int
    last_used_at: int | None


class CreatedKeyInfo(KeyInfo):
    secret: str = Field(description="The key itself: shown this once, never stored.")


class KeyList(BaseModel):
    object: str = "list"
    data: list[KeyInfo]


class Deleted(BaseModel):
    id: str
    object: str
    deleted: bool


class Worker(BaseModel):
    model_config = ConfigDict(extra="allow")  # and what the worker's heartbeat reports

    name: str
    object: str = "worker"
    model: str


class WorkerList(BaseModel):
    object: str = "list"
    data: list[Worker]


class Draining(BaseModel):
    name: str
    object: str = "worker"
    state: str


class DeadLetter(BaseModel):
    id: str
    object: str = "dead_letter"
    model: str
    job: str
    lane: str
    deliveries: int
    at: str


class DeadLetterList(BaseModel):
    object: str = "list"
    data: list[DeadLetter]


class Requeued(BaseModel):
    id: str
    object: str = "dead_letter"
    requeued: bool
    entry: str | None = Field(description="The job's new stream entry; null if it expired.")


@bp.get("/keys")
@documented(resp=Response(HTTP_200=KeyList), tags=["admin"])
def list_keys():
    """Every API key (never their secrets), oldest first."""
    return jsonify(object="list", data=[key.public() for key in fleet.api_keys.list()])


@bp.post("/keys")
@documented(
    json=KeyCreate,
    resp=Response(
        HTTP_201=CreatedKeyInfo, HTTP_400=ErrorBody, HTTP_415=ErrorBody, HTTP_422=ErrorBody
    ),
    tags=["admin"],
)
def create_key():
    """Make an API key. Its `secret` is in this answer only: keep it."""
    body = KeyCreate.model_validate(json_body())
    created = fleet.api_keys.create(
        body.name, tuple(body.scopes), rpm=body.rpm, tpm=body.tpm, max_queued=body.max_queued
    )
    return jsonify(created.key.public() | {"secret": created.secret}), 201


@bp.delete("/keys/<key_id>")
@documented(resp=Response(HTTP_200=Deleted, HTTP_404=ErrorBody), tags=["admin"])
def revoke_key(key_id: str):
    """Revoke a key: its next request is a 401."""
    if not fleet.api_keys.revoke(key_id):
        raise APIError(404, "api_key_not_found", f"no API key '{key_id}'")
    return jsonify(id=key_id, object="api_key", deleted=True)


@bp.get("/dead_letters")
@documented(resp=Response(HTTP_200=DeadLetterList, HTTP_422=ErrorBody), tags=["admin"])
def list_dead_letters():
    """Jobs whose stream entry killed workers MAX_DELIVERIES times (query `model`: default
    the fleet's)."""
    model = resolve_model(request.args.get("model"))
    letters = [_letter(model, fields) for fields in fleet.dead_letters.list(model)]
    return jsonify(object="list", data=letters)


@bp.post("/dead_letters/<letter_id>/requeue")
@documented(
    resp=Response(HTTP_200=Requeued, HTTP_404=ErrorBody, HTTP_422=ErrorBody), tags=["admin"]
)
def requeue_dead_letter(letter_id: str):
    """Put a dead letter's job back in its lane, once its cause is fixed; a job that has
    expired meanwhile is dropped (`requeued: false`)."""
    model = resolve_model(request.args.get("model"))
    try:
        if not _STREAM_ID.match(letter_id):
            raise KeyError(letter_id)
        entry = fleet.dead_letters.requeue(model, letter_id)
    except KeyError:
        raise APIError(404, "dead_letter_not_found", f"no dead letter '{letter_id}'") from None
    return jsonify(id=letter_id, object="dead_letter", requeued=entry is not None, entry=entry)


@bp.get("/workers")
@documented(resp=Response(HTTP_200=WorkerList), tags=["admin"])
def list_workers():
    """Live workers (a heartbeat within 3 x WORKER_HEARTBEAT_S), with what each reports."""
    max_age = fleet.settings.worker_max_age_s
    data = [
        {"object": "worker", "model": model, **info}
        for model in fleet.served_models()
        for info in fleet.registry.workers(model, max_age)
    ]
    return jsonify(object="list", data=data)


@bp.post("/workers/<name>/drain")
@documented(resp=Response(HTTP_202=Draining, HTTP_404=ErrorBody), tags=["admin"])
def drain_worker(name: str):
    """Drain a worker: it stops reading, finishes and acknowledges its current work, then
    exits (its supervisor or Deployment may start a new one)."""
    if not worker_control.drain(name):
        raise APIError(
            404, "worker_not_found", f"no worker '{name}' answered; see GET /v1/admin/workers"
        )
    return jsonify(name=name, object="worker", state="draining"), 202


def _letter(model: str, fields: dict[str, str]) -> dict[str, object]:
    return {
        "id": fields["id"],
        "object": "dead_letter",
        "model": model,
        "job": fields.get("job", ""),
        "lane": fields.get("lane", "interactive"),
        "deliveries": int(fields.get("deliveries", 0)),
        "at": datetime.fromtimestamp(float(fields.get("at", 0)), UTC).isoformat(),
    }
