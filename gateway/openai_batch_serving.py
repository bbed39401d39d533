"""OpenAI's Files and Batch API on the fleet's native batches: upload, create (the input
file checked line by line, then one native batch, all or nothing), read, list, cancel,
and the output and error files.

An OpenAI batch *is* a native batch (the same id, lane, workers, webhooks; see
:mod:`shared.openai_batches`): nothing runs twice, and ``/v1/batches/{id}`` shows it too.
Its output and error files are not stored: they are made from the native batch's results
whenever they are read (the same bytes every time: ids derive from the jobs' ids,
``created`` is the batch's creation time), and their sizes and the batch's usage are
computed once, on the first read after the batch ended. Lines are in the order requests
ended, as OpenAI's may be; match them by ``custom_id``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from flask import request
from werkzeug.datastructures import FileStorage

from gateway import auth, batch_serving
from gateway.extensions import fleet
from gateway.inputs import idempotency_key
from gateway.openai_batch_protocol import (
    CANCELLED_ERROR,
    ERRORS,
    EXPIRED_ERROR,
    OUTPUT,
    BatchCreateBody,
    batch_object,
    completion_id,
    cursor_list,
    dumps,
    file_object,
    output_line,
    parse_generated_file_id,
    parse_input_file,
    unrun_line,
    usage_of,
    window_of,
)
from gateway.openai_protocol import InvalidRequest, chat_completion, completion
from gateway.openai_serving import OpenAIError, failure
from shared import openai_batches as ob
from shared.file_store import is_file_id
from shared.idempotency import fingerprint
from shared.openai_batch_store import Record
from shared.owner_index import UnknownCursor
from shared.protocol import BatchOptions, Job, JobError, Output, is_batch_id
from shared.states import JobStatus

FORM_OVERHEAD_BYTES = 65_536  # multipart boundaries and the other fields, past the file
PURPOSES = ("batch",)
EXPIRES_AFTER_MIN_S = 3600  # as OpenAI's


def _not_found(kind: str, object_id: str) -> OpenAIError:
    return OpenAIError(
        404, f"No {kind} found with id '{object_id}' (unknown, expired, or another key's)",
        "invalid_request_error", f"{kind}_not_found",
    )  # fmt: skip


# --- files -------------------------------------------------------------------------------


def upload() -> dict[str, Any]:
    """Store the multipart upload (``file``, ``purpose``, optional ``expires_after``)."""
    limit = fleet.settings.files_max_bytes
    request.max_content_length = limit + FORM_OVERHEAD_BYTES  # werkzeug: 413 past it
    form, uploaded = request.form, request.files.get("file")
    expected = {"file", "purpose", "expires_after[anchor]", "expires_after[seconds]"}
    for name in [*form, *request.files]:
        if name not in expected:
            raise InvalidRequest(name, f"Unrecognized parameter '{name}'", "unknown_parameter")
    if uploaded is None:
        raise InvalidRequest(
            "file", "Missing required parameter: 'file'", "missing_required_parameter"
        )
    purpose = form.get("purpose")
    if purpose is None:
        raise InvalidRequest(
            "purpose", "Missing required parameter: 'purpose'", "missing_required_parameter"
        )
    if purpose not in PURPOSES:
        raise InvalidRequest(
            "purpose", f"purpose '{purpose}' is not supported here; only 'batch'",
            "unsupported_value",
        )  # fmt: skip
    content = _read(uploaded, limit)
    meta = fleet.files.create(
        auth.caller().id, uploaded.filename or "file.jsonl", purpose, content, _expires_after()
    )
    return _uploaded_object(meta)


def _read(uploaded: FileStorage, limit: int) -> bytes:
    content = uploaded.stream.read(limit + 1)
    if len(content) > limit:
        raise OpenAIError(
            413, f"the file is larger than {limit} bytes (FILES_MAX_BYTES)",
            "invalid_request_error", "file_too_large",
        )  # fmt: skip
    return content


def _expires_after() -> int | None:
    """Seconds from ``expires_after`` (anchor ``created_at``), at most FILES_TTL_S."""
    anchor = request.form.get("expires_after[anchor]")
    seconds = request.form.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise InvalidRequest("expires_after.anchor", "expires_after.anchor must be 'created_at'")
    most = fleet.settings.files_ttl_s
    if seconds is None or not seconds.isdigit() or not EXPIRES_AFTER_MIN_S <= int(seconds) <= most:
        raise InvalidRequest(
            "expires_after.seconds",
            f"expires_after.seconds must be {EXPIRES_AFTER_MIN_S} to {most} (FILES_TTL_S)",
        )
    return int(seconds)


def _uploaded_object(meta: dict[str, Any]) -> dict[str, Any]:
    return file_object(
        meta["id"], meta["filename"], meta["purpose"], meta["bytes"], meta["created_at"],
        meta["expires_at"],
    )  # fmt: skip


def file_meta(file_id: str) -> dict[str, Any]:
    """An uploaded file's object, or a batch's output or error file's."""
    generated = parse_generated_file_id(file_id)
    if generated is not None:
        model, record, kind = _generated(file_id, *generated)
        summary = _summary(model, record)
        ended = ob.ended_at(record) or 0.0
        return file_object(
            file_id, f"{record['id']}_{kind}.jsonl", "batch_output",
            summary[f"{kind}_bytes"], ended, ended + fleet.settings.result_ttl_s,
        )  # fmt: skip
    meta = fleet.files.get(file_id, auth.visible_owner()) if is_file_id(file_id) else None
    if meta is None:
        raise _not_found("file", file_id)
    return _uploaded_object(meta)


