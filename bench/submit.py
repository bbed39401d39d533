"""``python -m bench.submit``: how many submits per second the gateway takes.

A fresh fleet per run (its own redis-server on a free loopback port, one worker, the
gateway under gunicorn), MAX_QUEUE_DEPTH high enough that nothing is refused, then ``wrk``
POSTs 1-token greedy jobs (``{"prompt": "hi <n>", "max_new_tokens": 1}``, every prompt
new, so that none is answered from the result cache where it is on) over keep-alive
connections for a fixed time after a short untimed warm-up. Reported: submits/s, p50/p99
latency, non-2xx answers, and the CPU each process used (the machine's cores are shared by
the load generator, the gateway, Redis and the worker, which runs the jobs meanwhile).

``--source DIR`` (repeatable) runs the gateway and the worker from another checkout, so a
before/after comparison is made in one run on one machine:
``python -m bench.submit --source /tmp/before --source .``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import requests

from bench.fleet import LOG_ERROR, READY_TIMEOUT_S, RunningFleet, _answers, _env, start_redis
from fleet import commands
from fleet.processes import Process, free_port, wait_until

BODY = '{"prompt": "hi %d-%d", "max_new_tokens": 1}'  # wrk thread, request: all new
MAX_QUEUE_DEPTH = 100_000_000  # far above what a run submits: no 429
NOISY_CORES = 0.1  # other processes using more than this: the run is flagged
WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local threads = {}
function setup(thread) table.insert(threads, thread); thread:set("id", #threads) end
function init(args) non2xx = 0; sent = 0 end
function request()
  sent = sent + 1
  return wrk.format(nil, nil, nil, string.format('$BODY', id, sent))
end
function response(status, headers, body)
  if status < 200 or status > 299 then non2xx = non2xx + 1 end
end
function done(summary, latency, requests)
  local bad = 0
  for _, t in ipairs(threads) do bad = bad + t:get("non2xx") end
  local e = summary.errors
  io.write(string.format('WRK {"requests": %d, "duration_us": %d, "non_2xx": %d, '
    .. '"socket_errors": %d, "timeouts": %d, "p50_us": %d, "p90_us": %d, '
    .. '"p99_us": %d, "max_us": %d}\\n',
    summary.requests, summary.duration, bad, e.connect + e.read + e.write, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max))
end
"""


def wrk_script(body: str = BODY) -> str:
    """The wrk script that POSTs ``body`` (a format of the thread and request numbers).
    Each script has its own tag in the prompts: no two runs send the same one."""
    return WRK_SCRIPT.replace("$BODY", body.replace("%d-%d", f"{uuid.uuid4().hex[:8]}-%d-%d"))


@dataclass(frozen=True)
class RunResult:
    source: str
    settings: dict[str, str]
    connections: int
    requests: int
    duration_s: float
    submits_per_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    non_2xx: int
    socket_errors: int
    timeouts: int
    gateway_cpu_us_per_submit: float  # what one submit costs the gateway, however busy
    cpu_cores: dict[str, float] = field(default_factory=dict)  # CPU s / wall s, per process
    log_problems: list[str] = field(default_factory=list)


def progress(message: str) -> None:
    print(f"[bench.submit] {message}", file=sys.stderr, flush=True)


def _from_source(argv: list[str], source: Path) -> list[str]:
    """Run ``argv`` in ``source``: cwd there (``python -m`` puts the cwd first on sys.path)
    and paths under this checkout rewritten to that one."""
    root = str(commands.ROOT)
    moved = [str(source) + a[len(root) :] if a.startswith(root + os.sep) else a for a in argv]
    return ["env", "-C", str(source), *moved]


@contextmanager
def submit_fleet(source: Path, settings: dict[str, str], logs: Path) -> Iterator[RunningFleet]:
    """redis-server, one worker and the gateway from ``source``; all stopped on the way out."""
    procs: list[Process] = []
    try:
        redis_url = start_redis(procs, logs / "redis-data", logs)
        port = free_port()
        # No worker /metrics port: it would listen on every interface, and clash with a fleet
        # already running here.
        own = {"PYTHONPATH": str(source), "WORKER_METRICS_PORT": "0"}
        env = _env(redis_url, port, {**settings, **own})
        name = f"{env['KEY_PREFIX']}@localhost"
        worker = _from_source(commands.worker(name, "warning"), source)
        procs.append(Process("worker", worker, env, logs / "worker.log"))
        gateway = _from_source(commands.gateway(), source)
        procs.append(Process("gateway", gateway, env, logs / "gateway.log"))
        base = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            return requests.get(base + "/readyz", timeout=2).status_code == 200

        wait_until(lambda: _answers(ready), READY_TIMEOUT_S, "fleet not ready", *procs)
        yield RunningFleet(base, procs)
    finally:
        for proc in reversed(procs):
            proc.stop(timeout_s=15)


