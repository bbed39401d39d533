"""``Prefer: wait=N``: hold a request until its job ends, without a thread or poll per waiter.

Workers publish a job's id on ``P:job-finished`` when it reaches a terminal state. Each
gateway process keeps one subscriber thread (a greenlet under gunicorn's gevent workers)
that wakes the waiters of that id. Waiters also re-read the job now and then, so a message
lost while the subscriber reconnected costs at most that interval, never a hung request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable

import redis

from shared.protocol import Job

log = logging.getLogger(__name__)

RECHECK_S = 1.0


class JobWaiter:
    def __init__(self, client: redis.Redis, channel: str) -> None:
        self.redis = client
        self.channel = channel
        self._events: dict[str, set[threading.Event]] = defaultdict(set)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def wait(self, job_id: str, timeout_s: float, read: Callable[[], Job | None]) -> Job | None:
        """Return the job once it is terminal, or as it stands when timeout_s has passed."""
        self._ensure_listening()
        event = threading.Event()
        with self._lock:
            self._events[job_id].add(event)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                job = read()
                left = deadline - time.monotonic()
                if job is None or job.status.terminal or left <= 0:
                    return job
                event.wait(min(left, RECHECK_S))
                event.clear()
        finally:
            with self._lock:
                waiters = self._events.get(job_id)
                if waiters is not None:
                    waiters.discard(event)
                    if not waiters:
                        del self._events[job_id]

    def _ensure_listening(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._listen, name="job-finished", daemon=True
                )
                self._thread.start()

    def _listen(self) -> None:
        while True:
            try:
                # Closed on the way out: a PubSub left to the garbage collector can deadlock
                # the thread that collects it (redis-py #3081).
                with self.redis.pubsub(ignore_subscribe_messages=True) as pubsub:
                    pubsub.subscribe(self.channel)
                    for message in pubsub.listen():
                        self._wake(message["data"])
            except redis.RedisError as exc:
                log.warning("job-finished subscriber lost redis (%s); resubscribing", exc)
                time.sleep(1)

    def _wake(self, job_id: str) -> None:
        with self._lock:
            for event in self._events.get(job_id, ()):
                event.set()
