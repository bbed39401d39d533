"""``python -m bench.cache [--requests N] [--prompts N] [--clients N]``: the result cache.

One fleet (its own Redis, one worker, the gateway) with the result cache on. A replay of
``--requests`` greedy requests drawn from ``--prompts`` distinct prompts, Zipf-like (the
k-th most asked prompt drawn with weight 1/k, as real traffic repeats a few questions
often), is sent twice in the same order by ``--clients`` closed-loop clients: first with
``"cache": false`` on every request (the fleet computes each one), then as is. Reported for
each: jobs/s, p50 and p99 latency, and how many requests were hits, coalesced or computed;
then the ratios, measured in this one run.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import requests

from bench.fleet import TIMEOUT_S, WAIT_S, closed_loop, percentile, running_fleet
from bench.model import MAX_NEW_TOKENS, PROMPTS

SEED = 2026


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cache", description=__doc__)
    parser.add_argument("--requests", type=int, default=1000, help="requests in the replay")
    parser.add_argument("--prompts", type=int, default=200, help="distinct prompts among them")
    parser.add_argument("--clients", type=int, default=16, help="closed-loop clients")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write results here")
    args = parser.parse_args(argv)
    prompts = replay(args.requests, args.prompts)
    settings = {"CACHE_ENABLED": "1", "MAX_BATCH_SIZE": "16"}
    progress(f"{args.requests} requests over {len(set(prompts))} distinct prompts")
    with running_fleet(settings) as fleet:
        run_phase(fleet.base_url, prompts[:32], args.clients, cache=False)  # warm-up
        progress("cache off")
        off = run_phase(fleet.base_url, prompts, args.clients, cache=False)
        progress("cache on")
        on = run_phase(fleet.base_url, prompts, args.clients, cache=True)
        problems = fleet.problems()
    print(
        f"Result cache: {args.requests} greedy requests over {args.prompts} prompts "
        f"(Zipf-like, {len(set(prompts))} asked), {args.clients} clients, "
        f"max_new_tokens {MAX_NEW_TOKENS}"
    )
    for phase in (off, on):
        print(
            f"  cache {'on ' if phase['cache'] else 'off'}: {phase['jobs_per_s']:8.1f} jobs/s  "
            f"p50 {phase['p50_s'] * 1000:7.1f} ms  p99 {phase['p99_s'] * 1000:7.1f} ms  "
            f"errors {phase['errors']}  {phase['outcomes']}"
        )
    speedup = on["jobs_per_s"] / off["jobs_per_s"]
    print(f"  cache on vs off: {speedup:.2f}x jobs/s, p50 {on['p50_s'] / off['p50_s']:.2f}x")
    for line in problems[:5]:
        print(f"  log: {line}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {"args": vars(args) | {"json": str(args.json)}, "off": off, "on": on}
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if off["errors"] or on["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
