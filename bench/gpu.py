"""``python -m bench.gpu --out result.json [--tiny]``: Qwen3.5-9B AWQ on one GPU, three ways.

One command, offline, within 8 minutes, one JSON:

1. builds a random-weight AWQ 4-bit checkpoint with Qwen3.5-9B's real shapes
   (:mod:`bench.random_awq`: seconds, no hub, no calibration);
2. measures bare vLLM (``LLMEngine`` in .venv-vllm, :mod:`bench.bare_vllm`), the fleet with
   ENGINE=vllm and the fleet with ENGINE=transformers, each loaded once: generated tok/s at
   1, 16 and 64 closed-loop clients, time to first token (p50, p99) and latency of every
   job, and the GPU's memory in use after the load and at its peak (NVML, sampled). Fleet
   clients stream (``"stream": true``), which is how a client sees its first token; bare
   vLLM's first token is the engine step that produced it;
3. writes the JSON (also the part measured so far if the 8 minutes run out, or what was
   missing if it could not start) and prints a summary.

``--tiny`` runs the same on a tiny shape of the same structure, on CPU or GPU, to prove the
script end to end where no GPU is.

What the machine needs (checked first; exit status 2 and a list of what is missing):

* an NVIDIA GPU that ``nvidia-smi`` lists (not for --tiny);
* ``redis-server`` on PATH (the fleet's queue);
* ``.venv`` in this checkout with requirements.txt installed and CUDA torch (``make install``):
  torch, transformers, gptqmodel (the transformers engine's AWQ kernels), celery, redis,
  flask, gunicorn, requests, nvidia-ml-py;
* ``.venv-vllm`` with requirements-vllm.txt (``make vllm-env``: vllm 0.33.0, CUDA torch);
* about 9 GB of free disk for the checkpoint (under ``--workdir``, default the temp dir).

This workplace's H200 machine has none of the fleet's packages (its image holds torch
2.11, transformers 5.17 and no vllm, gptqmodel, celery or redis-server), cannot reach a
package registry, and takes 64 MiB of carried files, far less than torch or vllm. So run
it on an image made with ``make install vllm-env redis-server`` on an x86-64 CUDA machine,
or on a GPU machine with network access: ``make install vllm-env redis-server && .venv/bin/
python -m bench.gpu --out result.json``. Started with another Python (``python3 -m
bench.gpu``), it checks the machine, then runs itself again with .venv's Python.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.protocol import JobInput

ROOT = Path(__file__).resolve().parent.parent
VENV_PY, VLLM_PY = ROOT / ".venv" / "bin" / "python", ROOT / ".venv-vllm" / "bin" / "python"
CHECKED = "BENCH_GPU_CHECKED"  # set when this re-runs itself under .venv's Python
STARTED = "BENCH_GPU_STARTED"  # and when it started: the 8 minutes count from there
NEEDS = {  # the modules each environment must import
    VENV_PY: ["torch", "transformers", "gptqmodel", "celery", "redis", "flask", "gunicorn",
              "requests", "safetensors", "numpy", "pynvml"],
    VLLM_PY: ["torch", "vllm", "transformers", "celery", "redis"],
}  # fmt: skip
PROBE = """
import importlib.metadata as m, importlib.util as u, json, sys
dists = m.packages_distributions()
out = {}
for name in sys.argv[1:]:
    found = u.find_spec(name) is not None
    out[name] = found and ",".join(f"{d} {m.version(d)}" for d in dists.get(name, [])) or found
