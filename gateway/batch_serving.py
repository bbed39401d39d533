"""Batches, whichever API they came through: check every request, create all or none,
find, results, cancel. The routes in :mod:`gateway.batches` only speak HTTP."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from gateway import auth, serving
from gateway.errors import APIError
from gateway.extensions import fleet
from gateway.inputs import cache_allowed
from gateway.serving import check_webhook, idempotency_errors, resolve_model
from shared.batch_lines import BadRequestLine, check_requests, parse_jsonl
from shared.batch_store import SubmittedBatch
from shared.protocol import Batch, BatchOptions, BatchRequest, is_batch_id
from shared.states import Lane
from webhooks import deliveries_of


def requests_from_jsonl(body: bytes) -> list[BatchRequest]:
    """Every line checked; a 422 naming the first bad ``line`` and field otherwise."""
    return _checked(parse_jsonl(body), jsonl=True)


def requests_from_list(items: list[Any]) -> list[BatchRequest]:
    """Every item checked; a 422 naming the first bad ``index`` and field otherwise."""
    return _checked(enumerate(items), jsonl=False)


def _checked(items: Iterable[tuple[int, Any]], *, jsonl: bool) -> list[BatchRequest]:
    settings = fleet.settings
    try:
        return check_requests(
            items, jsonl=jsonl, max_requests=settings.batch_max_requests,
            max_new_tokens_limit=settings.max_new_tokens_limit,
        )  # fmt: skip
    except BadRequestLine as bad:
        located = {k: v for k, v in (("line", bad.line), ("index", bad.index)) if v is not None}
        raise APIError(422, "invalid_request", str(bad), param=bad.param, **located) from None


def create(
    requests: list[BatchRequest],
    options: BatchOptions,
    idempotency_key: str | None,
    request_fingerprint: str,
    *,
    timeout_s: float | None = None,
    extra: dict[str, str] | None = None,
) -> SubmittedBatch:
    """Queue every request of the batch, or none. Greedy or seeded lines use the result
    cache and follow identical lines: each distinct one is computed once. ``timeout_s`` and
    ``extra``: see BatchStore.create."""
    model = resolve_model(options.model)
    check_webhook(options.webhook)
    check_room(model, len(requests))
    allowed, key = cache_allowed(), auth.caller()
    with idempotency_errors("batch"):
        return fleet.batches.create(
            model, requests, options,
            idempotency_key=idempotency_key, fingerprint=request_fingerprint,
            cache_owners=[fleet.cache.owner(r, r.cache and allowed, key.id) for r in requests],
            owner=key.id, timeout_s=timeout_s, extra=extra,
        )  # fmt: skip


def check_room(model: str, count: int) -> None:
    """429 when ``count`` more requests would pass BATCH_MAX_QUEUE_DEPTH."""
    backlog = fleet.stats.backlog(model, Lane.BATCH).total
    limit = fleet.settings.batch_max_queue_depth
    if backlog + count > limit:
        raise APIError(
            429, "queue_full",
            f"model '{model}' has {backlog} batch requests queued; {count} more would pass "
            f"BATCH_MAX_QUEUE_DEPTH {limit}; retry later",
            headers={"Retry-After": "60"},
        )  # fmt: skip


def find(batch_id: str) -> Batch:
    """The batch, whichever served model it belongs to; 404 if none has it."""
    return serving.find("batch", batch_id, is_batch_id, fleet.batches.get)


def results(batch: Batch) -> Iterator[str]:
    return fleet.batches.results(batch.model, batch.id)


def cancel(batch_id: str) -> Batch:
    """Cancel what has not started; 409 if the batch already ended."""
    before = find(batch_id)
    if before.status.ended:
        raise APIError(409, "batch_already_ended", f"batch {batch_id} is already {before.status}")
    return fleet.batches.cancel(before.model, batch_id) or before


def webhook_deliveries(batch_id: str) -> list[dict[str, Any]]:
    find(batch_id)
    return deliveries_of(batch_id, fleet.settings)
