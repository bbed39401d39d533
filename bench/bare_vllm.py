"""Bare vLLM on the fleet's requests: ``LLM`` in this process, no queue, no HTTP.

The ceiling the fleet's vLLM engine is compared with. It runs in .venv-vllm (vLLM pins its
own torch and transformers), so the benchmarks, which run in .venv, start it as a
subprocess: ``.venv-vllm/bin/python -m bench.bare_vllm SPEC.json OUT.json``, which
:func:`start` runs.

The engine is built with the arguments the worker's (:class:`workers.vllm_engine.VllmEngine`)
uses, and prompts become token ids and sampling parameters through the worker's own
functions, so both sides run the same requests. A spec names its runs:

* ``generate``: ``LLM.generate`` on all the requests at once; ``max_num_seqs`` bounds how
  many run together, as the number of closed-loop clients bounds the fleet;
* ``clients``: N closed-loop clients, emulated on the engine that ``LLM.generate`` drives
  (``llm.llm_engine``): N requests in flight, the next one added as soon as one ends. This
  one also times each request's first token.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as the worker runs it


def _engine_args(spec: dict[str, Any]) -> dict[str, Any]:
    """VllmEngine's arguments (dtype: auto on CUDA, bf16 for the CPU gated-delta-net)."""
    return {
        "model": spec["model"],
        "dtype": "auto" if spec["device"] == "cuda" else "bfloat16",
        "max_num_seqs": spec["max_num_seqs"],
        "max_model_len": spec.get("max_model_len"),
        "gpu_memory_utilization": spec.get("gpu_memory_utilization", 0.9),
        "disable_log_stats": True,
        "seed": 0,
    }


def _gpu_used_bytes() -> int | None:
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return total - free


def _generate(llm, requests: list[tuple[list[int], Any]]) -> dict[str, Any]:
    from vllm.sampling_params import RequestOutputKind

    prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
    params = []
    for _, p in requests:
        p.output_kind = RequestOutputKind.FINAL_ONLY  # one output per request, at its end
        params.append(p)
    began = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - began
    done = [
        {
            "tokens": len(o.outputs[0].token_ids),
            "text": o.outputs[0].text,
            "finish_reason": o.outputs[0].finish_reason,
        }
        for o in outs
    ]
    return {"wall_s": wall, "requests": done}


def _clients(llm, requests: list[tuple[list[int], Any]], clients: int) -> dict[str, Any]:
    """``clients`` requests in flight; each step's delta outputs give first-token times."""
    engine = llm.llm_engine
    todo = deque(enumerate(requests))
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    tokens: dict[str, int] = {}
    done: list[dict[str, float | int]] = []

    def add() -> None:
        index, (ids, params) = todo.popleft()
        rid = f"r{index}"
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
        added[rid], tokens[rid] = time.perf_counter(), 0

    began = time.perf_counter()
    for _ in range(min(clients, len(todo))):
        add()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            rid, new = out.request_id, len(out.outputs[0].token_ids)
            if new and rid not in first:
                first[rid] = now
            tokens[rid] += new
            if out.finished:
                done.append(
                    {
                        "tokens": tokens[rid],
                        "ttft_s": first.get(rid, now) - added[rid],
                        "latency_s": now - added[rid],
                    }
                )
                if todo:
                    add()
    return {"wall_s": time.perf_counter() - began, "requests": done}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Load the engine once, warm it up, then time each of the spec's runs in turn."""
    from transformers import AutoTokenizer
    from vllm import LLM

    from shared.protocol import JobInput
    from workers.engine import prompt_ids
    from workers.vllm_engine import sampling_params

    began = time.monotonic()
    llm = LLM(**_engine_args(spec))
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])  # the worker's tokenizer
    result: dict[str, Any] = {"load_s": time.monotonic() - began, "runs": {}}
    result["gpu_memory_used_bytes_after_load"] = _gpu_used_bytes()

    def requests(raw: list[dict[str, Any]]) -> list[tuple[list[int], Any]]:
        jobs = [JobInput.model_validate(r) for r in raw]
        return [(prompt_ids(tokenizer, job), sampling_params(job)) for job in jobs]

    # Untimed: a full batch of the first run's prompts ending one step apart, so every
    # batch size from max_num_seqs down to 1 has run once (first runs of a shape are slow).
    first = spec["runs"][0]["requests"]
    warm = [first[i % len(first)] | {"max_new_tokens": i + 1} for i in range(spec["max_num_seqs"])]
    _generate(llm, requests(warm))
    for run_spec in spec["runs"]:
        reqs = requests(run_spec["requests"])
        if run_spec["mode"] == "generate":
            out = _generate(llm, reqs)
        else:
            out = _clients(llm, reqs, run_spec["clients"])
        out["prompt_tokens"] = sum(len(ids) for ids, _ in reqs)
        result["runs"][run_spec["name"]] = out
        print(f"[bare_vllm] {run_spec['name']}: {out['wall_s']:.2f} s", file=sys.stderr)
    result["gpu_memory_used_bytes_at_end"] = _gpu_used_bytes()
    return result


def start(spec: dict[str, Any], env: dict[str, str], timeout_s: float | None = None) -> dict:
    """Run ``spec`` in .venv-vllm (called from .venv, stdlib only); return its result."""
    import subprocess
    import tempfile

    from fleet import commands
    from fleet.supervisor import die_with_parent

    with tempfile.TemporaryDirectory(prefix="bare-vllm-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        argv = [str(commands.VLLM_PYTHON), "-m", "bench.bare_vllm", str(spec_path), str(out_path)]
        env = os.environ | env | {"PYTHONPATH": str(commands.ROOT), "HF_HUB_OFFLINE": "1"}
        done = subprocess.run(
            argv,
            cwd=commands.ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            preexec_fn=die_with_parent,  # stopped with the benchmark
        )
        if done.returncode:
            raise RuntimeError(f"bare vLLM failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(out_path.read_text())


def main(argv: list[str] | None = None) -> None:
    from shared.settings import Settings
    from workers.cpu_share import limit_threads

    # The worker's thread pool and OpenMP wait policy (set before vLLM loads), so the ratio
    # measures the fleet around the engine, not a different OpenMP setting.
    limit_threads(Settings())
    spec_path, out_path = (argv or sys.argv[1:])[:2]
    result = run(json.loads(Path(spec_path).read_text()))
    Path(out_path).write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
