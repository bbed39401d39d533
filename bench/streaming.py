"""``make bench``: token streaming, measured on one fleet in one run.

* time to first token (the first ``token`` event of ``POST /v1/jobs`` with
  ``"stream": true``), p50 and p99, at 1 and 16 concurrent streaming clients, beside the
  worker's decode step and the fill window (MAX_BATCH_WAIT_MS) it should be close to;
* throughput of 16 streaming clients as a ratio of 16 that wait for the whole job;
* 500 open streams held by the gateway (the worker stopped, so they stay open) while
  submits and polls are timed.

    python -m bench.streaming [--jobs 96] [--streams 500] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time
from urllib.parse import urlsplit

import requests

from bench.fleet import closed_loop, percentile, running_fleet

NEW_TOKENS = 32
SETTINGS = {"MAX_BATCH_SIZE": "16", "MAX_BATCH_WAIT_MS": "20", "MAX_QUEUE_DEPTH": "100000"}


def progress(message: str) -> None:
    print(f"[bench.streaming] {message}", flush=True)


def _body(index: int, stream: bool) -> dict:
    return {"prompt": f"Story {index}:", "max_new_tokens": NEW_TOKENS, "stream": stream}


def stream_one(http: requests.Session, base: str, index: int) -> tuple[float, dict]:
    return stream_job(http, base, _body(index, True))


def stream_job(
    http: requests.Session, base: str, body: dict, timeout_s: float = 120
) -> tuple[float, dict]:
    """(seconds to the first token event, the finished job) of one streamed job."""
    began = time.perf_counter()
    first, job, event = None, {}, ""
    with http.post(base + "/v1/jobs", json=body | {"stream": True}, stream=True,
                   timeout=timeout_s) as r:  # fmt: skip
        r.raise_for_status()
        for line in r.iter_lines(decode_unicode=True):
            if line.startswith("event: "):
                event = line[7:]
                if event == "token" and first is None:
                    first = time.perf_counter() - began
            elif line.startswith("data: ") and event == "done":
                job = json.loads(line[6:])
    if job.get("status") != "succeeded" or first is None:
        raise RuntimeError(f"stream ended {job.get('status')}: {job.get('error')}")
    return first, job


def wait_one(http: requests.Session, base: str, index: int) -> tuple[float, dict]:
    began = time.perf_counter()
    r = http.post(base + "/v1/jobs", json=_body(index, False), headers={"Prefer": "wait=60"},
                  timeout=120)  # fmt: skip
    job = r.json()
    if job.get("status") != "succeeded":
        raise RuntimeError(f"job not done: {job.get('status')}")
    return time.perf_counter() - began, job


def run_clients(base: str, clients: int, jobs: int, stream: bool) -> dict:
    """``clients`` threads share ``jobs`` requests, one at a time each."""
    one = stream_one if stream else wait_one
    results, errors, wall = closed_loop(clients, jobs, lambda http, i: one(http, base, i))
    if errors:
        raise RuntimeError(f"{len(errors)} of {jobs} jobs failed: {errors[0]}")
    firsts = [seconds for seconds, _ in results]
    done = [job for _, job in results]
    tokens = sum(j["output"]["usage"]["completion_tokens"] for j in done)
    step_s = statistics.mean(
        j["metrics"]["inference_seconds"] / j["output"]["usage"]["completion_tokens"] for j in done
    )
    out = {"clients": clients, "jobs": len(done), "wall_s": round(wall, 3),
           "tokens_per_s": round(tokens / wall, 1), "mean_step_s": round(step_s, 4)}  # fmt: skip
    if stream:
        out |= {"ttft_p50_s": round(percentile(firsts, 50), 3),
                "ttft_p99_s": round(percentile(firsts, 99), 3)}  # fmt: skip
    return out


def open_streams(base: str, count: int, probes: int) -> dict:
    """Hold ``count`` event streams open (of jobs that stay queued), then time submits and
    polls."""
    http = requests.Session()
    job_ids = []
    for i in range(20):  # streaming jobs: each open stream waits in its own XREAD
        with http.post(base + "/v1/jobs", json=_body(i, True), stream=True, timeout=30) as r:
            job_ids.append(r.headers["Fleet-Job-Id"])  # closing it leaves the job queued
    host, port = urlsplit(base).hostname, urlsplit(base).port
    sockets = []
    try:
        for i in range(count):
            sock = socket.create_connection((host, port), timeout=30)
            path = f"/v1/jobs/{job_ids[i % len(job_ids)]}/events"
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            sockets.append(sock)
        for sock in sockets:  # each answered 200 and holds its stream open
            head = sock.recv(4096)
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"stream refused: {head[:80]!r}")
        submits, polls = [], []
        for i in range(probes):
            began = time.perf_counter()
            job = http.post(base + "/v1/jobs", json={"prompt": f"p{i}", "max_new_tokens": 1},
                            timeout=30).json()  # fmt: skip
            submits.append(time.perf_counter() - began)
            began = time.perf_counter()
            http.get(base + f"/v1/jobs/{job['id']}", timeout=30).raise_for_status()
            polls.append(time.perf_counter() - began)
        return {
            "open_streams": len(sockets),
            "submit_p50_ms": round(1000 * percentile(submits, 50), 1),
            "submit_p99_ms": round(1000 * percentile(submits, 99), 1),
            "poll_p50_ms": round(1000 * percentile(polls, 50), 1),
            "poll_p99_ms": round(1000 * percentile(polls, 99), 1),
        }
    finally:
        for sock in sockets:
            sock.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=96, help="jobs per throughput run")
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    results: dict[str, object] = {}
    with running_fleet(SETTINGS) as fleet:
        base = fleet.base_url
        run_clients(base, 4, 8, stream=True)  # warm up
        progress("time to first token, 1 client")
        results["stream_1"] = run_clients(base, 1, 12, stream=True)
        progress("16 clients, streaming and not (the same jobs)")
        results["stream_16"] = run_clients(base, 16, args.jobs, stream=True)
        results["wait_16"] = run_clients(base, 16, args.jobs, stream=False)
        results["stream_vs_wait_throughput"] = round(
            results["stream_16"]["tokens_per_s"] / results["wait_16"]["tokens_per_s"], 3
        )
        progress(f"{args.streams} open streams (worker stopped)")
        next(p for p in fleet.processes if p.name == "worker").stop()
        results["open_streams"] = open_streams(base, args.streams, probes=50)
    window_s = int(SETTINGS["MAX_BATCH_WAIT_MS"]) / 1000
    one = results["stream_1"]
    print(f"time to first token, 1 client:   p50 {one['ttft_p50_s']:.3f} s  p99 "
          f"{one['ttft_p99_s']:.3f} s  (decode step {one['mean_step_s']:.3f} s, fill window "
          f"{window_s:.3f} s)")  # fmt: skip
    sixteen = results["stream_16"]
    print(f"time to first token, 16 clients: p50 {sixteen['ttft_p50_s']:.3f} s  p99 "
          f"{sixteen['ttft_p99_s']:.3f} s  "
          f"(decode step {sixteen['mean_step_s']:.3f} s)")  # fmt: skip
    print(f"throughput, 16 clients: streaming {sixteen['tokens_per_s']} tok/s, waiting "
          f"{results['wait_16']['tokens_per_s']} tok/s: ratio "
          f"{results['stream_vs_wait_throughput']}")  # fmt: skip
    held = results["open_streams"]
    print(f"{held['open_streams']} open streams: submit p50 {held['submit_p50_ms']} ms p99 "
          f"{held['submit_p99_ms']} ms; poll p50 {held['poll_p50_ms']} ms p99 "
          f"{held['poll_p99_ms']} ms")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
