"""Reading a submitted batch: JSONL lines or a JSON list, every request checked first.

Every request is validated before anything is stored, and the first bad one is reported by
its line (JSONL) or index (JSON), with the field: a batch is queued whole or not at all.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from shared.protocol import BatchRequest


@dataclass(frozen=True)
class BadRequestLine(Exception):
    """A request of the batch is invalid; ``where`` is 'line N' or 'requests[N]'."""

    where: str
    param: str | None
    message: str
    line: int | None = None
    index: int | None = None

    def __str__(self) -> str:
        field = f"'{self.param}': " if self.param else ""
        return f"{self.where}: {field}{self.message}"


def parse_jsonl(body: bytes) -> Iterable[tuple[int, Any]]:
    """(line number, parsed JSON) for each non-blank line; a line that is not JSON raises."""
    for number, raw in enumerate(body.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            yield number, json.loads(raw, parse_constant=_reject_constant)
        except (ValueError, UnicodeDecodeError) as exc:
            where = f"line {number}"
            raise BadRequestLine(where, None, f"not valid JSON: {exc}", line=number) from None


def check_requests(
    items: Iterable[tuple[int, Any]], *, jsonl: bool, max_requests: int, max_new_tokens_limit: int
) -> list[BatchRequest]:
    """Validate every request and the uniqueness of custom_ids; raise on the first bad one.

    ``items`` are (line number, value) for JSONL, (index, value) for a JSON list.
    """
    context = {"max_new_tokens_limit": max_new_tokens_limit}
    requests: list[BatchRequest] = []
    seen: dict[str, int] = {}
    for position, item in items:
        where = f"line {position}" if jsonl else f"requests[{position}]"
        located = {"line": position} if jsonl else {"index": position}
        if len(requests) >= max_requests:
            raise BadRequestLine(
                where, None, f"a batch holds at most {max_requests} requests (BATCH_MAX_REQUESTS)",
                **located,
            )  # fmt: skip
        if not isinstance(item, dict):
            raise BadRequestLine(where, None, "must be a JSON object", **located)
        try:
            request = BatchRequest.model_validate(item, context=context)
        except ValidationError as exc:
            err = exc.errors(include_url=False, include_input=False)[0]
            param = ".".join(str(part) for part in err["loc"]) or None
            raise BadRequestLine(
                where, param, err["msg"].removeprefix("Value error, "), **located
            ) from None
        if request.custom_id in seen:
            first = seen[request.custom_id]
            raise BadRequestLine(
                where, "custom_id",
                f"'{request.custom_id}' is used twice (first at "
                f"{'line ' if jsonl else 'requests['}{first}{'' if jsonl else ']'})",
                **located,
            )  # fmt: skip
        seen[request.custom_id] = position
        requests.append(request)
    if not requests:
        raise BadRequestLine("body", None, "a batch needs at least one request")
    return requests


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")
