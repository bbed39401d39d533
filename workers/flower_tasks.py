"""Shows each micro-batch in Flower as a task named ``workers.infer_batch``.

(Flower's task events; nothing to do with the webhook events outbox.)

Flower builds its task list purely from ``task-*`` events, so the batch loop, which runs
outside Celery's task machinery, sends them itself: received (with the job ids), started,
then succeeded (runtime, result) or failed (exception, traceback). It uses a dispatcher on
its own connection, since it runs off the worker's main thread; a dispatcher built this way
always sends, whether or not events were enabled with ``-E``.
"""

from __future__ import annotations

import logging

from celery import Celery

log = logging.getLogger(__name__)

TASK_NAME = "workers.infer_batch"


class FlowerTasks:
    def __init__(self, app: Celery, hostname: str) -> None:
        self.app = app
        self.hostname = hostname
        self._dispatcher = None

    def started(self, task_id: str, job_ids: list[str]) -> None:
        self._send(
            "task-received", uuid=task_id, name=TASK_NAME, args=repr(job_ids),
            kwargs=repr({"batch_size": len(job_ids)}), retries=0, eta=None, root_id=task_id,
            parent_id=None,
        )  # fmt: skip
        self._send("task-started", uuid=task_id)

    def succeeded(self, task_id: str, runtime: float, result: dict) -> None:
        self._send("task-succeeded", uuid=task_id, result=repr(result), runtime=runtime)

    def failed(self, task_id: str, exception: str, traceback: str = "") -> None:
        self._send("task-failed", uuid=task_id, exception=exception, traceback=traceback)

    def _send(self, event_type: str, **fields) -> None:
        try:
            if self._dispatcher is None:
                self._dispatcher = self.app.events.Dispatcher(
                    self.app.connection_for_write(), hostname=self.hostname, enabled=True
                )
            self._dispatcher.send(event_type, **fields)
        except Exception as exc:  # Flower is a view: never let it stop the batch loop
            log.warning("could not send %s to Flower: %s", event_type, exc)
            self._dispatcher = None