def _cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of a process and of each of its descendants, by pid."""
    out = {}
    try:
        root = psutil.Process(pid)
        for proc in [root, *root.children(recursive=True)]:
            times = proc.cpu_times()
            out[str(proc.pid)] = times.user + times.system
    except psutil.NoSuchProcess:
        pass
    return out


def _cpu_snapshot(fleet: RunningFleet) -> dict[str, dict[str, float]]:
    return {proc.name: _cpu_s(proc.pid) for proc in fleet.processes}


def _cpu_shares(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], wall_s: float
) -> dict[str, float]:
    """Cores each process used meanwhile; the gateway split into master and workers."""
    shares: dict[str, float] = {}
    for name, pids in after.items():
        used = {pid: s - before.get(name, {}).get(pid, 0.0) for pid, s in pids.items()}
        shares[name] = sum(used.values()) / wall_s
        if name == "gateway" and len(used) > 1:
            for i, pid in enumerate(sorted(used, key=int)):
                label = "gateway master" if i == 0 else f"gateway worker {i}"
                shares[label] = used[pid] / wall_s
    return shares


def _machine_busy_s() -> float:
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _renice(pid: int, nice: int) -> None:
    """Lower a process's CPU priority. Under Linux's autogroups (each session a group, and
    every fleet process has its own session) nice only ranks threads within a group, so
    the group's nice is set too."""
    os.setpriority(os.PRIO_PGRP, pid, nice)
    autogroup = Path(f"/proc/{pid}/autogroup")
    if autogroup.exists():
        autogroup.write_text(str(nice))


def run_wrk(url: str, script: Path, seconds: float, connections: int, threads: int) -> dict:
    argv = [
        "wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds:g}s", "--timeout", "10s",
        "-s", str(script), url,
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("WRK ")), None)
    if done.returncode or line is None:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stdout}{done.stderr}")
    return json.loads(line[4:])


def measure(
    source: Path, settings: dict[str, str], args: argparse.Namespace, logs: Path
) -> RunResult:
    progress(f"{source}: starting a fleet ({settings})")
    with submit_fleet(source, settings, logs) as fleet:
        url = fleet.base_url + "/v1/jobs"
        headers = {"Content-Type": "application/json"}
        check = requests.post(url, data=BODY % (0, 0), headers=headers, timeout=30)
        if check.status_code != 202:
            raise RuntimeError(f"submit answered {check.status_code}: {check.text[:300]}")
        script = logs / "submit.lua"
        script.write_text(wrk_script())
        progress(f"warm-up {args.warmup:g} s, then {args.seconds:g} s at c={args.connections}")
        run_wrk(url, script, args.warmup, args.connections, args.wrk_threads)
        worker = next(p for p in fleet.processes if p.name == "worker")
        if args.worker_nice is not None:
            _renice(worker.pid, args.worker_nice)
        if args.pause_worker:
            worker.signal(signal.SIGSTOP)
        try:
            cpu_before, busy, wall = _cpu_snapshot(fleet), _machine_busy_s(), time.monotonic()
            own = resource.getrusage(resource.RUSAGE_CHILDREN)
            wrk = run_wrk(url, script, args.seconds, args.connections, args.wrk_threads)
            own_after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu_after, wall = _cpu_snapshot(fleet), time.monotonic() - wall
            busy = _machine_busy_s() - busy
        finally:
            if args.pause_worker:
                worker.signal(signal.SIGCONT)
        cpu = _cpu_shares(cpu_before, cpu_after, wall)
        wrk_s = own_after.ru_utime + own_after.ru_stime - own.ru_utime - own.ru_stime
        cpu["wrk"] = wrk_s / wall  # the only child reaped meanwhile
        ours = sum(v for k, v in cpu.items() if not k.startswith("gateway "))
        cpu["others"] = max(0.0, busy / wall - ours)  # processes not of this run
        problems = fleet.problems()
    seconds = wrk["duration_us"] / 1e6
    return RunResult(
        source=str(source),
        settings=settings,
        connections=args.connections,
        requests=wrk["requests"],
        duration_s=seconds,
        submits_per_s=(wrk["requests"] - wrk["non_2xx"]) / seconds,
        p50_ms=wrk["p50_us"] / 1000,
        p90_ms=wrk["p90_us"] / 1000,
        p99_ms=wrk["p99_us"] / 1000,
        max_ms=wrk["max_us"] / 1000,
        non_2xx=wrk["non_2xx"],
        socket_errors=wrk["socket_errors"],
        timeouts=wrk["timeouts"],
        gateway_cpu_us_per_submit=cpu["gateway"] * wall / max(1, wrk["requests"]) * 1e6,
        cpu_cores={k: round(v, 3) for k, v in cpu.items()},
        log_problems=problems,
    )


