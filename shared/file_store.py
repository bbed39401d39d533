"""Uploaded files (``/openai/v1/files``) in Redis: one hash per file, its bytes and its
metadata, expiring FILES_TTL_S after upload (or sooner, if the client asked).

Redis, not a directory under DATA_DIR: every gateway replica shares Redis, while DATA_DIR is
each pod's own, so a file uploaded through one replica could not be read by a batch created
through another. A file is as big as a batch (FILES_MAX_BYTES, like BATCH_MAX_BYTES), it is
read once when a batch is created (the batch copies its requests into its jobs), and it then
expires by itself.

A file belongs to the API key that uploaded it: read with another key's id, it is None (a
404, as for jobs and batches); ``owner=None`` reads anyone's (admin keys, keys off).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

import redis

from shared.keys import Keys
from shared.owner_index import OwnerIndex

META = ("id", "filename", "purpose", "bytes", "created_at", "expires_at", "owner")


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def is_file_id(value: str) -> bool:
    return value.startswith("file-") and len(value) == 37 and value[5:].isalnum()


class FileStore:
    def __init__(self, client: redis.Redis, raw: redis.Redis, keys: Keys, ttl_s: int) -> None:
        self.redis = client  # decoded replies: the metadata
        self.raw = raw  # bytes replies: the content, which need not be UTF-8
        self.keys = keys
        self.ttl_s = ttl_s
        self.index = OwnerIndex(client, keys.files, ttl_s)

    def create(
        self, owner: str, filename: str, purpose: str, content: bytes, ttl_s: int | None = None
    ) -> dict[str, Any]:
        """Store a file; its metadata as :meth:`get` returns it."""
        file_id, now = new_file_id(), time.time()
        ttl = min(ttl_s or self.ttl_s, self.ttl_s)
        meta = {
            "id": file_id,
            "filename": filename,
            "purpose": purpose,
            "bytes": str(len(content)),
            "created_at": repr(now),
            "expires_at": repr(now + ttl),
            "owner": owner,
        }
        key = self.keys.file(file_id)
        pipe = self.redis.pipeline(transaction=True)  # one key: atomic in a cluster too
        pipe.hset(key, mapping={**meta, "content": content})
        pipe.expire(key, ttl)
        pipe.execute()
        self.index.add(owner, file_id, now)
        return _parsed(meta)

    def get(self, file_id: str, owner: str | None) -> dict[str, Any] | None:
        return self._load([file_id], owner)[0]

    def content(self, file_id: str, owner: str | None) -> bytes | None:
        if self.get(file_id, owner) is None:
            return None
        return self.raw.hget(self.keys.file(file_id), "content")

    def delete(self, file_id: str, owner: str | None) -> bool:
        meta = self.get(file_id, owner)
        if meta is None:
            return False
        self.redis.delete(self.keys.file(file_id))
        self.index.remove(meta["owner"], file_id)
        return True

    def page(
        self, owner: str, after: str | None, limit: int, newest_first: bool, purpose: str | None
    ) -> tuple[list[dict[str, Any]], bool]:
        """One key's files, a page at a time (shared.owner_index); UnknownCursor for a bad
        ``after``."""
        return self.index.page(
            owner, after, limit, lambda ids: self._load(ids, owner),
            newest_first=newest_first,
            keep=lambda meta: purpose is None or meta["purpose"] == purpose,
        )  # fmt: skip

    def _load(self, file_ids: Sequence[str], owner: str | None) -> list[dict[str, Any] | None]:
        pipe = self.redis.pipeline(transaction=False)
        for file_id in file_ids:
            pipe.hmget(self.keys.file(file_id), META)
        found: list[dict[str, Any] | None] = []
        for values in pipe.execute():
            meta = dict(zip(META, values, strict=True))
            if meta["id"] is None or (owner is not None and meta["owner"] != owner):
                found.append(None)
            else:
                found.append(_parsed(meta))
        return found


def _parsed(meta: dict[str, str]) -> dict[str, Any]:
    return {
        "id": meta["id"],
        "filename": meta["filename"],
        "purpose": meta["purpose"],
        "bytes": int(meta["bytes"]),
        "created_at": float(meta["created_at"]),
        "expires_at": float(meta["expires_at"]),
        "owner": meta["owner"],
    }
