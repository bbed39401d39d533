"""``python -m bench.cores [--jobs N] [--json PATH]``: do CPU workers share the cores?

One backlog (N requests of the demo model, greedy, 32 new tokens, queued at once as one
batch) is drained by fleets of their own, one after another:

- 1 worker with every core (WORKER_THREADS = cores, as the launcher gives a lone worker);
- 3 workers with their share (WORKER_THREADS = cores // 3, at least 1, as the launcher
  gives them when MAX_WORKERS=3);
- 3 workers with every core each (WORKER_THREADS = cores): the old behaviour, for contrast;
- the 1 worker again, as a shared machine's speed drifts: ratios use the mean of both.

Sharing works when the 3 workers together are not slower than 1 worker.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

import requests

from bench.__main__ import CpuWatch
from bench.fleet import _answers, _env, start_redis
from bench.model import MAX_NEW_TOKENS, job_input
from fleet import commands
from fleet.processes import Process, free_port, wait_until
from shared.settings import DEMO_MODEL_ID
from workers.cpu_share import share_of_cores, usable_cores

JOBS = 96
WORKERS = 3
MAX_BATCH_SIZE = 16
READY_TIMEOUT_S = 300
DRAIN_TIMEOUT_S = 1800
NOISY_SHARE = 0.05  # others used more of the CPU than this during a drain: flagged
DRIFT_LIMIT = 0.15  # the 1-worker runs differ by more: flagged


@dataclass(frozen=True)
class Variant:
    label: str
    workers: int
    threads: int  # WORKER_THREADS of each worker


@dataclass(frozen=True)
class Drain:
    """One backlog drained by one fleet."""

    label: str
    workers: int
    threads: int
    jobs: int
    failed: int
    tokens: int
    wall_s: float  # the batch's created_at to completed_at, as the fleet stamped them
    jobs_per_s: float
    tokens_per_s: float
    mean_batch_size: float
    jobs_per_worker: list[int]
    fleet_cpu_share: float  # of the machine's CPU time, used by this fleet's processes
    others_cpu_share: float  # ... and by everything else on the machine

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def progress(message: str) -> None:
    print(f"[bench.cores] {message}", file=sys.stderr, flush=True)


@contextmanager
def running_workers(variant: Variant, logs: Path | None) -> Iterator[tuple[str, list[Process]]]:
    """Redis, ``variant.workers`` workers and one gateway process; yields the gateway's URL
    once every worker has its model loaded. Every process is stopped on the way out."""
    procs: list[Process] = []
    with tempfile.TemporaryDirectory(prefix="bench-cores-") as tmp:
        logs = (logs or Path(tmp) / "logs") / variant.label.replace(" ", "-")
        try:
            redis_url = start_redis(procs, Path(tmp) / "redis", logs)
            port = free_port()
            env = _env(redis_url, port, settings(variant))
            for index in range(variant.workers):
                name = f"{env['KEY_PREFIX']}-{index}@localhost"
                log = logs / f"worker{index}.log"
                procs.append(Process(f"worker{index}", commands.worker(name), env, log))
            procs.append(Process("gateway", commands.gateway(), env, logs / "gateway.log"))
            base = f"http://127.0.0.1:{port}"

            def ready() -> bool:
                answer = requests.get(base + "/readyz", timeout=2).json()
                return answer.get("workers", {}).get(DEMO_MODEL_ID) == variant.workers

            wait_until(lambda: _answers(ready), READY_TIMEOUT_S, "workers not ready", *procs)
            yield base, procs
        finally:
            for proc in reversed(procs):
                proc.stop()


def settings(variant: Variant) -> dict[str, str]:
    return {
        "WORKER_THREADS": str(variant.threads),
        "MAX_BATCH_SIZE": str(MAX_BATCH_SIZE),
        "GATEWAY_PROCESSES": "1",  # the gateway only takes one batch and a few polls here
        "WORKER_METRICS_PORT": "0",  # several workers: no port to share
    }


def submit_batch(http: requests.Session, base: str, jobs: int) -> dict:
    lines = [
        {"custom_id": f"r{i}", **job_input(i).model_dump(exclude_none=True)} for i in range(jobs)
    ]
    response = http.post(base + "/v1/batches", json={"requests": lines}, timeout=120)
    if response.status_code != 202:
        raise RuntimeError(f"batch not created: {response.status_code} {response.text[:300]}")
    return response.json()


def wait_ended(http: requests.Session, base: str, batch: dict) -> dict:
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while time.monotonic() < deadline:
        batch = http.get(base + batch["urls"]["get"], timeout=30).json()
        if batch["status"] in ("completed", "cancelled"):
            return batch
        time.sleep(0.25)
    raise RuntimeError(f"batch {batch['id']} not done after {DRAIN_TIMEOUT_S} s: {batch}")


def drain(base: str, procs: list[Process], variant: Variant, jobs: int) -> Drain:
    """Warm every worker up on one micro-batch each, then time the backlog."""
    with requests.Session() as http:
        wait_ended(http, base, submit_batch(http, base, MAX_BATCH_SIZE * variant.workers))
        fleet_cpu_before = _tree_cpu_s([p.pid for p in procs])
        with CpuWatch() as watch:
            batch = wait_ended(http, base, submit_batch(http, base, jobs))
        fleet_cpu_s = _tree_cpu_s([p.pid for p in procs]) - fleet_cpu_before
        finished = [
            http.get(f"{base}/v1/jobs/{json.loads(line)['job_id']}", timeout=30).json()
            for line in http.get(base + batch["urls"]["results"], timeout=60).text.splitlines()
        ]
    done = [job for job in finished if job["status"] == "succeeded"]
    wall = _seconds(batch["created_at"], batch["completed_at"])
    tokens = sum(job["output"]["usage"]["completion_tokens"] for job in done)
    per_worker = Counter(job["worker"] for job in done)
    machine_s = watch.wall_s * watch.cpus
    return Drain(
        label=variant.label,
        workers=variant.workers,
        threads=variant.threads,
        jobs=len(done),
        failed=len(finished) - len(done) + (jobs - len(finished)),
        tokens=tokens,
        wall_s=wall,
        jobs_per_s=len(done) / wall,
        tokens_per_s=tokens / wall,
        mean_batch_size=sum(job["metrics"]["batch_size"] for job in done) / max(1, len(done)),
        jobs_per_worker=sorted(per_worker.values(), reverse=True),
        fleet_cpu_share=fleet_cpu_s / machine_s,
        others_cpu_share=max(0.0, watch.others_s - fleet_cpu_s) / machine_s,
    )


def _seconds(began: str, ended: str) -> float:
    return (datetime.fromisoformat(ended) - datetime.fromisoformat(began)).total_seconds()


def _tree_cpu_s(leaders: list[int]) -> float:
    """CPU seconds used so far by every live process in the groups these processes lead
    (each fleet process starts its own session, so its children are in its group)."""
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it exited meanwhile
        if int(fields[2]) in leaders:  # pgrp; utime and stime follow
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def variants(cores: int, workers: int) -> list[Variant]:
    one = Variant("1 worker", 1, share_of_cores(cores, 1))
    return [
        one,
        Variant(f"{workers} workers, shared", workers, share_of_cores(cores, workers)),
        Variant(f"{workers} workers, all cores (before)", workers, cores),
        Variant("1 worker (again)", 1, one.threads),
    ]


def report(drains: list[Drain], ratios: dict[str, float], cores: int, jobs: int) -> str:
    lines = [
        f"Same backlog, {jobs} requests queued at once (one batch): demo model, greedy, "
        f"max_new_tokens={MAX_NEW_TOKENS}, MAX_BATCH_SIZE={MAX_BATCH_SIZE}, {cores} cores",
        f"{'fleet':<32}  {'threads':>7}  {'wall s':>6}  {'jobs/s':>6}  {'tok/s':>6}  "
        f"{'batch':>5}  {'fleet cpu':>9}  {'others':>6}  jobs per worker",
    ]
    for d in drains:
        lines.append(
            f"{d.label:<32}  {d.threads:>7}  {d.wall_s:>6.1f}  {d.jobs_per_s:>6.2f}  "
            f"{d.tokens_per_s:>6.1f}  {d.mean_batch_size:>5.1f}  {d.fleet_cpu_share:>9.0%}  "
            f"{d.others_cpu_share:>6.0%}  {d.jobs_per_worker}"
            + (f"  ({d.failed} failed)" if d.failed else "")
        )
    lines += [
        "(threads: WORKER_THREADS of each worker; batch: mean micro-batch size; fleet cpu and",
        " others: shares of the machine's CPU time while the backlog drained)",
        "",
        "tok/s over 1 worker's (the mean of its two runs):",
    ]
    lines += [f"  {label:<30}  {value:.2f}" for label, value in ratios.items()]
    return "\n".join(lines)


def doubts(drains: list[Drain], drift: float) -> list[str]:
    found = []
    noisy = [d.label for d in drains if d.others_cpu_share > NOISY_SHARE]
    if noisy:
        found.append(f"other processes used over {NOISY_SHARE:.0%} of the CPU during: {noisy}")
    if abs(drift - 1) > DRIFT_LIMIT:
        found.append(f"the 1-worker fleet's speed changed between its runs ({drift:.2f})")
    if any(d.failed for d in drains):
        found.append("some requests failed")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cores", description=__doc__)
    parser.add_argument("--jobs", type=int, default=JOBS, help="requests in the backlog")
    parser.add_argument("--workers", type=int, default=WORKERS, help="workers sharing the cores")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write results here")
    parser.add_argument("--logs", type=Path, metavar="DIR", help="keep the processes' logs here")
    args = parser.parse_args(argv)
    cores = usable_cores()
    began = time.monotonic()
    load_before = os.getloadavg()
    drains = []
    for variant in variants(cores, args.workers):
        progress(f"{variant.label}: WORKER_THREADS={variant.threads}; starting")
        with running_workers(variant, args.logs) as (base, procs):
            progress(f"{variant.label}: ready; warming up, then {args.jobs} requests")
            drains.append(drain(base, procs, variant, args.jobs))
    first, shared, before, again = drains
    baseline = (first.tokens_per_s + again.tokens_per_s) / 2
    drift = again.tokens_per_s / first.tokens_per_s
    ratios = {shared.label: shared.tokens_per_s / baseline}
    ratios[before.label] = before.tokens_per_s / baseline
    load_after = os.getloadavg()

    print(report(drains, ratios, cores, args.jobs))
    print(
        f"\n({time.monotonic() - began:.0f} s; load average {load_before[0]:.2f} at the "
        f"start, {load_after[0]:.2f} at the end; 1-worker drift {drift:.2f})"
    )
    found = doubts(drains, drift)
    for doubt in found:
        print(f"WARNING: {doubt}; these numbers are not reliable.")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "cores": cores,
            "jobs": args.jobs,
            "max_new_tokens": MAX_NEW_TOKENS,
            "max_batch_size": MAX_BATCH_SIZE,
            "drains": [d.as_dict() for d in drains],
            "ratios_over_1_worker": ratios,
            "one_worker_drift": drift,
            "load_average": {"start": load_before, "end": load_after},
            "warnings": found,
        }
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if any(d.failed for d in drains) else 0


if __name__ == "__main__":
    sys.exit(main())
