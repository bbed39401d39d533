"""Read-only numbers about a model's queue: backlog per lane, counters, recent jobs.

The counters and histograms are written by the scripts as jobs end (``P:{m}:stats``);
this module only reads them, for ``/metrics``, ``make status``, backpressure and the
autoscaler.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass

import redis

from shared.keys import JOBS_GROUP
from shared.redis_client import FleetRedis
from shared.states import LANES, Lane

# Histogram buckets (seconds) of job latency and queue wait, kept in P:{m}:stats.
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 3600)


def bucket_name(bound: float) -> str:
    """The stats-hash suffix of a histogram bucket, as the scripts write it."""
    return f"{bound:g}"


@dataclass(frozen=True)
class Backlog:
    undelivered: int
    pending: int
    entries_read: int = 0  # ever delivered to the group: its growth is the drain rate
    oldest_age_s: float = 0.0  # since the oldest unread entry was queued

    @property
    def total(self) -> int:
        return self.undelivered + self.pending


class QueueStats(FleetRedis):
    """What a model's queue holds and has done."""

    def backlog(self, model: str, lane: Lane | None = None) -> Backlog:
        """Entries not done in one lane, or in both (what the workers have to get through),
        and the age of the oldest unread one: one XINFO per lane, and an XRANGE only when
        something is unread."""
        if lane is None:
            parts = [self.backlog(model, one) for one in LANES]
            return Backlog(
                sum(p.undelivered for p in parts),
                sum(p.pending for p in parts),
                sum(p.entries_read for p in parts),
                max(p.oldest_age_s for p in parts),
            )
        stream = self.keys.stream(model, lane)
        try:
            groups = {g["name"]: g for g in self.redis.xinfo_groups(stream)}
        except redis.ResponseError:  # no such stream yet
            return Backlog(0, 0)
        group = groups.get(JOBS_GROUP)
        if group is None:
            return Backlog(0, 0, oldest_age_s=self._oldest_after(stream, "-"))
        lag = group.get("lag")  # None when Redis cannot tell: then look
        depth = Backlog(int(lag or 0), int(group["pending"]), int(group.get("entries-read") or 0))
        if lag == 0:
            return depth
        oldest = self._oldest_after(stream, f"({group['last-delivered-id']}")
        return dataclasses.replace(depth, oldest_age_s=oldest)

    def _oldest_after(self, stream: str, start: str) -> float:
        """Seconds since the first entry after ``start`` was added (0 if none)."""
        first = self.redis.xrange(stream, start, "+", count=1)
        if not first:
            return 0.0
        return max(0.0, time.time() - entry_time(first[0][0]))

    def counters(self, model: str) -> dict[str, str]:
        """The model's counters and histograms (``P:{m}:stats``)."""
        return self.redis.hgetall(self.keys.stats(model))

    def recent(self, model: str) -> list[tuple[float, float, str]]:
        """The last ended jobs, newest first: (completed_at, latency seconds, status)."""
        rows = []
        for line in self.redis.lrange(self.keys.recent(model), 0, -1):
            completed, latency, status = line.split(" ")
            rows.append((float(completed), float(latency), status))
        return rows

    def dead_letter_count(self, model: str) -> int:
        return self.redis.xlen(self.keys.dead_letters(model))


@dataclass(frozen=True)
class RecentJobs:
    """The interactive jobs that ended within a window: ``make status`` and GET /v1/fleet."""

    window_s: float
    jobs: int
    failed: int
    latency_p50_s: float | None  # None: no job ended in the window
    latency_p95_s: float | None

    @property
    def jobs_per_second(self) -> float:
        return self.jobs / self.window_s


def recent_jobs(rows: list[tuple[float, float, str]], now: float, window_s: float) -> RecentJobs:
    """Summarise :meth:`QueueStats.recent`'s rows that ended in the last ``window_s``."""
    window = [(latency, status) for at, latency, status in rows if at > now - window_s]
    latencies = sorted(latency for latency, _ in window)
    p50 = p95 = None
    if len(latencies) >= 2:
        cuts = statistics.quantiles(latencies, n=100, method="inclusive")
        p50, p95 = cuts[49], cuts[94]
    elif latencies:
        p50 = p95 = latencies[0]
    failed = sum(1 for _, status in window if status != "succeeded")
    return RecentJobs(window_s, len(window), failed, p50, p95)


def entry_time(entry_id: str) -> float:
    """When a stream entry was added (unix seconds), from its id."""
    return int(entry_id.partition("-")[0]) / 1000
