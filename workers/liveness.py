"""Tells the fleet this worker has its model loaded, every WORKER_HEARTBEAT_S seconds.

The gateway's ``/readyz`` and ``/v1/models`` read these records. A heartbeat thread is
separate from the batch loop, so a long batch never makes a live worker look dead.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import redis

from shared.queue import JobQueue
from shared.settings import Settings

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(self, queue: JobQueue, settings: Settings, worker: str, info: dict) -> None:
        self.queue = queue
        self.model = settings.served_model
        self.worker = worker
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
            self.queue.leave(self.model, self.worker)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.queue.heartbeat(self.model, self.worker, self.info, 3 * self.interval_s)
            except redis.RedisError as exc:
                log.warning("heartbeat failed: %s", exc)
            self._stop.wait(self.interval_s)
