"""A worker whose parent died exits within a bounded grace.

``make up``'s supervisor starts each worker with a parent-death signal (SIGTERM), which
starts Celery's warm shutdown: the micro-batch finishes, then the worker exits. That drain
has no upper bound of its own (a long micro-batch on a loaded machine), and a worker left
running after its fleet keeps its name and its Redis while a new fleet starts beside it.
So a thread watches the parent: once it is gone, the worker stops taking work and has
``WORKER_ORPHAN_GRACE_S`` to finish; past that it exits at once, and the entries of the
micro-batch it abandons stay pending in the stream, where a live worker claims them after
CLAIM_IDLE_S (nothing is lost; a streaming job's clients get a restart event).

A worker whose parent is PID 1 or none (a container's entrypoint) has no one to outlive.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

POLL_S = 0.5
ABANDONED_EXIT_CODE = 70


class ParentWatch:
    def __init__(
        self,
        grace_s: float,
        drain: Callable[[], None],
        exit_now: Callable[[int], None] = os._exit,
    ) -> None:
        self.grace_s = grace_s
        self.drain = drain
        self.exit_now = exit_now
        self.parent = os.getppid()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="parent-watch", daemon=True)

    def start(self) -> None:
        if self.parent > 1:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            if os.getppid() != self.parent:
                break
        else:
            return
        log.warning(
            "the worker's parent (pid %d) is gone; draining, and exiting in at most %.0f s",
            self.parent, self.grace_s,
        )  # fmt: skip
        self.drain()
        if not self._stop.wait(self.grace_s):
            log.warning("still running %.0f s after the parent died; exiting now", self.grace_s)
            self.exit_now(ABANDONED_EXIT_CODE)
