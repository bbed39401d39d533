"""``python -m bench [--quick] [--json PATH]``: bare model, the fleet, the bare model again.

The bare model is freed before the fleet starts: on a small CPU machine the two would
otherwise share cores, and both numbers would be wrong. It is measured again once the fleet
has stopped, because a shared VM's speed drifts; the ratios use the mean of both, and a
drift is reported rather than silently folded into the overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.fleet import LevelResult, run_level, running_fleet
from bench.model import MAX_NEW_TOKENS, WARM_UP_S, EngineResult, measure_engine

MAX_BATCH_SIZE = 16
RATIO_PAIRS = (1, 16)  # fleet concurrency N is compared with bare batch size N
NOISY_SHARE = 0.05  # above this share of the CPU used by others, the run is flagged
DRIFT_LIMIT = 0.15  # bare throughput before and after the fleet differ by more: flagged


@dataclass(frozen=True)
class Plan:
    batch_sizes: list[int]
    repeats: int
    concurrency: list[int]
    jobs_floor: int  # every level runs at least this many jobs ...
    jobs_per_client: int  # ... and at least this many per client

    def jobs(self, concurrency: int) -> int:
        return max(self.jobs_floor, self.jobs_per_client * concurrency)


FULL = Plan([1, 4, 16], repeats=7, concurrency=[1, 4, 16, 32], jobs_floor=40, jobs_per_client=8)
QUICK = Plan([1, 4, 16], repeats=2, concurrency=[1, 16], jobs_floor=8, jobs_per_client=2)


@dataclass
class CpuWatch:
    """CPU seconds other processes used while a phase ran: a benchmark on a shared 2-core
    machine is only worth reading if nothing else ran beside it, so the run says so."""

    cpus: int = field(default_factory=lambda: os.cpu_count() or 1)
    others_s: float = 0.0
    wall_s: float = 0.0

    def __enter__(self) -> CpuWatch:
        self._began = (time.monotonic(), _machine_busy_s(), _own_cpu_s())
        return self

    def __exit__(self, *exc: object) -> None:
        wall, busy, own = self._began
        self.wall_s = time.monotonic() - wall
        self.others_s = max(0.0, (_machine_busy_s() - busy) - (_own_cpu_s() - own))

    @property
    def share(self) -> float:
        """Fraction of the machine's CPU time that went to other processes."""
        return self.others_s / (self.wall_s * self.cpus) if self.wall_s else 0.0


