"""A batch as the ``fleet`` command sees it, through either of the fleet's batch APIs.

- :class:`NativeBatches`: ``/v1/batches`` takes the file as it is (``application/x-ndjson``,
  one ``{custom_id, prompt | messages, max_new_tokens, ...}`` per line); results are
  ``GET /v1/batches/{id}/results``.
- :class:`OpenAIBatches`: OpenAI's Files and Batch API under ``/openai/v1``, for files of
  OpenAI batch lines (``{custom_id, method, url, body}``): upload the file, create the
  batch, and at the end download its output file (then its error file).

Both answer a :class:`BatchState`, so the progress view does not care which it follows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

from fleet.cli_http import FleetClient, FleetError

NATIVE, OPENAI = "native", "openai"
OPENAI_ENDED = frozenset({"completed", "failed", "expired", "cancelled"})
NATIVE_ENDED = frozenset({"completed", "cancelled"})


@dataclass(frozen=True)
class BatchState:
    id: str
    api: str  # NATIVE or OPENAI
    status: str
    total: int | None  # None until the server has counted the lines
    succeeded: int
    failed: int
    cancelled: int
    ended: bool
    problem: str = ""  # why a batch failed as a whole (OpenAI: a bad input line)
    raw: dict = field(default_factory=dict, compare=False, repr=False)  # the server's object

    @property
    def finished(self) -> int:
        return self.succeeded + self.failed + self.cancelled


class Batches(Protocol):
    api: str

    def create(self, path: Path, model: str | None, metadata: dict[str, str]) -> BatchState: ...
    def get(self, batch_id: str) -> BatchState: ...
    def cancel(self, batch_id: str) -> BatchState: ...
    def write_results(self, state: BatchState, out: IO[bytes]) -> int: ...
    def parse(self, batch: dict) -> BatchState: ...


def line_format(path: Path) -> str:
    """OPENAI when the first line is an OpenAI batch line (it has ``url`` and ``body``),
    NATIVE otherwise (the server checks every line and names the first bad one)."""
    with path.open("rb") as lines:
        for raw in lines:
            if raw.strip():
                try:
                    first = json.loads(raw)
                except ValueError:
                    return NATIVE
                is_openai = isinstance(first, dict) and "body" in first and "url" in first
                return OPENAI if is_openai else NATIVE
    raise FleetError(f"{path} has no requests (it is empty)")


class NativeBatches:
    api = NATIVE

    def __init__(self, client: FleetClient) -> None:
        self.client = client

    def create(self, path: Path, model: str | None, metadata: dict[str, str]) -> BatchState:
        params = {f"metadata[{k}]": v for k, v in metadata.items()}
        if model:
            params["model"] = model
        with path.open("rb") as body:  # streamed from disk, not read into memory
            batch = self.client.post_json(
                "/v1/batches", data=body, params=params,
                headers={"Content-Type": "application/x-ndjson"},
            )  # fmt: skip
        return self.parse(batch)

    def get(self, batch_id: str) -> BatchState:
        return self.parse(self.client.get_json(f"/v1/batches/{batch_id}"))

    def cancel(self, batch_id: str) -> BatchState:
        return self.parse(self.client.post_json(f"/v1/batches/{batch_id}/cancel"))

    def write_results(self, state: BatchState, out: IO[bytes]) -> int:
        return self.client.download(f"/v1/batches/{state.id}/results", out)

    def parse(self, batch: dict) -> BatchState:
        counts = batch["request_counts"]
        return BatchState(
            id=batch["id"], api=NATIVE, status=batch["status"], total=counts["total"],
            succeeded=counts["completed"], failed=counts["failed"],
            cancelled=counts.get("cancelled", 0), ended=batch["status"] in NATIVE_ENDED,
            raw=batch,
        )  # fmt: skip


class OpenAIBatches:
    api = OPENAI

    def __init__(self, client: FleetClient) -> None:
        self.client = client

    def available(self) -> bool:
        """Whether this fleet serves OpenAI's Files and Batch API (tried, not assumed)."""
        response = self.client.request("GET", "/openai/v1/files", ok=(200, 404, 405),
                                       params={"limit": 1})  # fmt: skip
        return response.status_code == 200

    def create(self, path: Path, model: str | None, metadata: dict[str, str]) -> BatchState:
        if model:
            raise FleetError("--model applies to native files; OpenAI lines name their model")
        if not self.available():
            raise FleetError(
                f"{path} is in OpenAI's batch format ({{custom_id, method, url, body}} lines), "
                f"which needs the OpenAI Files and Batch API (/openai/v1/files, "
                f"/openai/v1/batches), and the fleet at {self.client.url} does not serve it. "
                "Update the fleet, or write the file in the native format: one "
                '{"custom_id", "prompt" or "messages", "max_new_tokens", ...} per line.'
            )
        endpoint = _endpoint(path)
        with path.open("rb") as body:
            uploaded = self.client.post_json(
                "/openai/v1/files", data={"purpose": "batch"},
                files={"file": (path.name, body, "application/jsonl")},
            )  # fmt: skip
        create = {"input_file_id": uploaded["id"], "endpoint": endpoint,
                  "completion_window": "24h"}  # fmt: skip
        if metadata:
            create["metadata"] = metadata
        return self.parse(self.client.post_json("/openai/v1/batches", create))

    def get(self, batch_id: str) -> BatchState:
        return self.parse(self.client.get_json(f"/openai/v1/batches/{batch_id}"))

    def cancel(self, batch_id: str) -> BatchState:
        return self.parse(self.client.post_json(f"/openai/v1/batches/{batch_id}/cancel"))

    def write_results(self, state: BatchState, out: IO[bytes]) -> int:
        """The output file, then the error file: every line has the same shape."""
        batch = self.client.get_json(f"/openai/v1/batches/{state.id}")
        size = 0
        for file_id in (batch.get("output_file_id"), batch.get("error_file_id")):
            if file_id:
                size += self.client.download(f"/openai/v1/files/{file_id}/content", out)
        return size

    def parse(self, batch: dict) -> BatchState:
        counts = batch.get("request_counts") or {}
        status = batch["status"]
        errors = (batch.get("errors") or {}).get("data") or []
        problem = "; ".join(
            (f"line {e['line']}: " if e.get("line") else "") + str(e.get("message", ""))
            for e in errors
        )
        return BatchState(
            id=batch["id"], api=OPENAI, status=status,
            total=counts.get("total") or None, succeeded=counts.get("completed", 0),
            failed=counts.get("failed", 0), cancelled=0, ended=status in OPENAI_ENDED,
            problem=problem, raw=batch,
        )  # fmt: skip


def _endpoint(path: Path) -> str:
    """The ``url`` of the file's first line: OpenAI batches run one endpoint each."""
    with path.open("rb") as lines:
        for raw in lines:
            if raw.strip():
                return json.loads(raw)["url"]
    raise FleetError(f"{path} has no requests (it is empty)")


def find(client: FleetClient, batch_id: str) -> tuple[Batches, BatchState]:
    """The batch ``batch_id`` through the API that made it. OpenAI's is asked first: the
    native API also shows the batches OpenAI's made (one engine), but not in their shape."""
    openai = OpenAIBatches(client)
    response = client.request("GET", f"/openai/v1/batches/{batch_id}", ok=(200, 404, 405))
    if response.status_code == 200:
        return openai, openai.parse(response.json())
    native = NativeBatches(client)
    response = client.request("GET", f"/v1/batches/{batch_id}", ok=(200, 404))
    if response.status_code == 200:
        return native, native.parse(response.json())
    raise FleetError(f"no batch {batch_id} at {client.url} (ended batches are kept RESULT_TTL_S)")
