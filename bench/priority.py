"""``python -m bench.priority [--batch N] [--jobs N]``: do single jobs overtake a big batch?

One fleet (its own Redis, one worker, the gateway). Single jobs are timed one after another
on the idle fleet, then again while a batch of N requests is queued and running, then the
batch is cancelled. The report is the ratio of the two latencies, measured in this one run:
with the batch's requests in a lower-priority stream, a single job waits for at most the
micro-batch the worker is generating, never for the batch's backlog.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import requests

from bench.fleet import percentile, running_fleet
from bench.model import MAX_NEW_TOKENS, job_input

MAX_BATCH_SIZE = 16


def progress(message: str) -> None:
    print(f"[bench.priority] {message}", file=sys.stderr, flush=True)


def single_jobs(http: requests.Session, base: str, count: int, batch_url: str | None) -> dict:
    """Latency of ``count`` single jobs in a row, and how far the batch got meanwhile."""
    latencies, queue_s, batch_done = [], [], []
    for index in range(count):
        body = job_input(index).model_dump(exclude_none=True)
        began = time.perf_counter()
        job = http.post(
            base + "/v1/jobs", json=body, headers={"Prefer": "wait=60"}, timeout=90
        ).json()
        latencies.append(time.perf_counter() - began)
        if job.get("status") != "succeeded":
            raise RuntimeError(f"single job did not succeed: {job}")
        queue_s.append(job["metrics"]["queue_seconds"])
        if batch_url:
            counts = http.get(base + batch_url, timeout=30).json()["request_counts"]
            batch_done.append(counts["completed"] + counts["failed"])
    return {
        "jobs": count,
        "p50_s": statistics.median(latencies),
        "p90_s": percentile(latencies, 90),
        "max_s": max(latencies),
        "mean_queue_s": statistics.mean(queue_s),
        "batch_requests_done_during": (batch_done[-1] - batch_done[0]) if batch_done else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.priority", description=__doc__)
    parser.add_argument("--batch", type=int, default=10_000, help="requests in the batch")
    parser.add_argument("--jobs", type=int, default=20, help="single jobs per phase")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write results here")
    args = parser.parse_args(argv)
    settings = {"MAX_BATCH_SIZE": str(MAX_BATCH_SIZE), "BATCH_MAX_REQUESTS": str(args.batch)}
    progress(f"starting a fleet ({settings})")
    with running_fleet(settings) as fleet, requests.Session() as http:
        base = fleet.base_url
        single_jobs(http, base, 5, None)  # warm up
        progress(f"{args.jobs} single jobs on the idle fleet")
        idle = single_jobs(http, base, args.jobs, None)

        lines = [
            {"custom_id": f"r{i}", **job_input(i).model_dump(exclude_none=True)}
            for i in range(args.batch)
        ]
        began = time.perf_counter()
        response = http.post(base + "/v1/batches", json={"requests": lines}, timeout=300)
        create_s = time.perf_counter() - began
        if response.status_code != 202:
            raise RuntimeError(f"batch not created: {response.status_code} {response.text[:300]}")
        batch = response.json()
        while http.get(base + batch["urls"]["get"], timeout=30).json()["status"] == "queued":
            time.sleep(0.1)
        progress(f"batch of {args.batch} created in {create_s:.2f} s and running; single jobs")
        busy = single_jobs(http, base, args.jobs, batch["urls"]["get"])

        began = time.perf_counter()
        cancelled = http.post(base + batch["urls"]["cancel"], timeout=300).json()
        cancel_s = time.perf_counter() - began
        left = cancelled["request_counts"]
    result = {
        "batch_requests": args.batch,
        "max_new_tokens": MAX_NEW_TOKENS,
        "max_batch_size": MAX_BATCH_SIZE,
        "batch_create_s": create_s,
        "batch_cancel_s": cancel_s,
        "batch_at_cancel": left,
        "single_jobs_idle": idle,
        "single_jobs_with_batch": busy,
        "p50_ratio_with_over_without": busy["p50_s"] / idle["p50_s"],
    }
    print(
        f"Single jobs ({args.jobs} in a row, {MAX_NEW_TOKENS} new tokens, 1 worker, "
        f"MAX_BATCH_SIZE={MAX_BATCH_SIZE}):\n"
        f"  idle fleet:               p50 {idle['p50_s']:.3f} s  p90 {idle['p90_s']:.3f} s  "
        f"max {idle['max_s']:.3f} s\n"
        f"  {args.batch} batch requests queued: p50 {busy['p50_s']:.3f} s  "
        f"p90 {busy['p90_s']:.3f} s  max {busy['max_s']:.3f} s  "
        f"(batch requests done meanwhile: {busy['batch_requests_done_during']})\n"
        f"  ratio p50 with/without: {result['p50_ratio_with_over_without']:.2f}\n"
        f"Batch: created in {create_s:.2f} s, cancelled in {cancel_s:.2f} s "
        f"(counts at cancel: {left})"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