import torch
out["cuda"] = torch.cuda.is_available()
print(json.dumps(out))
"""


@dataclass(frozen=True)
class Plan:
    tiny: bool
    prompt_words: int  # ~ prompt tokens: the demo tokenizer has a token per corpus word
    new_tokens: int  # max_new_tokens of every job; EOS never wins, so each runs to it
    levels: tuple[tuple[int, int], ...]  # (clients, jobs)
    max_model_len: int
    deadline_s: float


GPU = Plan(False, 256, 128, ((1, 4), (16, 32), (64, 128)), 4096, 480)
TINY = Plan(True, 32, 16, ((1, 3), (16, 16), (64, 64)), 1024, 600)
MAX_BATCH_SIZE = 64  # = the most clients: every level fits one batch / max_num_seqs
RESERVE_S = 20  # kept back from the deadline to stop the fleet and write the JSON
state: dict[str, Any] = {}  # the JSON, filled as the run goes; the watchdog writes it too


def progress(message: str) -> None:
    elapsed = time.monotonic() - state.get("_began", time.monotonic())
    print(f"[bench.gpu {elapsed:5.0f}s] {message}", file=sys.stderr, flush=True)


# --- preflight: stdlib only, any Python ----------------------------------------------------
def preflight(plan: Plan, workdir: Path) -> tuple[list[str], dict[str, Any]]:
    """What is missing for ``plan`` on this machine, and the versions found."""
    missing, found = [], {}
    if not plan.tiny and not _nvidia_smi():
        missing.append("an NVIDIA GPU: nvidia-smi lists none")
    if shutil.which("redis-server") is None:
        missing.append("redis-server on PATH (make redis-server)")
    for python, names in NEEDS.items():
        label = python.parent.parent.name
        if not python.exists():
            missing.append(f"{label}: {python} does not exist (make install vllm-env)")
            continue
        argv = [str(python), "-c", PROBE, *names]
        try:
            probe = subprocess.run(argv, capture_output=True, text=True, timeout=180)
            versions = json.loads(probe.stdout.strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as exc:
            missing.append(f"{label}: its Python could not import torch ({str(exc)[-300:]})")
            continue
        found[label] = versions
        absent = [name for name in names if not versions.get(name)]
        if absent:
            missing.append(f"{label}: packages {', '.join(absent)}")
        if not plan.tiny and not versions.get("cuda"):
            missing.append(f"{label}: its torch sees no CUDA GPU")
    free_gb = shutil.disk_usage(workdir).free / 1e9
    if not plan.tiny and free_gb < 12:
        missing.append(f"~12 GB free disk under {workdir} (has {free_gb:.1f} GB)")
    return missing, found


def _nvidia_smi() -> dict[str, str] | None:
    query = "--query-gpu=name,driver_version,memory.total"
    try:
        out = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True
        )
    except FileNotFoundError:
        return None
    if out.returncode or not out.stdout.strip():
        return None
    name, driver, memory = (v.strip() for v in out.stdout.splitlines()[0].split(","))
    return {"name": name, "driver": driver, "memory_total": memory}


def write(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    public = {k: v for k, v in state.items() if not k.startswith("_")}
    path.write_text(json.dumps(public, indent=2) + "\n")


# --- measuring: .venv ------------------------------------------------------------------------
class GpuMemory:
    """Device memory in use (NVML), sampled in a thread: one engine runs at a time, so the
    device's use is that engine's. vLLM takes VLLM_GPU_MEMORY_UTILIZATION of the card up
    front (weights + KV cache); the transformers engine grows as it runs."""

    def __init__(self) -> None:
        self.peak, self._stop, self._nvml = 0, threading.Event(), None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # no GPU or no NVML: memory is reported as null
            self._nvml = None

    def used_gib(self) -> float | None:
        if self._nvml is None:
            return None
        return round(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used / 2**30, 2)

    def __enter__(self) -> GpuMemory:
        self.peak = 0
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while self._nvml is not None and not self._stop.wait(0.25):
            self.peak = max(self.peak, self.used_gib() or 0)

    def peak_gib(self) -> float | None:
        return self.peak if self._nvml is not None else None


def job(plan: Plan, index: int, new_tokens: int | None = None) -> JobInput:
    """Job ``index``: distinct corpus words as its prompt, greedy, ``new_tokens``."""
    from shared.protocol import JobInput
    from workers.demo_model import corpus

    words = " ".join(corpus(plan.prompt_words // 6 + 1, seed=1000 + index)).split()
    prompt = " ".join(words[: plan.prompt_words])
    tokens = new_tokens or plan.new_tokens
    return JobInput(prompt=prompt, max_new_tokens=tokens, temperature=0.0)


def level(
    clients: int, samples: list[dict[str, float]], errors: list[str], wall: float
) -> dict[str, Any]:
    """One level's numbers from its jobs' tokens, first-token times and latencies."""
    from bench.fleet import percentile

    tokens = sum(int(s["tokens"]) for s in samples)
    ttft = [s["ttft_s"] for s in samples]
    latency = [s["latency_s"] for s in samples]
    return {
        "clients": clients,
        "jobs": len(samples),
        "errors": len(errors),
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "ttft_p50_s": round(percentile(ttft, 50), 4) if ttft else None,
        "ttft_p99_s": round(percentile(ttft, 99), 4) if ttft else None,
        "latency_p50_s": round(percentile(latency, 50), 3) if latency else None,
        "first_error": errors[0] if errors else None,
    }


def stream_job(http, base_url: str, body: dict[str, Any]) -> dict[str, float]:
    """One streamed job: seconds to its first ``token`` event and to ``done``, and tokens."""
    from bench import streaming

    began = time.perf_counter()
    first, done = streaming.stream_job(http, base_url, body, timeout_s=300)
    tokens = done["output"]["usage"]["completion_tokens"]
    return {"ttft_s": first, "latency_s": time.perf_counter() - began, "tokens": tokens}


def vllm_env(plan: Plan) -> dict[str, str]:
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return env | ({"VLLM_CPU_KVCACHE_SPACE": "1"} if plan.tiny else {})


def measure_bare(plan: Plan, model: Path, left_s: float) -> dict[str, Any]:
    from bench import bare_vllm

    device = "cuda" if _nvidia_smi() else "cpu"
    runs = [
        {
            "name": f"c{clients}",
            "mode": "clients",
            "clients": clients,
            "requests": [job(plan, i).model_dump(exclude_none=True) for i in range(jobs)],
        }
        for clients, jobs in plan.levels
    ]
    spec = {
        "model": str(model),
        "device": device,
        "max_num_seqs": MAX_BATCH_SIZE,
        "max_model_len": plan.max_model_len,
        "runs": runs,
    }  # the fleet's worker gets the same through MAX_BATCH_SIZE and VLLM_MAX_MODEL_LEN
    with GpuMemory() as memory:
        began = time.monotonic()
        out = bare_vllm.start(spec, vllm_env(plan), timeout_s=left_s)
    levels = []
    for clients, jobs in plan.levels:
        measured = out["runs"][f"c{clients}"]
        levels.append(
            level(clients, measured["requests"], [], measured["wall_s"])
            | {"prompt_tokens_mean": round(measured["prompt_tokens"] / jobs, 1)}
        )
    used = out.get("gpu_memory_used_bytes_after_load")
    return {
        "process_s": round(time.monotonic() - began, 1),
        "load_s": round(out["load_s"], 1),
        "gpu_memory_after_load_gib": round(used / 2**30, 2) if used else None,
        "gpu_memory_peak_gib": memory.peak_gib(),
        "levels": levels,
    }


def fleet_level(plan: Plan, base_url: str, clients: int, jobs: int) -> dict[str, Any]:
    """``clients`` closed-loop streaming clients share ``jobs`` jobs."""
    from bench.fleet import closed_loop

    bodies = [job(plan, i).model_dump(exclude_none=True) for i in range(jobs)]
    samples, errors, wall = closed_loop(
        clients, jobs, lambda http, i: stream_job(http, base_url, bodies[i])
    )
    return level(clients, samples, errors, wall)


def measure_fleet(
    plan: Plan, engine: str, model: Path, deadline: float, logs: Path | None
) -> dict[str, Any]:
    from bench.engines import log_problems
    from bench.fleet import closed_loop, running_fleet

    settings = {
        "MODEL": str(model),
        "MAX_BATCH_SIZE": str(MAX_BATCH_SIZE),
        "MAX_QUEUE_DEPTH": "100000",
        "VLLM_MAX_MODEL_LEN": str(plan.max_model_len),
    } | (vllm_env(plan) if engine == "vllm" else {})
    result: dict[str, Any] = {"levels": []}
    state["engines"][f"fleet_{engine}"] = result
    with GpuMemory() as memory:
        began = time.monotonic()
        with running_fleet(settings, logs / engine if logs else None, engine=engine) as fleet:
            base = fleet.base_url
            result["start_s"] = round(time.monotonic() - began, 1)
            result["gpu_memory_after_load_gib"] = memory.used_gib()
            progress(f"fleet {engine} ready in {result['start_s']} s; warming up")
            # untimed: a full batch ending one step apart (each batch size runs once)
            warm = [
                job(plan, i, i + 1).model_dump(exclude_none=True) for i in range(MAX_BATCH_SIZE)
            ]
            closed_loop(len(warm), len(warm), lambda http, i: stream_job(http, base, warm[i]))
            for clients, jobs in plan.levels:
                if time.monotonic() > deadline:
                    result["skipped"] = f"from {clients} clients on: out of time"
                    break
                result["levels"].append(fleet_level(plan, base, clients, jobs))
                progress(f"fleet {engine}: {clients} clients, {result['levels'][-1]}")
            result["log_problems"] = log_problems(fleet.problems(limit=200))[:20]
    result["gpu_memory_peak_gib"] = memory.peak_gib()
    return result


def ratios() -> dict[str, float]:
    engines = state["engines"]

    def rates(name: str) -> dict[int, float]:
        levels = engines.get(name, {}).get("levels", [])
        return {lv["clients"]: lv["tokens_per_s"] for lv in levels if lv["tokens_per_s"]}

    bare, vllm, tf = rates("bare_vllm"), rates("fleet_vllm"), rates("fleet_transformers")
    out = {}
    for c in sorted(vllm):
        if c in bare:
            out[f"c{c}_fleet_vllm_over_bare_vllm"] = round(vllm[c] / bare[c], 3)
        if c in tf:
            out[f"c{c}_fleet_vllm_over_fleet_transformers"] = round(vllm[c] / tf[c], 3)
    return out


def run(plan: Plan, out: Path, workdir: Path, logs: Path | None) -> None:
    """Build the checkpoint, then each engine in turn; an engine that fails is recorded
    with its error and the next one still runs."""
    from bench import random_awq

    deadline = state["_began"] + plan.deadline_s - RESERVE_S
    model = workdir / ("qwen3.5-tiny-random-awq" if plan.tiny else "qwen3.5-9b-random-awq")
    progress(f"building the random AWQ checkpoint in {model}")
    shape = random_awq.TINY if plan.tiny else random_awq.QWEN35_9B
    state["checkpoint"] = random_awq.build(model, shape) | {"shape": shape}
    progress(f"checkpoint: {state['checkpoint']['bytes'] / 1e9:.2f} GB")
    phases = {
        "bare_vllm": lambda: measure_bare(plan, model, deadline - time.monotonic()),
        "fleet_vllm": lambda: measure_fleet(plan, "vllm", model, deadline, logs),
        "fleet_transformers": lambda: measure_fleet(plan, "transformers", model, deadline, logs),
    }
    for name, measure in phases.items():
        if time.monotonic() > deadline - 60:
            state["engines"][name] = {"skipped": "out of time"}
            continue
        progress(name)
        try:
            state["engines"][name] = measure()
        except Exception as exc:  # recorded; the other engines still run
            state["engines"].setdefault(name, {})["error"] = f"{type(exc).__name__}: {exc}"
            progress(f"{name} failed: {exc}")
        state["ratios"] = ratios()
        write(out)


def summary() -> str:
    lines = [f"{'engine':<20} {'clients':>7} {'tok/s':>8} {'ttft p50':>9} {'ttft p99':>9}"]
    for name, result in state.get("engines", {}).items():
        for lv in result.get("levels", []):
            lines.append(
                f"{name:<20} {lv['clients']:>7} {lv['tokens_per_s']:>8.1f} "
                f"{lv['ttft_p50_s'] or 0:>9.4f} {lv['ttft_p99_s'] or 0:>9.4f}"
            )
        memory = (result.get("gpu_memory_after_load_gib"), result.get("gpu_memory_peak_gib"))
        lines.append(f"{name:<20} GPU memory GiB after load / peak: {memory[0]} / {memory[1]}")
    lines += [f"  {k}: {v}" for k, v in state.get("ratios", {}).items()]
    return "\n".join(lines)


def check_machine(plan: Plan, out: Path, workdir: Path | None) -> int:
    """Stop (2) if the machine lacks something; else go on, under .venv's Python."""
    import tempfile

    missing, found = preflight(plan, workdir or Path(tempfile.gettempdir()))
    state.update(software=found, gpu=_nvidia_smi())
    if missing:
        state["error"] = {"missing": missing, "needs": __doc__.split("What the")[1]}
        write(out)
        print("bench.gpu cannot run here; missing:", file=sys.stderr)
        print("\n".join(f"  - {m}" for m in missing), file=sys.stderr)
        return 2
    if Path(sys.prefix).resolve() != VENV_PY.parent.parent.resolve():
        os.chdir(ROOT)
        os.environ[CHECKED] = json.dumps(found)
        os.environ[STARTED] = str(time.time() - (time.monotonic() - state["_began"]))
        os.execv(VENV_PY, [str(VENV_PY), "-m", "bench.gpu", *sys.argv[1:]])
    return 0


