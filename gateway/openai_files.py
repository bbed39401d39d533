"""OpenAI's Files API under ``/openai/v1``: ``client.files.create / retrieve / list /
content / delete``, for batch input files (``purpose=batch``) and the output and error
files of batches (made from their results when read: :mod:`gateway.openai_batch_serving`).

Uploads are kept in Redis for FILES_TTL_S (:mod:`shared.file_store` says why Redis);
one over FILES_MAX_BYTES is a 413. Errors are in OpenAI's shape.
"""

from __future__ import annotations

from typing import Literal

from flask import Blueprint, Response, jsonify, request, stream_with_context
from pydantic import BaseModel, Field
from spectree import Response as Spec
from spectree.model_adapter.pydantic_adapter import BaseFile
from werkzeug.exceptions import RequestEntityTooLarge

from gateway import openai_batch_serving as serving
from gateway.extensions import fleet
from gateway.openai_protocol import openai_error
from gateway.openai_routes import OpenAIErrorBody, answer_in_openai_shape
from gateway.openapi import documented

bp = Blueprint("openai_files", __name__, url_prefix="/openai/v1/files")
answer_in_openai_shape(bp)


class FileUpload(BaseModel):
    file: BaseFile = Field(description="The JSONL file: one batch request per line.")
    purpose: Literal["batch"]
    expires_after_anchor: Literal["created_at"] | None = Field(None, alias="expires_after[anchor]")
    expires_after_seconds: int | None = Field(
        None, alias="expires_after[seconds]", description="3600 to FILES_TTL_S."
    )


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int | None
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["processed"] = "processed"
    status_details: None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class FileListQuery(BaseModel):
    after: str | None = None
    limit: int | None = Field(None, ge=1, le=10_000)
    order: Literal["asc", "desc"] | None = None
    purpose: str | None = None


_ERRORS = {"HTTP_400": OpenAIErrorBody, "HTTP_404": OpenAIErrorBody}


@bp.post("")
@documented(
    form=FileUpload, resp=Spec(HTTP_200=FileObject, HTTP_413=OpenAIErrorBody, **_ERRORS),
    tags=["openai"],
)  # fmt: skip
def create_file():
    """Upload a batch input file (multipart: `file`, `purpose=batch`, optional
    `expires_after[anchor]=created_at` and `expires_after[seconds]`). Kept FILES_TTL_S at
    most; larger than FILES_MAX_BYTES is a 413. Its lines are checked when a batch is made
    from it."""
    return jsonify(serving.upload())


@bp.get("")
@documented(query=FileListQuery, resp=Spec(HTTP_200=FileList, **_ERRORS), tags=["openai"])
def list_files():
    """Your uploaded files, newest first (`order=asc` for oldest first), paginated with
    `after` and `limit`; `purpose` filters."""
    return jsonify(serving.list_files(request.args))


@bp.get("/<file_id>")
@documented(resp=Spec(HTTP_200=FileObject, **_ERRORS), tags=["openai"])
def retrieve_file(file_id: str):
    """A file: one you uploaded, or a batch's output or error file (`purpose:
    batch_output`, once the batch ended)."""
    return jsonify(serving.file_meta(file_id))


@bp.get("/<file_id>/content")
@documented(resp=Spec(**_ERRORS), tags=["openai"])
def file_content(file_id: str):
    """A file's bytes. A batch's output file holds one line per request that succeeded,
    `{id, custom_id, response: {status_code, request_id, body}, error}`, `body` exactly
    what the endpoint answers; its error file, one per request that failed, expired or was
    cancelled."""
    meta = serving.file_meta(file_id)
    headers = {"Content-Disposition": f'attachment; filename="{meta["filename"]}"'}
    content = stream_with_context(serving.file_content(file_id))  # made as it is sent
    return Response(content, mimetype="application/octet-stream", headers=headers)


@bp.delete("/<file_id>")
@documented(resp=Spec(HTTP_200=FileDeleted, **_ERRORS), tags=["openai"])
def delete_file(file_id: str):
    """Delete a file (a batch's output or error file: hidden from then on)."""
    return jsonify(serving.delete_file(file_id))


@bp.errorhandler(RequestEntityTooLarge)
def _too_large(exc: RequestEntityTooLarge):
    limit = fleet.settings.files_max_bytes
    message = f"the upload is larger than the {limit} bytes a file may have (FILES_MAX_BYTES)"
    return jsonify(openai_error(message, "invalid_request_error", "file", "file_too_large")), 413
