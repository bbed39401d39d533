"""A worker's side thread: says it is alive, keeps its claims fresh, notices cancels.

Separate from the micro-batch loop, so a long micro-batch never makes a live worker look dead:

* every WORKER_HEARTBEAT_S: refresh the worker's liveness record (read by ``/readyz`` and
  ``/v1/models``) and reset the idle time of the entries it is working on, so no other
  worker claims them (they would only after CLAIM_IDLE_S without a refresh);
* every CANCEL_POLL_S while a micro-batch runs: read which of its jobs clients canceled, so
  the micro-batch stops those rows at their next token.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING

import redis

from shared.job_consumer import JobConsumer
from shared.registry import WorkerRegistry
from shared.settings import Settings

if TYPE_CHECKING:
    from workers.batcher import MicroBatchLoop

log = logging.getLogger(__name__)

CANCEL_POLL_S = 0.1


class Heartbeat:
    def __init__(
        self,
        registry: WorkerRegistry,
        jobs: JobConsumer,
        settings: Settings,
        loop: MicroBatchLoop,
        info: dict[str, object],
    ) -> None:
        self.registry = registry
        self.jobs = jobs
        self.max_age_s = settings.worker_max_age_s
        self.loop = loop
        self.model = settings.served_model
        self.worker = loop.worker
        self.interval_s = settings.worker_heartbeat_s
        self.info = {k: str(v) for k, v in info.items()} | {"loaded_at": repr(time.time())}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        with contextlib.suppress(redis.RedisError):  # else the record expires on its own
            self.registry.leave(self.model, self.worker)

    def live(self) -> dict[str, str]:
        """What changes between beats: busy or idle, and the last minute's tokens/s while
        generating (the console's and GET /v1/admin/workers' view of the worker)."""
        stats = self.loop.stats
        return {
            "state": "busy" if self.loop.busy_since is not None else "idle",
            "tokens_per_s": str(stats.tokens_per_second()),
            "jobs_succeeded": str(stats.jobs_succeeded),
            "jobs_failed": str(stats.jobs_failed),
        }

    def _run(self) -> None:
        next_beat = 0.0
        while not self._stop.wait(CANCEL_POLL_S):
            try:
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + self.interval_s
                    self.registry.heartbeat(
                        self.model, self.worker, self.info | self.live(), self.max_age_s
                    )
                    self.jobs.touch(self.model, self.worker, self.loop.in_flight)
                self.loop.watch_cancels()
            except redis.RedisError as exc:
                log.warning("heartbeat failed: %s", exc)
                self._stop.wait(1)
