"""CPU workers share the cores: each sizes its thread pools to its share before loading.

The decision is tested in this process (no model load); one real worker, started with
WORKER_THREADS=1, shows the count reaches the process that generates.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from celery import Celery

from fleet import commands, worker_pool
from fleet.processes import Process, wait_until
from fleet.supervisor import Service
from shared.registry import WorkerRegistry
from shared.settings import DEMO_MODEL_ID, Settings
from tests.conftest import fleet_env
from workers import cpu_share

OPENMP_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", cpu_share.VLLM_BIND)


@pytest.fixture
def openmp_unset(monkeypatch) -> Iterator[None]:
    """The OpenMP variables start unset, and whatever the test sets is undone after it."""
    for name in OPENMP_VARS:
        monkeypatch.setenv(name, "")  # records the old value (or its absence) for undo
        monkeypatch.delenv(name)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _cores(monkeypatch, n: int) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)))


@pytest.mark.parametrize(
    ("cores", "workers", "share"),
    [(2, 1, 2), (2, 2, 1), (2, 3, 1), (8, 3, 2), (16, 4, 4), (1, 4, 1), (4, 0, 4)],
)
def test_share_is_cores_over_workers_at_least_one(cores, workers, share):
    assert cpu_share.share_of_cores(cores, workers) == share


def test_worker_threads_wins_over_the_cores():
    assert cpu_share.thread_count(Settings(worker_threads=3), cores=2) == 3
    assert cpu_share.thread_count(Settings(worker_threads=0), cores=2) == 2


def test_a_worker_sharing_the_machine_is_not_pinned_by_vllm():
    assert cpu_share.openmp_env(1, cores=2) == {
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }
    # With every core it keeps vLLM's own binding (which spares a core for its scheduler).
    assert cpu_share.openmp_env(2, cores=2) == {"OMP_NUM_THREADS": "2"}


def test_limit_threads_sets_torch_and_the_environment_vllm_reads(monkeypatch, openmp_unset):
    _cores(monkeypatch, 4)
    assert cpu_share.limit_threads(Settings(worker_threads=1, device="cpu")) == 1
    assert torch.get_num_threads() == 1
    assert os.environ["OMP_NUM_THREADS"] == "1"
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE", "idle threads sleep, never spin"


def test_limit_threads_defaults_to_the_cores_this_process_may_use(monkeypatch, openmp_unset):
    _cores(monkeypatch, 1)
    assert cpu_share.limit_threads(Settings(worker_threads=0, device="cpu")) == 1
    assert torch.get_num_threads() == 1
    assert os.environ["OMP_NUM_THREADS"] == "1"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ


def test_an_operators_openmp_settings_win(monkeypatch, openmp_unset):
    _cores(monkeypatch, 4)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    assert cpu_share.limit_threads(Settings(worker_threads=1, device="cpu")) == 1
    assert os.environ["OMP_NUM_THREADS"] == "3"
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"


def test_on_a_gpu_only_torch_threads_are_set(monkeypatch, openmp_unset):
    _cores(monkeypatch, 4)
    assert cpu_share.limit_threads(Settings(worker_threads=2, device="cuda")) == 2
    assert torch.get_num_threads() == 2
    set_here = [name for name in OPENMP_VARS if name in os.environ]
    assert set_here == ["OMP_WAIT_POLICY"], "only the wait policy, everywhere"


class _Supervisor:
    def start(self, service: Service) -> Service:
        return service


def _pool(monkeypatch, gpus: int = 0, cores: int = 2, **settings) -> worker_pool.WorkerPool:
    monkeypatch.setattr(worker_pool, "visible_gpus", lambda: gpus)
    monkeypatch.setattr(worker_pool, "usable_cores", lambda: cores)
    pool = worker_pool.WorkerPool(_Supervisor(), Settings(**{"worker_threads": 0} | settings))
    pool.scale_to(pool.max_workers)
    return pool


def test_pool_gives_each_cpu_worker_its_share_of_max_workers(monkeypatch):
    pool = _pool(monkeypatch, cores=2, max_workers=3)
    assert [w.env["WORKER_THREADS"] for w in pool.workers] == ["1", "1", "1"]
    pool = _pool(monkeypatch, cores=8, max_workers=3, min_workers=1)
    assert [w.env["WORKER_THREADS"] for w in pool.workers] == ["2", "2", "2"]
    pool = _pool(monkeypatch, cores=2)  # one worker by default: it has every core
    assert [w.env["WORKER_THREADS"] for w in pool.workers] == ["2"]
    assert pool.workers[0].env["ENGINE"] == "transformers"


def test_pool_leaves_an_operators_worker_threads_and_gpu_workers_alone(monkeypatch):
    pool = _pool(monkeypatch, cores=2, max_workers=3, worker_threads=2)
    assert all("WORKER_THREADS" not in w.env for w in pool.workers)
    pool = _pool(monkeypatch, gpus=2, cores=32)
    assert [w.env.get("WORKER_THREADS") for w in pool.workers] == [None, None]
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in pool.workers] == ["0", "1"]


def test_a_real_worker_runs_torch_on_its_worker_threads(redis_url, demo_model_path, tmp_path):
    prefix = f"cores{uuid.uuid4().hex[:6]}"
    name = f"{prefix}@localhost"
    env = fleet_env(redis_url, key_prefix=prefix, worker_threads=1)
    worker = Process("worker", commands.worker(name), env, Path(tmp_path) / "worker.log")
    try:
        registry = WorkerRegistry.from_settings(Settings(key_prefix=prefix, redis_url=redis_url))
        wait_until(
            lambda: registry.ready_workers(DEMO_MODEL_ID, 10) > 0, 180, "worker not ready", worker
        )
        app = Celery(broker=redis_url)
        stats = app.control.inspect(destination=[name], timeout=5).stats()
        info = stats[name]["fleet"]
        assert "torch_threads" in info, f"inspect stats lack torch_threads: {sorted(info)}"
        assert info["torch_threads"] == 1
    finally:
        worker.stop()
