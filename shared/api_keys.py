"""API keys: who is calling, what they may do, and how much.

A key is ``fk-`` and 43 random URL-safe characters (256 bits), shown once when it is made.
Redis holds only its SHA-256 (a key that random needs no slow hash: nothing can be guessed
from the digest) with the key's name, scopes and limits. Every request looks its key up
(one HGETALL), so a revoked key fails on its very next request, on every gateway.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass, field
from enum import StrEnum

from shared.coalesce import Coalescer
from shared.redis_client import FleetRedis

SECRET_PREFIX = "fk-"
LAST_USED_EVERY_S = 60  # last_used_at is written at most this often per key: no write per request


class Scope(StrEnum):
    JOBS = "jobs"  # submit jobs and OpenAI completions, read your own
    BATCHES = "batches"  # create batches, read your own
    ADMIN = "admin"  # everything: every key's jobs, keys, dead letters, workers


ALL_SCOPES = (Scope.JOBS, Scope.BATCHES, Scope.ADMIN)
_SCOPE_NAMES = frozenset(scope.value for scope in Scope)


@dataclass(frozen=True)
class ApiKey:
    """A key as the gateway sees it (never its secret). Limits of 0 mean none; None means
    the fleet's default (KEY_RPM, KEY_TPM, KEY_MAX_QUEUED)."""

    id: str
    name: str
    scopes: frozenset[Scope]
    rpm: int | None = None
    tpm: int | None = None
    max_queued: int | None = None
    created_at: float = 0.0
    last_used_at: float | None = None
    digest: str = field(default="", repr=False)

    def allows(self, scope: Scope) -> bool:
        return Scope.ADMIN in self.scopes or scope in self.scopes

    @property
    def admin(self) -> bool:
        return Scope.ADMIN in self.scopes

    def public(self) -> dict[str, object]:
        """What the key list shows: everything but the digest."""
        return {
            "id": self.id,
            "object": "api_key",
            "name": self.name,
            "scopes": sorted(self.scopes),
            "rpm": self.rpm,
            "tpm": self.tpm,
            "max_queued": self.max_queued,
            "created_at": int(self.created_at),
            "last_used_at": int(self.last_used_at) if self.last_used_at else None,
        }


@dataclass(frozen=True)
class CreatedKey:
    key: ApiKey
    secret: str  # shown once; not stored anywhere


def digest_of(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def parse_scopes(text: str) -> frozenset[Scope]:
    """``jobs,batches`` -> the scopes; ValueError naming a bad one."""
    scopes = set()
    for name in text.replace(" ", ",").split(","):
        if not name:
            continue
        try:
            scopes.add(Scope(name.strip().lower()))
        except ValueError:
            raise ValueError(f"unknown scope '{name}' (scopes: {', '.join(ALL_SCOPES)})") from None
    if not scopes:
        raise ValueError(f"give at least one scope ({', '.join(ALL_SCOPES)})")
    return frozenset(scopes)


class ApiKeyStore(FleetRedis):
    """Keys live fleet-wide (not per model): ``P:api-key:{digest}`` holds one key,
    ``P:api-keys`` maps each key id to its digest (for listing and revoking)."""

    _coalescer: Coalescer | None = None

    def coalesce_lookups(self, coalescer: Coalescer) -> None:
        """Look keys up in the coalescer's pipelines (a busy gateway: every request does)."""
        self._coalescer = coalescer

    def create(
        self,
        name: str,
        scopes: frozenset[Scope] | tuple[Scope | str, ...] = (Scope.JOBS, Scope.BATCHES),
        *,
        rpm: int | None = None,
        tpm: int | None = None,
        max_queued: int | None = None,
    ) -> CreatedKey:
        secret = SECRET_PREFIX + secrets.token_urlsafe(32)
        key = ApiKey(
            id="key_" + secrets.token_hex(8),
            name=name,
            scopes=frozenset(Scope(s) for s in scopes),
            rpm=rpm,
            tpm=tpm,
            max_queued=max_queued,
            created_at=time.time(),
            digest=digest_of(secret),
        )
        record = {
            "id": key.id,
            "name": name,
            "scopes": " ".join(sorted(key.scopes)),
            "created_at": repr(key.created_at),
        }
        for limit in ("rpm", "tpm", "max_queued"):
            if getattr(key, limit) is not None:
                record[limit] = str(getattr(key, limit))
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.api_key(key.digest), mapping=record)
        pipe.hset(self.keys.api_keys(), key.id, key.digest)
        pipe.execute()
        return CreatedKey(key, secret)

    def authenticate(self, secret: str) -> ApiKey | None:
        """The key this secret is, or None (unknown, revoked, or not a key at all)."""
        if not secret.startswith(SECRET_PREFIX) or len(secret) > 128:
            return None
        digest = digest_of(secret)
        name = self.keys.api_key(digest)
        if self._coalescer is not None:
            record = self._coalescer.run([("HGETALL", name)])[0]
        else:
            record = self.redis.hgetall(name)
        if "id" not in record:
            return None
        key = _from_record(record, digest)
        now = time.time()
        if key.last_used_at is None or now - key.last_used_at > LAST_USED_EVERY_S:
            # Should a revoke land between the read and this write, what is left is a hash
            # without an id, which is no key (above).
            self.redis.hset(self.keys.api_key(digest), "last_used_at", repr(now))
        return key

    def list(self) -> list[ApiKey]:
        digests = self.redis.hgetall(self.keys.api_keys())
        pipe = self.redis.pipeline(transaction=False)
        for digest in digests.values():
            pipe.hgetall(self.keys.api_key(digest))
        records = pipe.execute()
        pairs = zip(records, digests.values(), strict=True)
        keys = [_from_record(r, d) for r, d in pairs if "id" in r]
        return sorted(keys, key=lambda k: k.created_at)

    def get(self, key_id: str) -> ApiKey | None:
        digest = self.redis.hget(self.keys.api_keys(), key_id)
        record = self.redis.hgetall(self.keys.api_key(digest)) if digest else None
        return _from_record(record, digest) if record and "id" in record else None

    def find(self, id_or_name: str) -> list[ApiKey]:
        """Keys with this id, or else with this name."""
        key = self.get(id_or_name)
        return [key] if key else [k for k in self.list() if k.name == id_or_name]

    def revoke(self, key_id: str) -> bool:
        """Delete the key; its next request is a 401. False if there was none."""
        digest = self.redis.hget(self.keys.api_keys(), key_id)
        if digest is None:
            return False
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(self.keys.api_key(digest))
        pipe.hdel(self.keys.api_keys(), key_id)
        pipe.execute()
        return True

    def any_admin(self) -> bool:
        return any(key.admin for key in self.list())


def _from_record(record: dict[str, str], digest: str) -> ApiKey:
    def limit(name: str) -> int | None:
        return int(record[name]) if record.get(name) else None

    return ApiKey(
        id=record["id"],
        name=record.get("name", ""),
        scopes=frozenset(Scope(s) for s in record.get("scopes", "").split() if s in _SCOPE_NAMES),
        rpm=limit("rpm"),
        tpm=limit("tpm"),
        max_queued=limit("max_queued"),
        created_at=float(record.get("created_at", 0)),
        last_used_at=float(record["last_used_at"]) if record.get("last_used_at") else None,
        digest=digest,
    )
