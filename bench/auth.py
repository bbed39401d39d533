"""``python -m bench.auth``: what API keys and per-key limits cost, and what they protect.

1. **Overhead on the submit path.** One Redis, one worker (paused, so the cores go to the
   gateway) and two gateways on them: one with keys off, one with REQUIRE_API_KEYS=1 and a
   key whose requests and tokens per minute and queue cap are far above the load (every
   check runs, none refuses). wrk (c=64) alternates, round after round, between no key, a
   key without per-minute limits (the key's lookup and its queue cap) and a key with
   requests and tokens per minute as well, so the machine's drift stays out of the ratios:
   submits/s, p50, gateway and Redis CPU a submit (medians), and the paired ratios.
2. **Two keys.** A fleet with keys on and MAX_QUEUE_DEPTH 1000 (so KEY_MAX_QUEUED, a
   quarter of it, is 250). Key A floods 5,000 jobs from 16 clients while key B submits
   single jobs one at a time (``Prefer: wait``); then B alone on the idle fleet. Reported:
   A's accepted jobs and 429s (by code), B's accepted jobs and 429s, B's latency beside the
   idle fleet's, and whether every accepted job reached a terminal state.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import redis
import requests

from bench.fleet import READY_TIMEOUT_S, RunningFleet, _answers, _env, percentile, start_redis
from bench.submit import (
    BODY,
    MAX_QUEUE_DEPTH,
    _cpu_shares,
    _cpu_snapshot,
    _default_processes,
    run_wrk,
    wrk_script,
)
from fleet import commands
from fleet.processes import Process, free_port, wait_until
from shared.api_keys import ApiKeyStore
from shared.keys import Keys

CONNECTIONS = 64  # wrk's, as bench.submit
FLOOD_JOBS = 5000
FLOOD_CLIENTS = 16
FLOOD_DEPTH = 1000
TERMINAL = {"succeeded", "failed", "canceled", "expired"}


def progress(message: str) -> None:
    print(f"[bench.auth] {message}", file=sys.stderr, flush=True)


@contextmanager
def keyed_fleet(tmp: Path, settings: dict[str, str], gateways: dict[str, dict[str, str]]):
    """redis-server, one worker, and one gateway per entry of ``gateways`` (name -> its own
    settings). Yields the fleet, each gateway's base URL, and the fleet's API key store."""
    procs: list[Process] = []
    try:
        redis_url = start_redis(procs, tmp / "redis", tmp)
        env = _env(redis_url, free_port(), {**settings, "WORKER_METRICS_PORT": "0"})
        name = f"{env['KEY_PREFIX']}@localhost"
        procs.append(Process("worker", commands.worker(name, "warning"), env, tmp / "worker.log"))
        urls = {}
        for gateway, extra in gateways.items():
            port = free_port()
            own = env | extra | {"GATEWAY_PORT": str(port)}
            procs.append(Process(gateway, commands.gateway(), own, tmp / f"{gateway}.log"))
            urls[gateway] = f"http://127.0.0.1:{port}"
        for url in urls.values():
            wait_until(
                lambda url=url: _answers(
                    lambda: requests.get(url + "/readyz", timeout=2).status_code == 200
                ),
                READY_TIMEOUT_S, "fleet not ready", *procs,
            )  # fmt: skip
        client = redis.Redis.from_url(redis_url, decode_responses=True)
        yield RunningFleet("", procs), urls, ApiKeyStore(client, Keys(env["KEY_PREFIX"]), 60)
    finally:
        for proc in reversed(procs):
            proc.stop(timeout_s=15)


# What each wrk run sends, and to which gateway: no key; a key with no per-minute limits
# (the lookup and the queue cap); a key with requests and tokens per minute as well.
MODES = {"open": "open", "key": "keys", "key+limits": "keys"}


def overhead(rounds: int, seconds: float) -> dict:
    settings = {
        "GATEWAY_PROCESSES": str(_default_processes()),
        "MAX_QUEUE_DEPTH": str(MAX_QUEUE_DEPTH),
    }
    gateways = {"open": {}, "keys": {"REQUIRE_API_KEYS": "1", "KEY_MAX_QUEUED": "1000000000"}}
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    with (
        tempfile.TemporaryDirectory(prefix="bench-auth-") as tmp,
        keyed_fleet(Path(tmp), settings, gateways) as (fleet, urls, store),
    ):
        secrets = {
            "open": None,
            "key": store.create("bench", ("jobs",)).secret,
            "key+limits": store.create("bench", ("jobs",), rpm=10**9, tpm=10**12).secret,
        }
        script = Path(tmp) / "submit.lua"

        def write_script(mode: str) -> None:
            secret = secrets[mode]
            header = f'wrk.headers["Authorization"] = "Bearer {secret}"\n' if secret else ""
            script.write_text(header + wrk_script(BODY))  # prompts no run sent

        for mode, gateway in MODES.items():  # warm-up
            write_script(mode)
            run_wrk(urls[gateway] + "/v1/jobs", script, 2, CONNECTIONS, 1)
        worker = next(p for p in fleet.processes if p.name == "worker")
        worker.signal(signal.SIGSTOP)
        try:
            for _ in range(rounds):
                for mode, gateway in MODES.items():
                    write_script(mode)
                    before, wall = _cpu_snapshot(fleet), time.monotonic()
                    wrk = run_wrk(urls[gateway] + "/v1/jobs", script, seconds, CONNECTIONS, 1)
                    wall = time.monotonic() - wall
                    cpu = _cpu_shares(before, _cpu_snapshot(fleet), wall)
                    done = wrk["requests"] - wrk["non_2xx"]
                    runs[mode].append({
                        "submits_per_s": done / (wrk["duration_us"] / 1e6),
                        "p50_ms": wrk["p50_us"] / 1000,
                        "gateway_cpu_us": cpu[gateway] * wall / max(1, done) * 1e6,
                        "redis_cpu_us": cpu["redis"] * wall / max(1, done) * 1e6,
                        "non_2xx": wrk["non_2xx"],
                    })  # fmt: skip
        finally:
            worker.signal(signal.SIGCONT)
    result: dict = {
        mode: {k: round(statistics.median(r[k] for r in rows), 1) for k in rows[0]}
        for mode, rows in runs.items()
    }
    # Each keyed run against the open run of its round, so the machine's drift cancels out.
    result["paired_ratios"] = {
        mode: [
            round(k["submits_per_s"] / o["submits_per_s"], 3)
            for o, k in zip(runs["open"], runs[mode], strict=True)
        ]
        for mode in MODES
        if mode != "open"
    }
    return result


def two_keys(idle_jobs: int) -> dict:
    settings = {"MAX_QUEUE_DEPTH": str(FLOOD_DEPTH), "MAX_BATCH_SIZE": "16"}
    with (
        tempfile.TemporaryDirectory(prefix="bench-auth-") as tmp,
        keyed_fleet(Path(tmp), settings, {"gateway": {"REQUIRE_API_KEYS": "1"}}) as (
            _fleet, urls, store,
        ),
    ):  # fmt: skip
        base = urls["gateway"]
        flooder = store.create("flooder", ("jobs",)).secret
        single = store.create("single", ("jobs",)).secret
        body = {"max_new_tokens": 8}

        def submit(http: requests.Session, secret: str, wait: bool) -> requests.Response:
            headers = {"Authorization": f"Bearer {secret}"}
            if wait:
                headers["Prefer"] = "wait=60"
            prompt = {"prompt": f"flood {uuid.uuid4().hex}"}
            return http.post(base + "/v1/jobs", json=body | prompt, headers=headers, timeout=90)

        accepted: dict[str, list[str]] = {"A": [], "B": []}
        codes: dict[str, Counter[str]] = {"A": Counter(), "B": Counter()}
        lock = threading.Lock()
        sent = iter(range(FLOOD_JOBS))
        flooding = threading.Event()
        flooding.set()

        def record(who: str, response: requests.Response) -> None:
            with lock:
                if response.status_code in (200, 202):
                    accepted[who].append(response.json()["id"])
                    codes[who][str(response.status_code)] += 1
                else:
                    codes[who][f"{response.status_code} {response.json()['error']['code']}"] += 1

        def flood_client() -> None:
            with requests.Session() as http:
                for _ in sent:
                    record("A", submit(http, flooder, wait=False))

        def single_client(latencies: list[float], until_done: threading.Event | None, n: int):
            with requests.Session() as http:
                while (until_done is not None and until_done.is_set()) or len(latencies) < n:
                    started = time.perf_counter()
                    response = submit(http, single, wait=True)
                    record("B", response)
                    if response.status_code == 200:
                        latencies.append(time.perf_counter() - started)

        busy: list[float] = []
        started = time.monotonic()
        b = threading.Thread(target=single_client, args=(busy, flooding, 5))
        b.start()
        clients = [threading.Thread(target=flood_client) for _ in range(FLOOD_CLIENTS)]
        for client in clients:
            client.start()
        for client in clients:
            client.join()
        flood_s = time.monotonic() - started
        flooding.clear()
        b.join()
        progress(f"flood sent in {flood_s:.1f} s; waiting for every accepted job to end")
        ended: Counter[str] = Counter()
        with requests.Session() as http:
            http.headers["Authorization"] = f"Bearer {flooder}"
            deadline = time.monotonic() + 600
            for who, secret in (("A", flooder), ("B", single)):
                http.headers["Authorization"] = f"Bearer {secret}"
                for job_id in accepted[who]:
                    while True:
                        status = http.get(f"{base}/v1/jobs/{job_id}", timeout=30).json()["status"]
                        if status in TERMINAL or time.monotonic() > deadline:
                            break
                        time.sleep(0.2)
                    ended[status] += 1
        in_flood = {who: len(ids) for who, ids in accepted.items()}
        flood_codes = {who: dict(c) for who, c in codes.items()}
        idle: list[float] = []
        single_client(idle, None, idle_jobs)
    return {
        "flood_s": round(flood_s, 1),
        "accepted": in_flood,
        "codes": flood_codes,
        "ended": dict(ended),
        "lost": sum(in_flood.values())
        - sum(n for status, n in ended.items() if status in TERMINAL),
        "b_busy_s": {"p50": statistics.median(busy), "p99": percentile(busy, 99), "n": len(busy)},
        "b_idle_s": {"p50": statistics.median(idle), "p99": percentile(idle, 99), "n": len(idle)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.auth", description=__doc__)
    parser.add_argument("--rounds", type=int, default=6, help="overhead: rounds")
    parser.add_argument("--seconds", type=float, default=6, help="overhead: one wrk run")
    parser.add_argument("--idle-jobs", type=int, default=20, help="key B alone: jobs")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write results here")
    args = parser.parse_args(argv)
    progress("overhead of keys and limits on the submit path")
    cost = overhead(args.rounds, args.seconds)
    print(
        f"Submit path: POST /v1/jobs under wrk (c={CONNECTIONS}, worker paused), "
        f"{args.rounds} rounds of {args.seconds:g} s a gateway, one fleet (medians):"
    )
    for mode in MODES:
        row = cost[mode]
        print(
            f"  {mode:<10}: {row['submits_per_s']:7.0f} submits/s  p50 {row['p50_ms']:5.1f} ms  "
            f"gateway {row['gateway_cpu_us']:5.0f} us  Redis {row['redis_cpu_us']:4.0f} us CPU "
            f"a submit  non-2xx {row['non_2xx']:.0f}"
        )
    open_ = cost["open"]
    for mode, ratios in cost["paired_ratios"].items():
        row = cost[mode]
        print(
            f"  {mode} vs no key: {statistics.median(ratios):.3f}x submits/s (rounds: {ratios}), "
            f"{row['gateway_cpu_us'] - open_['gateway_cpu_us']:+.0f} us gateway and "
            f"{row['redis_cpu_us'] - open_['redis_cpu_us']:+.0f} us Redis CPU a submit"
        )
    progress("two keys: A floods, B submits single jobs")
    flood = two_keys(args.idle_jobs)
    print(
        f"Two keys (MAX_QUEUE_DEPTH {FLOOD_DEPTH}, KEY_MAX_QUEUED {FLOOD_DEPTH // 4}): A sent "
        f"{FLOOD_JOBS} jobs from {FLOOD_CLIENTS} clients in {flood['flood_s']} s"
    )
    print(f"  A: {flood['accepted']['A']} accepted, answers {flood['codes']['A']}")
    print(f"  B: {flood['accepted']['B']} accepted, answers {flood['codes']['B']}")
    busy, idle = flood["b_busy_s"], flood["b_idle_s"]
    print(
        f"  B's latency during the flood: p50 {busy['p50']:.2f} s, p99 {busy['p99']:.2f} s "
        f"({busy['n']} jobs); on the idle fleet: p50 {idle['p50']:.2f} s, p99 "
        f"{idle['p99']:.2f} s ({idle['n']} jobs)"
    )
    print(f"  accepted jobs ended: {flood['ended']}; lost: {flood['lost']}")
    if args.json:
        args.json.write_text(json.dumps({"overhead": cost, "two_keys": flood}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
