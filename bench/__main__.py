"""``python -m bench [--quick] [--json PATH]``: bare model, then the fleet, then the ratios.

The bare model runs first and is freed before the fleet starts: on a small CPU machine the
two would otherwise share cores, and both numbers would be wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.fleet import LevelResult, run_level, running_fleet
from bench.model import MAX_NEW_TOKENS, EngineResult, measure_engine

MAX_BATCH_SIZE = 16
RATIO_PAIRS = (1, 16)  # fleet concurrency N is compared with bare batch size N


@dataclass(frozen=True)
class Plan:
    batch_sizes: list[int]
    repeats: int
    concurrency: list[int]
    jobs_floor: int  # every level runs at least this many jobs ...
    jobs_per_client: int  # ... and at least this many per client

    def jobs(self, concurrency: int) -> int:
        return max(self.jobs_floor, self.jobs_per_client * concurrency)


FULL = Plan([1, 4, 16], repeats=5, concurrency=[1, 4, 16, 32], jobs_floor=24, jobs_per_client=4)
QUICK = Plan([1, 4, 16], repeats=2, concurrency=[1, 16], jobs_floor=8, jobs_per_client=2)


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repeats and levels (~1 min)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write results here")
    parser.add_argument(
        "--logs", type=Path, metavar="DIR", help="keep the fleet's process logs here"
    )
    return parser.parse_args(argv)


def run_fleet(plan: Plan, logs: Path | None) -> tuple[list[LevelResult], list[str]]:
    progress("starting redis, one worker and the gateway")
    with running_fleet(MAX_BATCH_SIZE, logs) as fleet:
        progress("fleet ready; warming up")
        run_level(fleet.base_url, 1, 2)  # untimed: the first requests and a full batch shape
        run_level(fleet.base_url, MAX_BATCH_SIZE, MAX_BATCH_SIZE)
        results = []
        for concurrency in plan.concurrency:
            progress(f"fleet: {concurrency} clients, {plan.jobs(concurrency)} jobs")
            results.append(run_level(fleet.base_url, concurrency, plan.jobs(concurrency)))
        return results, fleet.problems()


def ratios(engine: list[EngineResult], fleet: list[LevelResult]) -> dict[str, float]:
    """Fleet tokens/s over bare median tokens/s, where both sides were measured."""
    bare = {r.batch_size: r.median_tokens_per_s for r in engine}
    served = {r.concurrency: r.tokens_per_s for r in fleet}
    return {
        f"fleet_c{n}_over_bare_b{n}": served[n] / bare[n]
        for n in RATIO_PAIRS
        if n in bare and n in served
    }


def report(engine: list[EngineResult], fleet: list[LevelResult], overhead: dict[str, float]) -> str:
    lines = [
        f"Bare model: Engine.generate in-process, greedy, max_new_tokens={MAX_NEW_TOKENS}",
        f"{'batch':>5}  {'tokens':>6}  {'best tok/s':>10}  {'median tok/s':>12}  {'median s':>8}",
    ]
    for r in engine:
        lines.append(
            f"{r.batch_size:>5}  {r.tokens_per_batch:>6}  {r.best_tokens_per_s:>10.1f}  "
            f"{r.median_tokens_per_s:>12.1f}  {r.median_batch_s:>8.3f}"
        )
    lines += [
        "",
        f"Fleet end to end: 1 worker, MAX_BATCH_SIZE={MAX_BATCH_SIZE}, POST /v1/jobs "
        "with Prefer: wait=60",
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
    ]
    lines += ["", "Overhead: fleet tok/s / bare median tok/s (1.00 = no overhead)"]
    for n in RATIO_PAIRS:
        key = f"fleet_c{n}_over_bare_b{n}"
        if key in overhead:
            lines.append(f"  {n:>2} clients vs batch {n:>2}: {overhead[key]:.2f}")
    errors = [r for r in fleet if r.first_error]
    lines += [f"  first error at {r.concurrency} clients: {r.first_error}" for r in errors]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    began = time.monotonic()
    progress(f"bare model: batch sizes {plan.batch_sizes}, {plan.repeats} repeats each")
    engine = measure_engine(plan.batch_sizes, plan.repeats)
    fleet, problems = run_fleet(plan, args.logs)
    overhead = ratios(engine, fleet)
    print(report(engine, fleet, overhead))
    if problems:
        print("\nWarnings and errors in the fleet's logs (first 20):")
        print("\n".join(f"  {line}" for line in problems))
    elapsed = time.monotonic() - began
    print(f"\n({'quick' if args.quick else 'full'} run, {os.cpu_count()} CPUs, {elapsed:.0f} s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "plan": "quick" if args.quick else "full",
            "cpus": os.cpu_count(),
            "max_new_tokens": MAX_NEW_TOKENS,
            "max_batch_size": MAX_BATCH_SIZE,
            "elapsed_s": elapsed,
            "engine": [r.as_dict() for r in engine],
            "fleet": [r.as_dict() for r in fleet],
            "ratios": overhead,
            "log_problems": problems,
        }
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if any(r.errors for r in fleet) else 0


if __name__ == "__main__":
    sys.exit(main())
