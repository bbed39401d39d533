"""Local scaling under ``make up``: start and stop worker processes.

With GPUs, worker i sees only GPU i mod n (CUDA_VISIBLE_DEVICES), one worker per GPU by
default. Without GPUs, at most a CPU-sized cap, and each worker gets its share of the cores
(WORKER_THREADS = cores // max_workers, fixed while the autoscaler scales): workers that
each used every core fought over them. Removing a worker is a warm drain (SIGTERM: it
stops reading, finishes and acks its micro-batch, then exits), never a kill mid-batch.
A worker that crashes is replaced by the supervisor.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from fleet import commands
from fleet.supervisor import Service, Supervisor
from shared.settings import Settings
from workers.cpu_share import share_of_cores, usable_cores

WORKER_STOP_TIMEOUT_S = 130  # past the worker's own 120 s bound for finishing its batch


def visible_gpus() -> int:
    """GPUs on this machine, asked of nvidia-smi so this process never initialises CUDA."""
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(
            ["nvidia-smi", "--list-gpus"], capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


class WorkerPool:
    """The local fleet's workers, grown and shrunk by the autoscaler."""

    def __init__(self, supervisor: Supervisor, settings: Settings) -> None:
        self.supervisor = supervisor
        self.settings = settings
        self.gpus = visible_gpus()
        self.cap = self.gpus if self.gpus else max(4, os.cpu_count() or 1)
        self.engine = commands.worker_engine(settings, self.gpus)
        self.workers: list[Service] = []

    @property
    def max_workers(self) -> int:
        wanted = self.settings.max_workers or max(1, self.gpus)
        return min(wanted, self.cap)

    def count(self) -> int:
        return len(self.workers)

    def scale_to(self, n: int) -> None:
        while len(self.workers) < n:
            self.workers.append(self.supervisor.start(self._worker(len(self.workers))))
        while len(self.workers) > n:
            self.supervisor.retire(self.workers.pop())

    def _worker(self, index: int) -> Service:
        env = {"WORKER_METRICS_PORT": str(self._metrics_port(index)), "ENGINE": self.engine}
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = str(index % self.gpus)
        elif not self.settings.worker_threads:  # else the operator's value is inherited
            env["WORKER_THREADS"] = str(share_of_cores(usable_cores(), self.max_workers))
        name = f"worker{index}" if index else "worker"
        argv = commands.worker(commands.worker_name(index), engine=self.engine)
        return Service(name, argv, WORKER_STOP_TIMEOUT_S, env=env)

    def _metrics_port(self, index: int) -> int:
        base = self.settings.worker_metrics_port
        return base + index if base else 0