def file_content(file_id: str) -> Iterator[bytes]:
    generated = parse_generated_file_id(file_id)
    if generated is not None:
        model, record, kind = _generated(file_id, *generated)
        return (line.encode() for line in _lines(model, record, kind))
    content = fleet.files.content(file_id, auth.visible_owner()) if is_file_id(file_id) else None
    if content is None:
        raise _not_found("file", file_id)
    return iter([content])


def delete_file(file_id: str) -> dict[str, Any]:
    generated = parse_generated_file_id(file_id)
    if generated is not None:
        model, record, kind = _generated(file_id, *generated)
        fleet.openai_batches.delete_file(model, record["id"], kind)
    elif not (is_file_id(file_id) and fleet.files.delete(file_id, auth.visible_owner())):
        raise _not_found("file", file_id)
    return {"id": file_id, "object": "file", "deleted": True}


def list_files(args: dict[str, str]) -> dict[str, Any]:
    """The caller's uploaded files (generated ones are reached through their batch)."""
    limit = _limit(args, default=10_000, most=10_000)
    order = args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("order", "order must be 'asc' or 'desc'")
    try:
        metas, more = fleet.files.page(
            auth.caller().id, args.get("after"), limit, order == "desc", args.get("purpose")
        )
    except UnknownCursor:
        raise InvalidRequest("after", f"no file '{args.get('after')}' to list after") from None
    return cursor_list([_uploaded_object(m) for m in metas], more)


def _generated(file_id: str, batch_id: str, kind: str) -> tuple[str, Record, str]:
    """The ended batch a generated file comes from; 404 while it runs, or when it has no
    such lines, or the client deleted the file."""
    try:
        model, record = _find(batch_id)
    except OpenAIError:
        raise _not_found("file", file_id) from None
    shown = batch_object(record, None)
    if file_id not in (shown["output_file_id"], shown["error_file_id"]):
        raise _not_found("file", file_id)
    return model, record, kind


# --- output and error lines --------------------------------------------------------------


def _lines(model: str, record: Record, kind: str) -> Iterator[str]:
    """The output (``kind`` OUTPUT) or error lines of an ended batch, from its results."""
    chat = record[ob.ENDPOINT] == "/v1/chat/completions"
    created = int(float(record["created_at"]))
    for raw in fleet.batches.results(model, record["id"]):
        result = json.loads(raw)
        status = JobStatus(result["status"])
        if (status == JobStatus.SUCCEEDED) != (kind == OUTPUT):
            continue
        yield dumps(_line(model, chat, created, result, status)) + "\n"


def _line(model: str, chat: bool, created: int, result: dict, status: JobStatus) -> dict:
    job_id, custom_id = result["job_id"], result["custom_id"]
    if status == JobStatus.EXPIRED:
        return unrun_line(job_id, custom_id, EXPIRED_ERROR)
    if status == JobStatus.CANCELED:
        return unrun_line(job_id, custom_id, CANCELLED_ERROR)
    job = Job.model_construct(
        id=job_id, status=status, model=model,
        output=Output.model_validate(result["output"]) if result.get("output") else None,
        error=JobError.model_validate(result["error"]) if result.get("error") else None,
    )  # fmt: skip
    if status == JobStatus.SUCCEEDED:
        cid = completion_id(job_id, chat)
        body = chat_completion(cid, created, model, [job]) if chat else completion(
            cid, created, model, [job]
        )  # fmt: skip
        return output_line(job_id, custom_id, 200, body)
    answer = failure(job)  # the status and body /chat/completions would have answered
    return output_line(job_id, custom_id, answer.status, answer.openai_body())


