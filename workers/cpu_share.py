"""How many threads a worker's model may run on: its share of the cores, not all of them.

Torch's OpenMP pool starts one intra-op thread per core, and so does vLLM's CPU engine.
N workers on C cores would run N x C threads that spin at every barrier waiting for a
sibling that is descheduled: 3 workers on 2 cores ran ~30x slower under a little outside
load. So each worker sizes its pool before any model loads: WORKER_THREADS, which the local
launcher sets to ``cores // max_workers``, or else every core it may use (a pod of its own).
"""

from __future__ import annotations

import os

from shared.settings import Settings

# When vLLM's CPU engine runs in processes of its own (VLLM_ENABLE_V1_MULTIPROCESSING=1), it
# pins each one's OpenMP threads (vllm/utils/ompmultiprocessing.py). Its default, "auto",
# picks the same cores of NUMA node 0 in every worker, so workers sharing a machine would
# all be pinned to the same cores, unable to move off them. "nobind" leaves placement to
# the kernel, with OMP_NUM_THREADS threads each. In-process (the fleet's default) vLLM
# binds nothing: the torch thread count set here is the one its kernels run on.
VLLM_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def usable_cores() -> int:
    """Cores this process may run on: its affinity mask (a container's cpuset), not the host's."""
    return len(os.sched_getaffinity(0))


def share_of_cores(cores: int, workers: int) -> int:
    """One worker's threads when ``workers`` share ``cores``: an equal share, at least 1."""
    return max(1, cores // max(1, workers))


def thread_count(settings: Settings, cores: int) -> int:
    """WORKER_THREADS if set, else all ``cores``."""
    return settings.worker_threads or cores


def openmp_env(threads: int, cores: int) -> dict[str, str]:
    """What vLLM's CPU engine reads: OMP_NUM_THREADS (set outside vLLM, it keeps this torch
    thread count for serving) and, in engine processes of its own, the binding.

    A worker with fewer threads than cores shares the machine, so its threads are not
    pinned (see VLLM_BIND); a worker that has every core keeps vLLM's own binding, which
    also keeps a core free for vLLM's scheduler process.
    """
    env = {"OMP_NUM_THREADS": str(threads)}
    if threads < cores:
        env[VLLM_BIND] = "nobind"
    return env


def limit_threads(settings: Settings) -> int:
    """Size this worker's torch and OpenMP thread pools; returns the thread count.

    Call it in the thread that will load and run the model, before the model loads: torch
    applies a thread count to threads that have not yet run a parallel op. The environment
    is only set where unset, so an operator's OMP_NUM_THREADS or binding wins. On a GPU the
    environment is left alone: vLLM sizes its GPU workers' threads itself.
    """
    # Idle OpenMP threads sleep instead of spinning: a spinning pool that shares its cores
    # (with the gateway, Redis, other workers) starves the sibling it waits for. Read when
    # the OpenMP runtime loads, so set before torch is first imported.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch  # not at import time: the launcher and Flower import this package too

    cores = usable_cores()
    threads = thread_count(settings, cores)
    if _on_cpu(settings.device):
        for name, value in openmp_env(threads, cores).items():
            os.environ.setdefault(name, value)
    torch.set_num_threads(threads)
    return threads


def _on_cpu(device: str) -> bool:
    if device == "auto":
        import torch

        return not torch.cuda.is_available()
    return device == "cpu"
