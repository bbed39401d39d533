"""The result cache and in-flight coalescing: which requests qualify, and what names one.

A request is cacheable when its output is a function of its input: greedy (temperature 0)
or sampled with a seed, and not opted out (``"cache": false``). Its fingerprint covers the
exact input (prompt or messages) and every generation field, defaults filled in (the
record's ``input`` JSON), and, in the ``key`` scope, who asked. The model is the hash tag
of every key involved; the scripts fold in the model version the workers registered
(``sha1(version fingerprint)``), so a new checkpoint never serves old answers.

The rest is in ``shared/lua/lib.lua`` (lookup, follow, settle, store, evict), so that the
lookup and the job's creation are one atomic step: two identical requests never both miss.
Why the size bound is kept by the scripts, not by Redis's ``maxmemory``: that bound is for
a whole Redis, and would evict queued jobs' records along with cached results.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from shared.protocol import JobInput
from shared.settings import Settings

INFLIGHT_TTL_S = 86_400  # a safety net: an in-flight mark is removed when its job ends
CACHE_ENTRY_OVERHEAD = 64  # bytes counted per cached result beside its key and value


@dataclass(frozen=True)
class CachePolicy:
    enabled: bool
    ttl_s: int  # min(CACHE_TTL_S, RESULT_TTL_S): a result never outlives its job
    max_bytes: int
    scope: str  # "key" or "global"

    @classmethod
    def from_settings(cls, settings: Settings) -> CachePolicy:
        return cls(
            settings.cache_enabled,
            min(settings.cache_ttl_s, settings.result_ttl_s),
            settings.cache_max_bytes,
            settings.cache_scope,
        )

    def owner(self, job_input: JobInput, wanted: bool, api_key_id: str = "") -> str | None:
        """Whose results this request may share ('' everyone's), or None: not cacheable."""
        if not (self.enabled and wanted and cacheable(job_input)):
            return None
        return api_key_id if self.scope == "key" else ""

    def writes(self, version: str) -> CacheWrites:
        return CacheWrites(version, self.ttl_s if self.enabled else 0, self.max_bytes)


@dataclass(frozen=True)
class CacheWrites:
    """What a worker's finish script needs to cache a result: the version of the model
    that made it, and the policy. The default caches nothing."""

    version: str = ""
    ttl_s: int = 0
    max_bytes: int = 0

    def args(self) -> list[str | int]:
        return [self.version, self.ttl_s, self.max_bytes]


def cacheable(job_input: JobInput) -> bool:
    """Whether the output is a function of the input: greedy, or sampled with a seed."""
    return job_input.temperature == 0 or job_input.seed is not None


def fingerprint(input_json: str, owner: str) -> str:
    """What makes two requests identical: the stored input (canonical JSON) and the owner."""
    return hashlib.sha256(f"{owner}\n{input_json}".encode()).hexdigest()[:32]