def _machine_busy_s() -> float:
    """Non-idle CPU seconds of the whole machine since boot, from /proc/stat."""
    with open("/proc/stat") as stat:
        user, nice, system, _idle, _iowait, irq, softirq, steal = stat.readline().split()[1:9]
    ticks = sum(int(v) for v in (user, nice, system, irq, softirq, steal))
    return ticks / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds of this process and its reaped children (the fleet, once stopped)."""
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usage)


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repeats and levels (~1 min)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write results here")
    parser.add_argument(
        "--batch-wait-ms",
        type=int,
        metavar="MS",
        help="MAX_BATCH_WAIT_MS of the fleet (default: the fleet's own default)",
    )
    parser.add_argument(
        "--logs", type=Path, metavar="DIR", help="keep the fleet's process logs here"
    )
    return parser.parse_args(argv)


def run_fleet(
    plan: Plan, settings: dict[str, str], logs: Path | None
) -> tuple[list[LevelResult], list[str]]:
    progress(f"starting redis, one worker and the gateway ({settings})")
    with running_fleet(settings, logs) as fleet:
        progress("fleet ready; warming up")
        warm_until = time.monotonic() + WARM_UP_S  # untimed, as for the bare model
        while time.monotonic() < warm_until:
            run_level(fleet.base_url, 1, 1)
        run_level(fleet.base_url, MAX_BATCH_SIZE, MAX_BATCH_SIZE)  # and a full batch shape
        results = []
        for concurrency in plan.concurrency:
            progress(f"fleet: {concurrency} clients, {plan.jobs(concurrency)} jobs")
            results.append(run_level(fleet.base_url, concurrency, plan.jobs(concurrency)))
        return results, fleet.problems()


@dataclass(frozen=True)
class Bare:
    """One batch size of the bare model, measured before and after the fleet."""

    before: EngineResult
    after: EngineResult

    @property
    def tokens_per_s(self) -> float:
        """The baseline the fleet is compared with: the mean of the two medians."""
        return (self.before.median_tokens_per_s + self.after.median_tokens_per_s) / 2

    @property
    def drift(self) -> float:
        """After over before; 1.0 when the machine ran at the same speed throughout."""
        return self.after.median_tokens_per_s / self.before.median_tokens_per_s


def ratios(bare: list[Bare], fleet: list[LevelResult]) -> dict[str, float]:
    """Fleet tokens/s over bare tokens/s, where both sides were measured."""
    baseline = {b.before.batch_size: b.tokens_per_s for b in bare}
    served = {r.concurrency: r.tokens_per_s for r in fleet}
    return {
        f"fleet_c{n}_over_bare_b{n}": served[n] / baseline[n]
        for n in RATIO_PAIRS
        if n in baseline and n in served
    }


def report(
    bare: list[Bare],
    fleet: list[LevelResult],
    settings: dict[str, str],
    overhead: dict[str, float],
) -> str:
    lines = [
        f"Bare model: Engine.generate in-process, greedy, max_new_tokens={MAX_NEW_TOKENS}",
        f"{'batch':>5}  {'tokens':>6}  {'best tok/s':>10}  {'median tok/s':>12}  "
        f"{'median s':>8}  {'after fleet':>11}  {'drift':>5}",
    ]
    for b in bare:
        r = b.before
        lines.append(
            f"{r.batch_size:>5}  {r.tokens_per_batch:>6}  {r.best_tokens_per_s:>10.1f}  "
            f"{r.median_tokens_per_s:>12.1f}  {r.median_batch_s:>8.3f}  "
            f"{b.after.median_tokens_per_s:>11.1f}  {b.drift:>5.2f}"
        )
    lines += [
        "(best and median of the run before the fleet; after fleet: the median once it stopped)",
        "",
        "Fleet end to end: 1 worker, POST /v1/jobs with Prefer: wait=60, "
        + ", ".join(f"{k}={v}" for k, v in settings.items()),
        f"{'clients':>7}  {'jobs':>4}  {'errors':>6}  {'jobs/s':>6}  {'tok/s':>7}  "
        f"{'p50 s':>6}  {'p99 s':>6}  {'batch':>5}  {'queue s':>7}  {'infer s':>7}",
    ]
    for r in fleet:
        lines.append(
            f"{r.concurrency:>7}  {r.jobs:>4}  {r.errors:>6}  {r.jobs_per_s:>6.2f}  "
            f"{r.tokens_per_s:>7.1f}  {r.p50_latency_s:>6.3f}  {r.p99_latency_s:>6.3f}  "
            f"{r.mean_batch_size:>5.1f}  {r.mean_queue_s:>7.3f}  {r.mean_inference_s:>7.3f}"
        )
    lines += [
        "(batch, queue s, infer s: means over the jobs of metrics.batch_size, queue_seconds,",
        " inference_seconds; latency minus both is HTTP, Redis and the wait notification)",
        "",
        "Overhead: fleet tok/s / bare tok/s (mean of the medians before and after; 1.00 = none)",
    ]
    for n in RATIO_PAIRS:
        key = f"fleet_c{n}_over_bare_b{n}"
        if key in overhead:
            lines.append(f"  {n:>2} clients vs batch {n:>2}: {overhead[key]:.2f}")
    errors = [r for r in fleet if r.first_error]
    lines += [f"  first error at {r.concurrency} clients: {r.first_error}" for r in errors]
    return "\n".join(lines)


def warnings(bare: list[Bare], busy: dict[str, float]) -> list[str]:
    """Why this run's numbers should not be trusted, if there is a reason."""
    found = []
    if max(busy.values()) > NOISY_SHARE:
        found.append("other processes competed for the CPU (see above)")
    drifted = [b for b in bare if abs(b.drift - 1) > DRIFT_LIMIT]
    if drifted:
        sizes = ", ".join(f"batch {b.before.batch_size}: {b.drift:.2f}" for b in drifted)
        found.append(f"the bare model's speed changed while the fleet ran ({sizes})")
    return found


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    began = time.monotonic()
    settings = {"MAX_BATCH_SIZE": str(MAX_BATCH_SIZE)}
    if args.batch_wait_ms is not None:
        settings["MAX_BATCH_WAIT_MS"] = str(args.batch_wait_ms)

    progress(f"bare model: batch sizes {plan.batch_sizes}, {plan.repeats} repeats each")
    with CpuWatch() as before_watch:
        before = measure_engine(plan.batch_sizes, plan.repeats)
    with CpuWatch() as fleet_watch:  # ends after the fleet is stopped, so it is counted
        fleet, problems = run_fleet(plan, settings, args.logs)
    progress("bare model again, now that the fleet has stopped")
    with CpuWatch() as after_watch:
        after = measure_engine(plan.batch_sizes, plan.repeats)
    bare = [Bare(b, a) for b, a in zip(before, after, strict=True)]
    busy = {"bare": max(before_watch.share, after_watch.share), "fleet": fleet_watch.share}
    overhead = ratios(bare, fleet)
    elapsed = time.monotonic() - began

    print(report(bare, fleet, settings, overhead))
    if problems:
        print("\nWarnings and errors in the fleet's logs (first 20):")
        print("\n".join(f"  {line}" for line in problems))
    print(
        f"\n({'quick' if args.quick else 'full'} run, {os.cpu_count()} CPUs, {elapsed:.0f} s; "
        f"other processes used {busy['bare']:.0%} of the CPU during the bare model, "
        f"{busy['fleet']:.0%} during the fleet)"
    )
    doubts = warnings(bare, busy)
    for doubt in doubts:
        print(f"WARNING: {doubt}; these numbers are not reliable.")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "plan": "quick" if args.quick else "full",
            "cpus": os.cpu_count(),
            "max_new_tokens": MAX_NEW_TOKENS,
            "fleet_settings": settings,
            "elapsed_s": elapsed,
            "engine": [r.as_dict() for r in before],
            "engine_after_fleet": [r.as_dict() for r in after],
            "fleet": [r.as_dict() for r in fleet],
            "ratios": overhead,
            "other_processes_cpu_share": busy,
            "warnings": doubts,
            "log_problems": problems,
        }
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if any(r.errors for r in fleet) else 0


if __name__ == "__main__":
    sys.exit(main())
