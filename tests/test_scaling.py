"""The pure scaling decision, replayed on load traces."""

from __future__ import annotations

from fleet.scaling import Decision, Load, Policy, decide

POLICY = Policy(
    target_backlog_per_worker=10, min_workers=1, max_workers=4, scale_down_cooldown_s=30
)


def replay(
    trace: list[int], policy: Policy = POLICY, start: int = 1, step_s: float = 5
) -> list[int]:
    """Worker counts after each sample of a backlog trace, one sample every step_s."""
    current, low_since, out = start, None, []
    for i, backlog in enumerate(trace):
        decision: Decision = decide(current, Load(backlog, 0.0), policy, i * step_s, low_since)
        current, low_since = decision.desired, decision.low_since
        out.append(current)
    return out


def test_a_burst_scales_up_at_once_and_down_after_the_cooldown():
    trace = [0, 300, 250, 120, 40, 0, 0, 0, 0, 0, 0, 0, 0]
    # Low from sample 5 (t=25 s); 30 s later (t=55 s, sample 11) it drops to MIN_WORKERS.
    assert replay(trace) == [1, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 1, 1]


def test_slow_ramp_adds_workers_step_by_step():
    trace = [5, 12, 18, 25, 33, 41, 60]
    assert replay(trace) == [1, 2, 2, 3, 4, 4, 4]


def test_flapping_load_does_not_flap_workers():
    trace = [35, 0, 35, 0, 35, 0, 35, 0, 35]
    assert replay(trace) == [4] * len(trace)


def test_never_below_one_while_anything_is_queued_and_never_above_max():
    policy = Policy(
        target_backlog_per_worker=100, min_workers=0, max_workers=2, scale_down_cooldown_s=0
    )
    assert replay([1, 1, 10_000, 1], policy, start=0) == [1, 1, 2, 1]


def test_scale_to_zero_and_wake():
    policy = Policy(
        target_backlog_per_worker=10, min_workers=0, max_workers=3, scale_down_cooldown_s=10
    )
    trace = [0, 0, 0, 0, 1, 0, 0, 0, 0]
    assert replay(trace, policy, start=1) == [1, 1, 0, 0, 1, 1, 1, 0, 0]


def test_cooldown_restarts_when_load_comes_back():
    trace = [30, 0, 0, 0, 30, 0, 0, 0, 0, 0, 0, 0]
    result = replay(trace)  # 5 s steps, 30 s cooldown
    assert result[:5] == [3, 3, 3, 3, 3]
    assert result.index(1) == 4 + 7  # the low period restarted at sample 5


def test_decision_reports_its_reason():
    up = decide(1, Load(100, 3.0), POLICY, 0.0, None)
    assert up.desired == 4 and up.reason.startswith("scale up")
    cooling = decide(4, Load(0, 0.0), POLICY, 10.0, 0.0)
    assert cooling.desired == 4 and "cooling" in cooling.reason and cooling.low_since == 0.0