def report(results: list[RunResult], worker: str) -> str:
    lines = [
        f"Gateway submits: POST /v1/jobs {BODY}, wrk keep-alive, {os.cpu_count()} CPUs, "
        f"1 worker ({worker})",
        f"{'source':<24} {'procs':>5} {'conns':>5} {'requests':>8} {'submits/s':>9} "
        f"{'p50 ms':>7} {'p99 ms':>7} {'non-2xx':>7} {'sock err':>8} {'gw us/req':>9}  "
        "CPU cores used",
    ]
    for r in results:
        cpu = ", ".join(f"{k} {v:.2f}" for k, v in r.cpu_cores.items() if "gateway " not in k)
        lines.append(
            f"{r.source[-24:]:<24} {r.settings['GATEWAY_PROCESSES']:>5} {r.connections:>5} "
            f"{r.requests:>8} {r.submits_per_s:>9.0f} {r.p50_ms:>7.1f} {r.p99_ms:>7.1f} "
            f"{r.non_2xx:>7} {r.socket_errors + r.timeouts:>8} "
            f"{r.gateway_cpu_us_per_submit:>9.0f}  {cpu}"
        )
    medians: dict[tuple[str, str], float] = {}
    for r in results:
        key = (r.source, r.settings["GATEWAY_PROCESSES"])
        same = [
            x.submits_per_s for x in results if (x.source, x.settings["GATEWAY_PROCESSES"]) == key
        ]
        medians[key] = statistics.median(same)
    first = results[0]
    for (source, procs), rate in medians.items():
        base = medians.get((first.source, procs))
        if base and source != first.source:
            lines.append(
                f"{source} vs {first.source}, {procs} processes: {rate / base:.2f}x submits/s"
                " (medians)"
            )
    extra = {k: v for k, v in first.settings.items() if k != "GATEWAY_PROCESSES"}
    lines.append("settings: " + ", ".join(f"{k}={v}" for k, v in extra.items()))
    for r in results:
        errors = [line for line in r.log_problems if LOG_ERROR.search(line)]
        lines += [f"  {r.source}: {line}" for line in errors[:5]]
        if r.cpu_cores["others"] > NOISY_CORES:
            lines.append(
                f"WARNING: other processes used {r.cpu_cores['others']:.2f} cores during the "
                f"run of {r.source}; its numbers are not reliable."
            )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.submit", description=__doc__)
    parser.add_argument(
        "--source", type=Path, action="append", metavar="DIR",
        help="checkout to run the gateway and worker from (repeatable; default: this one)",
    )  # fmt: skip
    parser.add_argument(
        "--gateway-processes", type=int, nargs="+", metavar="N",
        help="GATEWAY_PROCESSES, one run each (default: the fleet's default)",
    )  # fmt: skip
    parser.add_argument("--seconds", type=float, default=15, help="measured run (default 15)")
    parser.add_argument("--warmup", type=float, default=3, help="untimed run first (default 3)")
    parser.add_argument(
        "--rounds", type=int, default=1, help="run every source and setting this many times"
    )
    parser.add_argument("--connections", type=int, default=64, help="concurrency (default 64)")
    parser.add_argument("--wrk-threads", type=int, default=1, help="wrk threads (default 1)")
    parser.add_argument(
        "--gunicorn-args", metavar="ARGS", help="GUNICORN_CMD_ARGS, e.g. '--worker-connections 500'"
    )
    parser.add_argument(
        "--pause-worker", action="store_true",
        help="SIGSTOP the worker while measuring: the gateway without it competing for CPU",
    )  # fmt: skip
    parser.add_argument(
        "--worker-nice", type=int, metavar="N",
        help="run the worker at nice N (e.g. 19: the gateway first, the worker gets the rest)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write results here")
    parser.add_argument("--logs", type=Path, metavar="DIR", help="keep the process logs here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if shutil.which("wrk") is None:
        sys.exit("wrk is missing: apt-get install wrk (make bench installs it)")
    sources = [s.resolve() for s in args.source or [commands.ROOT]]
    for source in sources:
        if not (source / "gateway/gunicorn_conf.py").is_file():
            sys.exit(f"{source} is not a checkout of this project (no gateway/gunicorn_conf.py)")
    settings = {"MAX_QUEUE_DEPTH": str(MAX_QUEUE_DEPTH)}
    if args.gunicorn_args:
        settings["GUNICORN_CMD_ARGS"] = args.gunicorn_args
    results = []
    plan = [(s, p) for s in sources for p in args.gateway_processes or [_default_processes()]]
    with tempfile.TemporaryDirectory(prefix="bench-submit-") as tmp:
        for round_ in range(args.rounds):  # interleaved, so a drifting machine hits all alike
            for i, (source, processes) in enumerate(plan):
                run = {"GATEWAY_PROCESSES": str(processes), **settings}
                logs = (args.logs or Path(tmp)) / f"run{round_}-{i}"
                results.append(measure(source, run, args, logs))
    worker = "running"
    if args.pause_worker:
        worker = "paused while measured"
    elif args.worker_nice is not None:
        worker = f"at nice {args.worker_nice}"
    print(report(results, worker))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "body": json.loads(BODY % (1, 1)),
            "cpus": os.cpu_count(),
            "paused_worker": args.pause_worker,
            "worker_nice": args.worker_nice,
            "runs": [asdict(r) for r in results],
        }
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    bad = any(r.non_2xx or r.socket_errors or r.timeouts for r in results)
    return 1 if bad else 0


def _default_processes() -> int:
    """GATEWAY_PROCESSES as the gateway would read it: the environment, else the default."""
    from shared.settings import Settings

    return int(
        os.environ.get("GATEWAY_PROCESSES") or Settings.model_fields["gateway_processes"].default
    )


if __name__ == "__main__":
    sys.exit(main())
