"""The autoscaling decision, as a pure function of the load, the policy and the clock.

    desired = clamp(ceil(backlog / TARGET_BACKLOG_PER_WORKER), MIN_WORKERS, MAX_WORKERS)

Up at once; down only once the load has stayed low for SCALE_DOWN_COOLDOWN_S (the state
carried between calls is when it went low). While anything is queued at least one worker
is kept, so only MIN_WORKERS=0 with an empty queue scales to zero; the first job then
wakes a worker (cold start: process start plus model load).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    target_backlog_per_worker: int
    min_workers: int
    max_workers: int
    scale_down_cooldown_s: float


@dataclass(frozen=True)
class Load:
    backlog: int  # undelivered + pending entries of the model's stream
    oldest_age_s: float  # age of the oldest job no worker has read yet


@dataclass(frozen=True)
class Decision:
    desired: int
    reason: str
    low_since: float | None  # when the load first allowed fewer workers; None if it doesn't


def decide(
    current: int, load: Load, policy: Policy, now: float, low_since: float | None
) -> Decision:
    wanted = math.ceil(load.backlog / policy.target_backlog_per_worker)
    if load.backlog > 0:
        wanted = max(wanted, 1)
    wanted = max(policy.min_workers, min(policy.max_workers, wanted))
    if wanted > current:
        return Decision(wanted, "scale up: backlog needs more workers", None)
    if wanted == current:
        return Decision(current, "steady", None)
    since = now if low_since is None else low_since
    if now - since >= policy.scale_down_cooldown_s:
        return Decision(wanted, f"scale down: low load for {now - since:.0f}s", None)
    return Decision(current, f"cooling down ({now - since:.0f}s of low load)", since)
