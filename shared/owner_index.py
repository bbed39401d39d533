"""One API key's objects of a kind (files, OpenAI batches) by creation time, read in
cursor pages as OpenAI's list endpoints are (``after`` an id, ``limit``, ``has_more``).

The objects expire on their own (a file's TTL, a batch's RESULT_TTL_S); their ids stay in
the index until a page meets them gone and drops them, or they are older than the index
keeps anything.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import redis

T = TypeVar("T")


class UnknownCursor(LookupError):
    """``after`` names no object of this index (never made, or gone)."""


class OwnerIndex:
    def __init__(self, client: redis.Redis, key_of: Callable[[str], str], keep_s: float) -> None:
        self.redis = client
        self.key_of = key_of  # owner -> the index's key (shared.keys)
        self.keep_s = keep_s  # nothing older than this is listed

    def add(self, owner: str, object_id: str, created_at: float) -> None:
        key = self.key_of(owner)
        pipe = self.redis.pipeline(transaction=False)
        pipe.zadd(key, {object_id: created_at})
        pipe.zremrangebyscore(key, "-inf", time.time() - self.keep_s)
        pipe.expire(key, int(self.keep_s) + 60)
        pipe.execute()

    def remove(self, owner: str, object_id: str) -> None:
        self.redis.zrem(self.key_of(owner), object_id)

    def page(
        self,
        owner: str,
        after: str | None,
        limit: int,
        load: Callable[[Sequence[str]], Sequence[T | None]],
        *,
        newest_first: bool = True,
        keep: Callable[[T], bool] = lambda _: True,
    ) -> tuple[list[T], bool]:
        """Up to ``limit`` objects after ``after`` (from the first without it), and whether
        more follow. ``load`` reads objects by id (None: gone, then dropped from the index);
        only those ``keep`` takes are listed. UnknownCursor when ``after`` is not in the
        index."""
        key = self.key_of(owner)
        start = 0
        if after is not None:
            rank = (self.redis.zrevrank if newest_first else self.redis.zrank)(key, after)
            if rank is None:
                raise UnknownCursor(after)
            start = rank + 1
        read = self.redis.zrevrange if newest_first else self.redis.zrange
        found: list[T] = []
        while len(found) <= limit:
            ids = read(key, start, start + limit)  # limit + 1 of them
            if not ids:
                break
            objects = load(ids)
            gone = [object_id for object_id, obj in zip(ids, objects, strict=True) if obj is None]
            if gone:
                self.redis.zrem(key, *gone)
            found += [obj for obj in objects if obj is not None and keep(obj)]
            start += len(ids) - len(gone)
        return found[:limit], len(found) > limit