def main(argv: list[str] | None = None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="the JSON to write")
    parser.add_argument("--tiny", action="store_true", help="tiny shape, same structure")
    parser.add_argument("--workdir", type=Path, help="where the checkpoint goes (then deleted)")
    parser.add_argument("--logs", type=Path, help="keep the fleets' process logs here")
    args = parser.parse_args(argv)
    plan = TINY if args.tiny else GPU
    out = args.out.resolve()
    began = time.monotonic() - (time.time() - float(os.environ.get(STARTED, time.time())))
    state.update(_began=began, plan=asdict(plan), engines={})
    if os.environ.get(CHECKED):  # checked by the Python that started this one
        state.update(software=json.loads(os.environ[CHECKED]), gpu=_nvidia_smi())
    elif code := check_machine(plan, out, args.workdir):
        return code
    left_s = plan.deadline_s - (time.monotonic() - state["_began"])
    watchdog = threading.Timer(left_s, _out_of_time, args=(out,))
    watchdog.daemon = True
    watchdog.start()
    workdir = Path(tempfile.mkdtemp(prefix="bench-gpu-", dir=args.workdir))
    state["_workdir"] = workdir
    try:
        run(plan, out, workdir, args.logs and args.logs.resolve())
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    watchdog.cancel()
    state["elapsed_s"] = round(time.monotonic() - state["_began"], 1)
    state["within_deadline"] = state["elapsed_s"] <= plan.deadline_s
    write(out)
    print(summary())
    print(f"({state['elapsed_s']} s in all; JSON: {out})")
    failed = any("error" in e or "skipped" in e for e in state["engines"].values())
    return 1 if failed else 0


def _out_of_time(out: Path) -> None:
    """The deadline passed mid-measurement: write what was measured and stop at once (the
    fleet's processes and bare vLLM die with this process)."""
    state["elapsed_s"] = round(time.monotonic() - state["_began"], 1)
    state["error"] = {"timed_out": "the deadline passed; the JSON holds what was measured"}
    write(out)
    print(summary(), file=sys.stderr)
    shutil.rmtree(state["_workdir"], ignore_errors=True)
    os._exit(3)


if __name__ == "__main__":
    sys.exit(main())
