"""A worker's Prometheus ``/metrics``, on its own port (WORKER_METRICS_PORT).

Micro-batch series come from the micro-batch loop; GPU utilisation and memory are read from
NVML at scrape time, when the worker runs on a GPU.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SECONDS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class WorkerMetrics:
    def __init__(self, model: str, worker: str, gpu_index: int | None) -> None:
        self.registry = CollectorRegistry()
        self._labels = {"model": model, "worker": worker}
        names, reg = list(self._labels), self.registry
        self._batch_size = Histogram(
            "fleet_worker_batch_size", "Jobs per micro-batch.", names, buckets=BATCH_SIZES,
            registry=reg,
        ).labels(**self._labels)  # fmt: skip
        self._inference = Histogram(
            "fleet_worker_inference_seconds", "Inference time of a micro-batch.", names,
            buckets=SECONDS, registry=reg,
        ).labels(**self._labels)  # fmt: skip
        self._prompt = Counter(
            "fleet_worker_prompt_tokens", "Prompt tokens processed.", names, registry=reg
        ).labels(**self._labels)
        self._generated = Counter(
            "fleet_worker_generated_tokens", "Tokens generated.", names, registry=reg
        ).labels(**self._labels)
        self._jobs = Counter(
            "fleet_worker_jobs", "Jobs ended here, by status.", [*names, "status"], registry=reg
        )
        self._busy = Gauge(
            "fleet_worker_busy", "1 while a micro-batch runs.", names, registry=reg
        ).labels(**self._labels)
        self._running = Gauge(
            "fleet_worker_running_sequences",
            "Jobs generating now: a micro-batch's rows, or the sequences in a continuous engine.",
            names, registry=reg,
        ).labels(**self._labels)  # fmt: skip
        if gpu_index is not None:
            reg.register(GpuCollector(worker, gpu_index))

    def serve(self, port: int) -> None:
        if port:
            start_http_server(port, registry=self.registry)
            log.info("metrics on :%d/metrics", port)

    def busy(self, value: bool) -> None:
        self._busy.set(1 if value else 0)

    def running(self, sequences: int) -> None:
        self._running.set(sequences)

    def micro_batch(self, size: int, seconds: float, prompt_tokens: int, generated_tokens: int,
              statuses: dict[str, int]) -> None:  # fmt: skip
        self._batch_size.observe(size)
        self._inference.observe(seconds)
        self._prompt.inc(prompt_tokens)
        self._generated.inc(generated_tokens)
        for status, count in statuses.items():
            self._jobs.labels(**self._labels, status=status).inc(count)


class GpuCollector:
    """GPU utilisation and memory from NVML, read at scrape time."""

    def __init__(self, worker: str, index: int) -> None:
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.worker = worker
        self.index = index
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)

    def collect(self):
        labels = ["worker", "gpu"]
        values = [self.worker, str(self.index)]
        util = GaugeMetricFamily(
            "fleet_worker_gpu_utilization_ratio", "GPU busy share.", labels=labels
        )
        used = GaugeMetricFamily(
            "fleet_worker_gpu_memory_used_bytes", "GPU memory used.", labels=labels
        )
        total = GaugeMetricFamily(
            "fleet_worker_gpu_memory_total_bytes", "GPU memory.", labels=labels
        )
        try:
            rates = self.nvml.nvmlDeviceGetUtilizationRates(self.handle)
            memory = self.nvml.nvmlDeviceGetMemoryInfo(self.handle)
        except self.nvml.NVMLError as exc:
            log.warning("NVML read failed: %s", exc)
            return
        util.add_metric(values, rates.gpu / 100)
        used.add_metric(values, memory.used)
        total.add_metric(values, memory.total)
        yield from (util, used, total)
