"""``make bench``: the vLLM engine (continuous batching) against bare vLLM and against the
transformers engine (micro-batches), measured in one run.

* Mixed lengths: 128 greedy jobs, ``max_new_tokens`` uniform in 8..128 (seeded), 32
  closed-loop clients. Useful tok/s (completion tokens / wall time) of bare vLLM
  (``LLM.generate`` on the same requests, at most 32 sequences at once), of the fleet with
  ENGINE=vllm and of the fleet with ENGINE=transformers; p50 latency of the jobs of at most
  24 tokens on both engines. A micro-batch runs until its longest job ends, so short jobs
  wait for long ones and finished rows idle; continuous batching refills them every step.
* Equal lengths: 96 jobs of 32 tokens, 16 clients, both engines: no short job to free a
  slot early, so this isolates the per-step cost of each engine.

Each workload runs 3 times on each engine (a run lasts seconds, so one hiccup of a shared
machine would decide it) and the run of median tok/s is reported. Bare vLLM runs in
.venv-vllm (:mod:`bench.bare_vllm`, a subprocess), before the fleets and again after them, as
``python -m bench`` does for the transformers engine: the ratios use the mean of both, and a
drift is reported. The machine's load is reported beside the numbers.

    python -m bench.engines [--json out.json] [--logs DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bench import bare_vllm
from bench.__main__ import CpuWatch
from bench.fleet import _one_job, closed_loop, percentile, running_fleet
from bench.model import PROMPTS, job_input
from shared.protocol import JobInput
from workers import demo_model

SEED = 7
MIXED_JOBS, MIXED_CLIENTS, MIXED_TOKENS = 128, 32, (8, 128)
SHORT_TOKENS = 24  # "short" jobs, whose latency a micro-batch hurts most
EQUAL_JOBS, EQUAL_CLIENTS = 96, 16  # bench.model.job_input: 32 tokens, greedy
MAX_BATCH_SIZE = 32  # micro-batch rows (transformers) = sequences at once (vllm, bare vllm)
SETTINGS = {"MAX_BATCH_SIZE": str(MAX_BATCH_SIZE), "MAX_QUEUE_DEPTH": "100000"}
# vLLM's CPU build sizes its KV cache from this (GiB); the tiny model needs little.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
TARGETS = {  # ratio: at least this
    "mixed_fleet_vllm_over_bare_vllm": 0.9,
    "mixed_fleet_vllm_over_fleet_transformers": 1.5,
    "equal_fleet_vllm_over_fleet_transformers": 1.0,
}
REPEATS = 3  # each workload runs this many times; the run of median tok/s is reported
DRIFT_LIMIT = 0.15  # bare vLLM before and after the fleets differ by more: flagged
NOISY_SHARE = 0.05  # above this share of the CPU used by others, the run is flagged


def progress(message: str) -> None:
    print(f"[bench.engines] {message}", file=sys.stderr, flush=True)


def mixed_lengths() -> list[int]:
    rng = random.Random(SEED)
    return [rng.randint(*MIXED_TOKENS) for _ in range(MIXED_JOBS)]


_LENGTHS = mixed_lengths()


def mixed_input(index: int) -> JobInput:
    return JobInput(
        prompt=PROMPTS[index % len(PROMPTS)], max_new_tokens=_LENGTHS[index], temperature=0.0
    )


@dataclass(frozen=True)
class Workload:
    name: str
    jobs: int
    clients: int
    make_input: Callable[[int], JobInput]


def warm_input(index: int) -> JobInput:
    """Untimed: a full batch whose jobs end one step apart, so each batch size runs once."""
    return JobInput(prompt=PROMPTS[index % len(PROMPTS)], max_new_tokens=index + 1)


WARM_UP = Workload("warm-up", MAX_BATCH_SIZE, MAX_BATCH_SIZE, warm_input)
WORKLOADS = (
    Workload("mixed", MIXED_JOBS, MIXED_CLIENTS, mixed_input),
    Workload("equal", EQUAL_JOBS, EQUAL_CLIENTS, job_input),
)


@dataclass(frozen=True)
class Result:
    """One engine on one workload."""

    jobs: int
    errors: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    p50_latency_s: float | None = None
    p50_short_latency_s: float | None = None  # jobs of at most SHORT_TOKENS tokens
    first_error: str | None = None
    tokens_per_s_runs: tuple[float, ...] = ()  # every repeat's, the reported one among them


def median_run(results: list[Result]) -> Result:
    """The run of median tok/s, with every run's tok/s beside it."""
    ranked = sorted(results, key=lambda r: r.tokens_per_s)
    rates = tuple(r.tokens_per_s for r in results)
    return replace(ranked[len(ranked) // 2], tokens_per_s_runs=rates)


def _latency_result(
    tokens: list[int], latencies: list[float], errors: list[str], wall: float
) -> Result:
    pairs = zip(tokens, latencies, strict=True) if latencies else []  # generate: no latency
    short = [s for t, s in pairs if t <= SHORT_TOKENS]
    return Result(
        jobs=len(tokens),
        errors=len(errors),
        tokens=sum(tokens),
        wall_s=round(wall, 3),
        tokens_per_s=round(sum(tokens) / wall, 1),
        p50_latency_s=round(percentile(latencies, 50), 3) if latencies else None,
        p50_short_latency_s=round(percentile(short, 50), 3) if short else None,
        first_error=errors[0] if errors else None,
    )


def measure_bare(model: Path) -> dict[str, Result]:
    """Both workloads on bare vLLM in .venv-vllm: mixed with ``LLM.generate``, equal with
    16 emulated closed-loop clients (``generate`` would run all 96 at once)."""
    runs = [
        {
            "name": f"{w.name}#{repeat}",
            "mode": "generate" if w.name == "mixed" else "clients",
            "clients": w.clients,
            "requests": [w.make_input(i).model_dump(exclude_none=True) for i in range(w.jobs)],
        }
        for w in WORKLOADS
        for repeat in range(REPEATS)
    ]
    spec = {"model": str(model), "device": "cpu", "max_num_seqs": MAX_BATCH_SIZE, "runs": runs}
    out = bare_vllm.start(spec, VLLM_ENV)
    results: dict[str, list[Result]] = {}
    for name, run in out["runs"].items():
        reqs = run["requests"]
        latencies = [r["latency_s"] for r in reqs if "latency_s" in r]
        result = _latency_result([r["tokens"] for r in reqs], latencies, [], run["wall_s"])
        results.setdefault(name.split("#")[0], []).append(result)
    return {name: median_run(runs) for name, runs in results.items()}


def _fleet_workload(base_url: str, w: Workload) -> Result:
    samples, errors, wall = closed_loop(
        w.clients, w.jobs, lambda http, i: _one_job(http, base_url, i, w.make_input)
    )
    return _latency_result([s.tokens for s in samples], [s.seconds for s in samples], errors, wall)


def fleet(engine: str, logs: Path | None) -> tuple[dict[str, Result], list[str]]:
    """One fleet with ``engine``: both workloads, after an untimed warm-up."""
    settings = SETTINGS | (VLLM_ENV if engine == "vllm" else {})
    progress(f"fleet with ENGINE={engine}: starting redis, the worker and the gateway")
    with running_fleet(settings, logs / engine if logs else None, engine=engine) as running:
        _fleet_workload(running.base_url, WARM_UP)
        results = {}
        for w in WORKLOADS:
            progress(f"fleet {engine}: {w.name}, {w.jobs} jobs, {w.clients} clients, x{REPEATS}")
            runs = [_fleet_workload(running.base_url, w) for _ in range(REPEATS)]
            results[w.name] = median_run(runs)
        return results, log_problems(running.problems(limit=200))[:20]


def log_problems(lines: list[str]) -> list[str]:
    """bench.fleet's problems() less vLLM's INFO lines, which Celery relays as warnings."""
    return [line for line in lines if " INFO " not in line]


def ratios(bare: dict[str, float], vllm: dict[str, Result], tf: dict[str, Result]):
    """The targets' ratios; ``bare`` is bare vLLM's mean tok/s before and after the fleets."""
    return {
        "mixed_fleet_vllm_over_bare_vllm": vllm["mixed"].tokens_per_s / bare["mixed"],
        "mixed_fleet_vllm_over_fleet_transformers": (
            vllm["mixed"].tokens_per_s / tf["mixed"].tokens_per_s
        ),
        "equal_fleet_vllm_over_fleet_transformers": (
            vllm["equal"].tokens_per_s / tf["equal"].tokens_per_s
        ),
        "equal_fleet_vllm_over_bare_vllm": vllm["equal"].tokens_per_s / bare["equal"],
    }


def report(rows: dict[str, dict[str, Result]], found: dict[str, float]) -> str:
    def cell(value: float | None) -> str:
        return f"{value:>9.3f}" if value is not None else f"{'-':>9}"

    lines = [
        f"Mixed: {MIXED_JOBS} jobs, max_new_tokens uniform {MIXED_TOKENS[0]}..{MIXED_TOKENS[1]} "
        f"(seed {SEED}), {MIXED_CLIENTS} clients; equal: {EQUAL_JOBS} jobs x 32 tokens, "
        f"{EQUAL_CLIENTS} clients; greedy; MAX_BATCH_SIZE={MAX_BATCH_SIZE}; each run {REPEATS} "
        "times, the run of median tok/s shown",
        f"{'engine':<20} {'workload':<6} {'jobs':>4} {'errors':>6} {'tokens':>6} "
        f"{'wall s':>7} {'tok/s':>7} {'p50 s':>9} {'p50<=24 s':>9}  tok/s of the runs",
    ]
    for engine, results in rows.items():
        for name, r in results.items():
            lines.append(
                f"{engine:<20} {name:<6} {r.jobs:>4} {r.errors:>6} {r.tokens:>6} "
                f"{r.wall_s:>7.2f} {r.tokens_per_s:>7.1f} {cell(r.p50_latency_s)} "
                f"{cell(r.p50_short_latency_s)}  "
                + ", ".join(f"{v:.0f}" for v in r.tokens_per_s_runs)
            )
    lines += ["", "Ratios (median tok/s over median tok/s; bare vLLM: mean of before and after)"]
    for key, value in found.items():
        target = TARGETS.get(key)
        verdict = (
            ""
            if target is None
            else f"  target >= {target}: " + ("met" if value >= target else "MISSED")
        )
        lines.append(f"  {key:<42} {value:>5.2f}{verdict}")
    return "\n".join(lines)


def doubts(drift: dict[str, float], busy: dict[str, float]) -> list[str]:
    """Why this run's numbers should not be trusted, if there is a reason."""
    found = [
        f"bare vLLM {n} drifted x{d:.2f}" for n, d in drift.items() if abs(d - 1) > DRIFT_LIMIT
    ]
    if max(busy.values()) > NOISY_SHARE:
        found.append("other processes competed for the CPU")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engines", description=__doc__)
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write results here")
    parser.add_argument("--logs", type=Path, metavar="DIR", help="keep the fleets' logs here")
    args = parser.parse_args(argv)
    began, load_before = time.monotonic(), os.getloadavg()
    model = demo_model.build()
    watches: dict[str, CpuWatch] = {}

    progress("bare vLLM (.venv-vllm subprocess)")
    with CpuWatch() as watches["bare_before"]:
        bare_before = measure_bare(model)
    with CpuWatch() as watches["fleet_vllm"]:
        vllm, vllm_problems = fleet("vllm", args.logs)
    with CpuWatch() as watches["fleet_transformers"]:
        tf, tf_problems = fleet("transformers", args.logs)
    progress("bare vLLM again, now that the fleets have stopped")
    with CpuWatch() as watches["bare_after"]:
        bare_after = measure_bare(model)

    bare = {n: (bare_before[n].tokens_per_s + r.tokens_per_s) / 2 for n, r in bare_after.items()}
    drift = {n: r.tokens_per_s / bare_before[n].tokens_per_s for n, r in bare_after.items()}
    found = ratios(bare, vllm, tf)
    rows = {
        "bare vllm (before)": bare_before,
        "bare vllm (after)": bare_after,
        "fleet vllm": vllm,
        "fleet transformers": tf,
    }
    busy = {name: round(w.share, 3) for name, w in watches.items()}
    problems = [f"vllm {p}" for p in vllm_problems] + [f"transformers {p}" for p in tf_problems]
    elapsed, load_after = time.monotonic() - began, os.getloadavg()
    warnings = doubts(drift, busy)

    print(report(rows, found))
    if problems:
        print("\nWarnings and errors in the fleets' logs (first 20 each):")
        print("\n".join(f"  {line}" for line in problems))
    print(
        f"\n({os.cpu_count()} CPUs, {elapsed:.0f} s; load average {load_before[0]:.2f} at "
        f"start, {load_after[0]:.2f} at end; share of the CPU other processes used: "
        + ", ".join(f"{k} {v:.0%}" for k, v in busy.items())
        + ")"
    )
    for doubt in warnings:
        print(f"WARNING: {doubt}; these numbers are not reliable.")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        workloads = {w.name: {"jobs": w.jobs, "clients": w.clients} for w in WORKLOADS}
        workloads["mixed"] |= {"seed": SEED, "max_new_tokens": _LENGTHS}
        workloads["equal"] |= {"max_new_tokens": 32}
        result = {
            "workloads": workloads,
            "fleet_settings": SETTINGS,
            "cpus": os.cpu_count(),
            "elapsed_s": round(elapsed, 1),
            "load_average": {"start": load_before, "end": load_after},
            "results": {e: {n: asdict(r) for n, r in rs.items()} for e, rs in rows.items()},
            "bare_vllm_drift": drift,
            "ratios": found,
            "targets": TARGETS,
            "other_processes_cpu_share": busy,
            "warnings": warnings,
            "log_problems": problems,
        }
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if any(r.errors for rs in rows.values() for r in rs.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
