"""``python -m bench.cache [--requests N] [--prompts N] [--clients N]``: the result cache.

One fleet (its own Redis, one worker, the gateway) with the result cache on. A replay of
``--requests`` greedy requests drawn from ``--prompts`` distinct prompts, Zipf-like (the
k-th most asked prompt drawn with weight 1/k, as real traffic repeats a few questions
often), is sent twice in the same order by ``--clients`` closed-loop clients: first with
``"cache": false`` on every request (the fleet computes each one), then as is. Reported for
each: jobs/s, p50 and p99 latency, and how many requests were hits, coalesced or computed;
then the ratios, measured in this one run.

Then the cost of a miss on the submit path: a second fleet (as ``bench.submit``'s, its
worker paused so the cores go to the gateway), where wrk alternates, round after round,
between bodies with ``"cache": false`` and without (every prompt new, so each is a lookup
that misses, then the in-flight mark): submits/s, p50, and the gateway's and Redis's CPU
per submit. Alternating in one fleet keeps the machine's drift out of the ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import requests

from bench.fleet import (
    LOG_ERROR,
    TIMEOUT_S,
    WAIT_S,
    closed_loop,
    percentile,
    running_fleet,
)
from bench.model import MAX_NEW_TOKENS, PROMPTS
from bench.submit import (
    BODY,
    MAX_QUEUE_DEPTH,
    _cpu_shares,
    _cpu_snapshot,
    _default_processes,
    run_wrk,
    submit_fleet,
    wrk_script,
)
from fleet import commands

SEED = 2026
CONNECTIONS = 64  # wrk's, as bench.submit


def progress(message: str) -> None:
    print(f"[bench.cache] {message}", file=sys.stderr, flush=True)


def replay(requests_: int, prompts: int) -> list[str]:
    """The prompts of the replay, in order: Zipf-like over ``prompts`` distinct ones."""
    rng = random.Random(SEED)
    tag = uuid.uuid4().hex[:8]  # nothing from an earlier run is in this fleet's cache
    distinct = [f"{PROMPTS[i % len(PROMPTS)]} (question {i}, {tag})" for i in range(prompts)]
    weights = [1 / (k + 1) for k in range(prompts)]
    return rng.choices(distinct, weights=weights, k=requests_)


def run_phase(base: str, prompts: list[str], clients: int, cache: bool) -> dict:
    def one(http: requests.Session, index: int) -> tuple[float, str]:
        body = {"prompt": prompts[index], "max_new_tokens": MAX_NEW_TOKENS, "cache": cache}
        began = time.perf_counter()
        response = http.post(
            base + "/v1/jobs", json=body, headers={"Prefer": f"wait={WAIT_S}"}, timeout=TIMEOUT_S
        )
        job = response.json()
        if job.get("status") != "succeeded":
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        return time.perf_counter() - began, response.headers.get("Fleet-Cache", "off")

    results, errors, wall = closed_loop(clients, len(prompts), one)
    latencies = [seconds for seconds, _ in results]
    return {
        "cache": cache,
        "jobs": len(results),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "wall_s": round(wall, 3),
        "jobs_per_s": round(len(results) / wall, 2),
        "p50_s": round(percentile(latencies, 50), 4),
        "p99_s": round(percentile(latencies, 99), 4),
        "outcomes": dict(Counter(outcome for _, outcome in results)),
    }


def miss_cost(rounds: int, seconds: float) -> dict:
    """Submits through the gateway of one fleet (cache on, worker paused, so the machine's
    cores go to the submit path), wrk alternating in each round between bodies with
    ``"cache": false`` and without (every prompt new: each one a miss): medians of
    submits/s, p50, and the gateway's and Redis's CPU per submit."""
    bodies = {"off": BODY.replace("}", ', "cache": false}'), "miss": BODY}
    settings = {
        "GATEWAY_PROCESSES": str(_default_processes()),
        "CACHE_ENABLED": "1",
        "MAX_QUEUE_DEPTH": str(MAX_QUEUE_DEPTH),
    }
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in bodies}
    with (
        tempfile.TemporaryDirectory(prefix="bench-cache-") as tmp,
        submit_fleet(commands.ROOT, settings, Path(tmp)) as fleet,
    ):
        url = fleet.base_url + "/v1/jobs"
        script = Path(tmp) / "submit.lua"
        script.write_text(wrk_script(bodies["miss"]))
        run_wrk(url, script, 3, CONNECTIONS, 1)  # warm-up
        worker = next(p for p in fleet.processes if p.name == "worker")
        worker.signal(signal.SIGSTOP)
        try:
            for _ in range(rounds):
                for mode in bodies:
                    script.write_text(wrk_script(bodies[mode]))  # prompts no run sent
                    before, wall = _cpu_snapshot(fleet), time.monotonic()
                    wrk = run_wrk(url, script, seconds, CONNECTIONS, 1)
                    cpu = _cpu_shares(before, _cpu_snapshot(fleet), time.monotonic() - wall)
                    wall = time.monotonic() - wall
                    done = wrk["requests"] - wrk["non_2xx"]
                    runs[mode].append({
                        "submits_per_s": done / (wrk["duration_us"] / 1e6),
                        "p50_ms": wrk["p50_us"] / 1000,
                        "gateway_cpu_us": cpu["gateway"] * wall / max(1, done) * 1e6,
                        "redis_cpu_us": cpu["redis"] * wall / max(1, done) * 1e6,
                    })  # fmt: skip
        finally:
            worker.signal(signal.SIGCONT)
    cost: dict = {
        mode: {k: round(statistics.median(r[k] for r in rows), 1) for k in rows[0]}
        for mode, rows in runs.items()
    }
    # Each miss run against the run just before it, so the machine's drift cancels out.
    paired = [m["submits_per_s"] / o["submits_per_s"] for o, m in zip(*runs.values(), strict=True)]
    cost["paired_ratios"] = [round(r, 3) for r in paired]
    return cost


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cache", description=__doc__)
    parser.add_argument("--requests", type=int, default=1000, help="requests in the replay")
    parser.add_argument("--prompts", type=int, default=200, help="distinct prompts among them")
    parser.add_argument("--clients", type=int, default=16, help="closed-loop clients")
    parser.add_argument("--cost-rounds", type=int, default=8, help="miss cost: rounds")
    parser.add_argument("--cost-seconds", type=float, default=6, help="miss cost: one wrk run")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write results here")
    args = parser.parse_args(argv)
    prompts = replay(args.requests, args.prompts)
    settings = {"CACHE_ENABLED": "1", "MAX_BATCH_SIZE": "16"}
    progress(f"{args.requests} requests over {len(set(prompts))} distinct prompts")
    with running_fleet(settings) as fleet:
        run_phase(fleet.base_url, prompts[:32], args.clients, cache=False)  # warm-up
        progress("cache off")
        replay_off = run_phase(fleet.base_url, prompts, args.clients, cache=False)
        progress("cache on")
        replay_on = run_phase(fleet.base_url, prompts, args.clients, cache=True)
        problems = fleet.problems()
    print(
        f"Result cache: {args.requests} greedy requests over {args.prompts} prompts "
        f"(Zipf-like, {len(set(prompts))} asked), {args.clients} clients, "
        f"max_new_tokens {MAX_NEW_TOKENS}"
    )
    for phase in (replay_off, replay_on):
        print(
            f"  cache {'on ' if phase['cache'] else 'off'}: {phase['jobs_per_s']:8.1f} jobs/s  "
            f"p50 {phase['p50_s'] * 1000:7.1f} ms  p99 {phase['p99_s'] * 1000:7.1f} ms  "
            f"errors {phase['errors']}  {phase['outcomes']}"
        )
    speedup = replay_on["jobs_per_s"] / replay_off["jobs_per_s"]
    p50 = replay_on["p50_s"] / replay_off["p50_s"]
    print(f"  cache on vs off: {speedup:.2f}x jobs/s, p50 {p50:.2f}x")
    for line in [line for line in problems if LOG_ERROR.search(line)][:5]:
        print(f"  log: {line}")
    progress("the cost of a miss on the submit path")
    cost = miss_cost(args.cost_rounds, args.cost_seconds)
    print(
        f"Submit path: POST /v1/jobs under wrk (c={CONNECTIONS}, worker paused), "
        f"{args.cost_rounds} rounds of {args.cost_seconds:g} s a mode, one fleet (medians):"
    )
    for mode, row in ((m, cost[m]) for m in ("off", "miss")):
        print(
            f"  cache {mode:<4}: {row['submits_per_s']:7.0f} submits/s  p50 "
            f"{row['p50_ms']:5.1f} ms  gateway {row['gateway_cpu_us']:5.0f} us  Redis "
            f"{row['redis_cpu_us']:4.0f} us CPU a submit"
        )
    off, miss = cost["off"], cost["miss"]
    print(
        f"  a miss: {statistics.median(cost['paired_ratios']):.3f}x submits/s (median of the "
        f"rounds' ratios {cost['paired_ratios']}), "
        f"{miss['gateway_cpu_us'] - off['gateway_cpu_us']:+.0f} us gateway and "
        f"{miss['redis_cpu_us'] - off['redis_cpu_us']:+.0f} us Redis CPU a submit"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {"args": vars(args) | {"json": str(args.json)}, "off": replay_off, "on": replay_on,
                  "miss_cost": cost}  # fmt: skip
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if replay_off["errors"] or replay_on["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
