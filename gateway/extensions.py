"""The gateway's per-app connections, reached from views as ``fleet``."""

from __future__ import annotations

from flask import Flask, current_app
from werkzeug.local import LocalProxy

from gateway.backpressure import Backpressure
from gateway.waiting import JobWaiter
from shared.batch_queue import BatchQueue
from shared.jobs import Keys
from shared.queue import JobQueue
from shared.redis_client import connect
from shared.settings import Settings


class Fleet:
    """What a request needs: settings, the job and batch queues, and the waiter for
    ``Prefer: wait``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self.queue = JobQueue(connect(settings), self.keys, settings.result_ttl_s)
        self.batches = BatchQueue(self.queue)
        # The subscriber blocks on its socket for as long as no job ends: no read timeout.
        self.backpressure = Backpressure(self.queue, settings.max_queue_depth)
        self.waiter = JobWaiter(
            connect(settings, socket_timeout=None), self.keys.job_finished_channel
        )

    def served_models(self) -> list[str]:
        return [self.settings.served_model]

    def init_app(self, app: Flask) -> None:
        app.extensions["fleet"] = self


fleet: Fleet = LocalProxy(lambda: current_app.extensions["fleet"])  # type: ignore[assignment]
