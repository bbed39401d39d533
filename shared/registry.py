"""Which workers serve which model: their heartbeats, and who is alive now."""

from __future__ import annotations

import time

from shared.redis_client import FleetRedis


class WorkerRegistry(FleetRedis):
    def heartbeat(self, model: str, worker: str, info: dict[str, str], ttl_s: float) -> None:
        """Say the worker is alive, and what it serves (its record expires after ttl_s)."""
        now = time.time()
        pipe = self.redis.pipeline(transaction=True)
        pipe.zadd(self.keys.workers(model), {worker: now})
        pipe.zremrangebyscore(self.keys.workers(model), "-inf", now - 3600)
        pipe.hset(self.keys.worker(model, worker), mapping=info)
        pipe.expire(self.keys.worker(model, worker), max(1, int(ttl_s)))
        pipe.execute()

    def set_model_version(self, model: str, version: str) -> None:
        """What new requests' cache lookups use: the version the latest worker loaded."""
        self.redis.set(self.keys.model_version(model), version)

    def leave(self, model: str, worker: str) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.zrem(self.keys.workers(model), worker)
        pipe.delete(self.keys.worker(model, worker))
        pipe.execute()

    def workers(self, model: str, max_age_s: float) -> list[dict[str, str]]:
        """Live workers of a model, with what each told in its heartbeat."""
        names = self.redis.zrangebyscore(self.keys.workers(model), time.time() - max_age_s, "+inf")
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(self.keys.worker(model, name))
        return [{"name": n, **info} for n, info in zip(names, pipe.execute(), strict=True) if info]

    def ready_workers(self, model: str, max_age_s: float) -> int:
        return self.redis.zcount(self.keys.workers(model), time.time() - max_age_s, "+inf")