def _summary(model: str, record: Record) -> dict[str, Any]:
    """Sizes of the ended batch's files and its usage: computed from its results on the
    first read after it ended, then kept in its record."""
    summary = fleet.openai_batches.summary(record)
    if summary is not None:
        return summary
    sizes = {OUTPUT: 0, ERRORS: 0}
    prompt_tokens = completion_tokens = 0
    for kind in (OUTPUT, ERRORS):
        for line in _lines(model, record, kind):
            sizes[kind] += len(line.encode())
            if kind == OUTPUT:
                usage = json.loads(line)["response"]["body"]["usage"]
                prompt_tokens += usage["prompt_tokens"]
                completion_tokens += usage["completion_tokens"]
    summary = {
        "output_bytes": sizes[OUTPUT],
        "errors_bytes": sizes[ERRORS],
        "usage": usage_of(prompt_tokens, completion_tokens),
    }
    fleet.openai_batches.save_summary(model, record, summary)
    return summary


# --- batches -----------------------------------------------------------------------------


def create(raw: dict[str, Any]) -> dict[str, Any]:
    """Check the input file line by line (a 400 names the first bad line), then queue it
    as one native batch, all or nothing, every request with the window as its deadline."""
    body = BatchCreateBody.model_validate(raw)
    settings = fleet.settings
    window_s = window_of(body, settings.openai_batch_short_windows)
    file_id = body.input_file_id
    owner = auth.visible_owner()
    meta = fleet.files.get(file_id, owner) if is_file_id(file_id) else None
    content = fleet.files.content(file_id, owner) if meta is not None else None
    if meta is None or content is None:
        raise _not_found("file", file_id)
    if meta["purpose"] != "batch":
        raise InvalidRequest("input_file_id", f"file '{file_id}' is not a 'batch' file")
    parsed = parse_input_file(
        content, body.endpoint, served_models=fleet.served_models(),
        max_new_tokens_limit=settings.max_new_tokens_limit,
        max_requests=settings.batch_max_requests,
    )  # fmt: skip
    options = BatchOptions(model=parsed.model, webhook=body.webhook, metadata=body.metadata or {})
    extra = {ob.ENDPOINT: body.endpoint, ob.INPUT_FILE: file_id, ob.WINDOW: body.completion_window}
    key = idempotency_key()
    submitted = batch_serving.create(
        parsed.requests, options, key, fingerprint(raw) if key else "",
        timeout_s=window_s, extra=extra,
    )  # fmt: skip
    batch_id = submitted.batch.id
    record = fleet.openai_batches.get(parsed.model, batch_id)
    if record is None:  # a replayed Idempotency-Key named a native batch
        raise OpenAIError(
            409, f"Idempotency-Key names batch {batch_id}, made through /v1/batches",
            "invalid_request_error", "idempotency_key_reused",
        )  # fmt: skip
    fleet.openai_batches.add(auth.caller().id, batch_id, float(record["created_at"]))
    return _object(parsed.model, record)


def retrieve(batch_id: str) -> dict[str, Any]:
    return _object(*_find(batch_id))


def list_batches(args: dict[str, str]) -> dict[str, Any]:
    """The caller's batches made through this API, newest first."""
    limit = _limit(args, default=20, most=100)
    model = fleet.settings.served_model
    try:
        records, more = fleet.openai_batches.page(model, auth.caller().id, args.get("after"), limit)
    except UnknownCursor:
        raise InvalidRequest("after", f"no batch '{args.get('after')}' to list after") from None
    return cursor_list([_object(model, r) for r in records], more)


def cancel(batch_id: str) -> dict[str, Any]:
    """Requests not started end at once, running ones finish: ``cancelling``, then
    ``cancelled``. A batch that ended is a 400."""
    model, record = _find(batch_id)
    status = ob.status_of(record)
    if status in ob.ENDED:
        raise InvalidRequest(None, f"batch {batch_id} is already {status}", "batch_already_ended")
    fleet.batches.cancel(model, batch_id)
    return _object(model, fleet.openai_batches.get(model, batch_id) or record)


def _find(batch_id: str) -> tuple[str, Record]:
    """The caller's OpenAI batch (any served model), expired on the way if its window
    passed; 404 if it has none by that id."""
    if is_batch_id(batch_id):
        owner = auth.visible_owner()
        for model in fleet.served_models():
            record = fleet.openai_batches.get(model, batch_id, owner)
            if record is not None:
                return model, fleet.openai_batches.expire_if_due(model, record)
    raise _not_found("batch", batch_id)


def _object(model: str, record: Record) -> dict[str, Any]:
    ended = ob.status_of(record) in ob.ENDED
    return batch_object(record, _summary(model, record) if ended else None)


def _limit(args: dict[str, str], default: int, most: int) -> int:
    text = args.get("limit")
    if text is None:
        return default
    if not text.isdigit() or not 1 <= int(text) <= most:
        raise InvalidRequest("limit", f"limit must be 1 to {most}")
    return int(text)
