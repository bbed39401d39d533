"""Refuse new jobs (429) while a model's backlog is over MAX_QUEUE_DEPTH; never drop any.

The backlog is the consumer group's lag plus its pending entries. ``Retry-After`` is the
time the workers need to drain the excess at their recent rate, which each gateway
process measures from the group's ``entries-read`` counter between its own checks. Far
below the limit a reading is reused for FRESH_S, so a busy submit path does not pay an
extra round trip per request; near the limit every submit reads the backlog.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

from shared.states import Lane
from shared.stats import QueueStats

WINDOW_S = 60.0
FRESH_S = 0.5
DEFAULT_RETRY_S = 10
MAX_RETRY_S = 600


class QueueFull(Exception):
    def __init__(self, backlog: int, retry_after_s: int) -> None:
        super().__init__(backlog)
        self.backlog, self.retry_after_s = backlog, retry_after_s


class Backpressure:
    def __init__(self, stats: QueueStats, max_depth: int) -> None:
        self.stats = stats
        self.max_depth = max_depth
        self._samples: dict[str, deque[tuple[float, int]]] = {}
        # model -> [when read, backlog then, submits checked since]
        self._last: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def check(self, model: str) -> None:
        """Raise QueueFull if the model's backlog is over the limit."""
        last = self._last.get(model)
        if (
            last
            and time.monotonic() - last[0] < FRESH_S
            and last[1] + last[2] < self.max_depth // 2
        ):
            last[2] += 1
            return
        backlog = self.stats.backlog(model, Lane.INTERACTIVE)
        self._last[model] = [time.monotonic(), backlog.total, 1]
        rate = self._drain_rate(model, backlog.entries_read)
        if backlog.total < self.max_depth:
            return
        excess = backlog.total - self.max_depth + 1
        retry = math.ceil(excess / rate) if rate > 0 else DEFAULT_RETRY_S
        raise QueueFull(backlog.total, max(1, min(retry, MAX_RETRY_S)))

    def _drain_rate(self, model: str, entries_read: int) -> float:
        """Entries per second the workers took from the queue over the last minute."""
        now = time.monotonic()
        with self._lock:
            samples = self._samples.setdefault(model, deque())
            samples.append((now, entries_read))
            while len(samples) > 2 and samples[0][0] < now - WINDOW_S:
                samples.popleft()
            (t0, n0), (t1, n1) = samples[0], samples[-1]
        return (n1 - n0) / (t1 - t0) if t1 - t0 >= 1.0 else 0.0
