"""``python -m fleet.status`` (``make status``): the fleet at a glance, in a terminal.

Workers come from their Redis heartbeats, with live state and tokens/s from Celery's
``inspect stats`` when they answer within a second; backlog, throughput and latency come
from the queue's own records of the last ended jobs.
"""

from __future__ import annotations

import sys
import time

import redis

from shared.redis_client import connect
from shared.registry import WorkerRegistry
from shared.settings import Settings, get_settings
from shared.states import LANES
from shared.stats import QueueStats, recent_jobs

WINDOW_S = 300


def worker_stats(settings: Settings) -> dict[str, dict]:
    """Live stats per worker name; empty if none answer (the rest still prints)."""
    from workers.celery_app import app

    try:
        replies = app.control.inspect(timeout=1.0).stats() or {}
    except Exception:  # the broker is down: show what Redis says
        return {}
    return {name: reply.get("fleet", {}) for name, reply in replies.items()}


def render(
    settings: Settings,
    stats: QueueStats,
    registry: WorkerRegistry,
    live: dict[str, dict],
    now: float,
) -> str:
    lines = []
    max_age = settings.worker_max_age_s
    model = settings.served_model
    workers = registry.workers(model, max_age)
    lines.append(f"model {model}")
    lines.append(f"  workers: {len(workers)} ready")
    for w in workers:
        info = live.get(w["name"], {})
        state = info.get("state", "no answer")
        tps = info.get("recent_tokens_per_second", "-")
        lines.append(
            f"    {w['name']:<32} {w.get('device', '?'):<8} {state:<10} "
            f"micro-batches {info.get('batches', '-'):<6} tokens/s {tps}"
        )
    for lane in LANES:
        backlog = stats.backlog(model, lane)
        lines.append(
            f"  {lane} backlog: {backlog.undelivered} waiting, {backlog.pending} running, "
            f"oldest waiting {backlog.oldest_age_s:.1f}s"
        )
    lines.append(f"  dead letters: {stats.dead_letter_count(model)}")
    lines.append("  " + cache_line(stats.counters(model)))
    rows = stats.recent(model)
    last_minute, recent = recent_jobs(rows, now, 60), recent_jobs(rows, now, WINDOW_S)
    lines.append(
        f"  throughput: {last_minute.jobs_per_second:.2f} interactive jobs/s over the last minute"
    )
    if recent.jobs >= 2:
        lines.append(
            f"  latency (last {WINDOW_S // 60} min, {recent.jobs} jobs): "
            f"p50 {recent.latency_p50_s:.2f}s  p95 {recent.latency_p95_s:.2f}s"
        )
    else:
        lines.append(f"  latency: too few jobs in the last {WINDOW_S // 60} min")
    return "\n".join(lines)


def cache_line(counters: dict[str, str]) -> str:
    """The result cache since the model's counters began: hit ratio, and what it holds."""
    hits, misses, coalesced = (int(counters.get(f"cache:{n}", 0)) for n in
                               ("hits", "misses", "coalesced"))  # fmt: skip
    asked = hits + misses + coalesced
    if not asked:
        return "result cache: no cacheable requests yet"
    mib = max(0, int(counters.get("cache:bytes", 0))) / 2**20
    return (
        f"result cache: hit ratio {hits / asked:.0%} ({hits} hits, {coalesced} coalesced, "
        f"{misses} computed), {mib:.1f} MiB, {counters.get('cache:evictions', 0)} evicted"
    )


def main() -> int:
    settings = get_settings()
    client = connect(settings)
    stats = QueueStats.from_settings(settings, client)
    registry = WorkerRegistry.from_settings(settings, client)
    try:
        print(render(settings, stats, registry, worker_stats(settings), time.time()))
    except redis.RedisError as exc:
        print(f"cannot read the fleet at {settings.shown_redis_url}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
