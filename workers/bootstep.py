"""Runs the micro-batch loop inside a Celery worker, beside (not inside) its event loop.

The loop lives in the worker blueprint, so it starts once and stops only at shutdown (a
consumer-blueprint step would be restarted on every broker reconnect). The model is loaded
in the loop's own thread, which keeps the worker answering heartbeats and remote control
while it loads and while it generates. Under ``--pool=solo`` nothing forks, so CUDA is
initialised in the one process that uses it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING

from celery import bootsteps

from shared.cache import CachePolicy
from shared.job_consumer import JobConsumer
from shared.redis_client import connect
from shared.registry import WorkerRegistry
from shared.settings import get_settings
from workers.flower_tasks import FlowerTasks
from workers.liveness import Heartbeat
from workers.metrics import WorkerMetrics
from workers.model_source import model_version
from workers.parent_watch import ParentWatch

if TYPE_CHECKING:  # torch and an engine load only in a worker, not in Flower or the CLI
    from workers.batcher import MicroBatchLoop
    from workers.engine import Engine

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 120.0


class MicroBatchLoopStep(bootsteps.StartStopStep):
    """Loads the model, then serves micro-batches until the worker shuts down."""

    def __init__(self, parent, **kwargs) -> None:
        super().__init__(parent, **kwargs)
        self.loop: MicroBatchLoop | None = None
        self.engine: Engine | None = None
        self.heartbeat: Heartbeat | None = None
        self.thread: threading.Thread | None = None
        self.threads: int | None = None  # torch intra-op threads, once set
        self._stopping = threading.Event()
        self._draining = False
        self.parent_watch = ParentWatch(get_settings().worker_orphan_grace_s, self.drain)
        parent.fleet_step = self  # for the remote-control commands in workers.control

    def start(self, worker) -> None:
        self.parent_watch.start()
        self.thread = threading.Thread(
            target=self._serve,
            args=(worker.app, worker.hostname),
            name="micro-batch-loop",
            daemon=True,
        )
        self.thread.start()

    def _serve(self, app, worker_name: str) -> None:
        from workers.cpu_share import limit_threads

        settings = get_settings()
        try:
            self.threads = limit_threads(settings)
            self.engine = load_engine(settings)
            self.engine.warm_up()
        except Exception:
            log.exception("could not load the model; shutting down")
            os.kill(os.getpid(), signal.SIGTERM)
            return
        client = connect(settings)
        jobs = JobConsumer.from_settings(settings, client)
        info = self.engine.describe()
        info["model_version"] = version = model_version(
            settings, str(info["engine"]), str(info["model_path"])
        )
        jobs.cache_writes = CachePolicy.from_settings(settings).writes(version)
        metrics = WorkerMetrics(settings.served_model, worker_name, self.engine.nvml_index())
        try:
            metrics.serve(settings.worker_metrics_port)
        except OSError as exc:
            log.warning("no /metrics: port %s: %s", settings.worker_metrics_port, exc)
        tasks = FlowerTasks(app, worker_name)
        loop_class = loop_for(self.engine)
        self.loop = loop_class(settings, jobs, self.engine, worker_name, tasks, metrics)
        registry = WorkerRegistry.from_settings(settings, client)
        registry.set_model_version(settings.served_model, version)
        self.heartbeat = Heartbeat(registry, jobs, settings, self.loop, info)
        self.heartbeat.start()
        if self._stopping.is_set() or self._draining:
            self.loop.request_stop()
        log.info("worker %s serving %s", worker_name, settings.served_model)
        try:
            self.loop.run()
        except Exception:
            # A worker whose loop died would stay up, answering Celery and reading nothing:
            # exit instead, so the supervisor (or Kubernetes) starts it again and its
            # unacknowledged entries run again.
            log.exception("the worker loop failed; shutting down")
            os.kill(os.getpid(), signal.SIGTERM)
            return
        finally:
            self.heartbeat.stop()
        if self._draining and not self._stopping.is_set():
            log.info("drained; shutting down")
            os.kill(os.getpid(), signal.SIGTERM)  # Celery's warm shutdown

    def drain(self) -> None:
        """Stop taking work; the current micro-batch finishes and is acked, then the worker
        exits."""
        self._draining = True
        if self.loop is not None:
            self.loop.request_stop()

    def stop(self, worker) -> None:
        # Called from a signal handler: set flags and join; no logging here.
        self._stopping.set()
        if self.loop is not None:
            self.loop.request_stop()
        if self.thread is not None:
            self.thread.join(STOP_TIMEOUT_S)

    def info(self, worker) -> dict:
        return {"fleet": self.describe()}

    def describe(self) -> dict:
        """The worker's model, device and counters, for inspect stats and Flower."""
        state = "loading" if self.loop is None else ("busy" if self.loop.busy_since else "idle")
        out: dict = {"state": state, "model": get_settings().served_model}
        if self.threads is not None:
            out["torch_threads"] = self.threads
        if self.engine is not None:
            out.update(self.engine.describe())
            out.update(self.engine.memory())
        if self.loop is not None:
            out.update(self.loop.stats.as_dict())
        return out


def load_engine(settings) -> Engine:
    """The engine ENGINE names (auto: vllm where installed and a GPU is present)."""
    from workers.engine import choose_engine
    from workers.model_source import resolve_model_path

    engine = choose_engine(settings.engine)
    path = resolve_model_path(settings)
    if engine == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise RuntimeError(
                f"ENGINE=vllm, but {sys.executable} has no vLLM: run the worker from "
                ".venv-vllm (`make vllm-env`) or a vLLM image (docker/)"
            )
        from workers.vllm_engine import VllmEngine

        device = "cpu" if settings.device == "cpu" or not _has_cuda() else "cuda"
        return VllmEngine(path, settings, device)
    from workers.transformers_engine import TransformersEngine, pick_device

    return TransformersEngine(path, pick_device(settings.device))


def loop_for(engine: Engine) -> type[MicroBatchLoop]:
    """Micro-batches for the transformers engine; per-step feeding for a continuous one."""
    if engine.continuous:
        from workers.continuous import ContinuousLoop

        return ContinuousLoop
    from workers.batcher import MicroBatchLoop

    return MicroBatchLoop


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
