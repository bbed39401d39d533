"""The command line of every fleet process, in one place.

``make up`` (:mod:`fleet.up`), the tests and the benchmark all start processes from these,
so what is tested is what runs.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from shared.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
# The vLLM engine pins its own torch and transformers, so its workers run from their own
# virtualenv (``make vllm-env``); the gateway and everything else keep .venv.
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def worker_engine(settings: Settings, gpus: int) -> str:
    """ENGINE resolved for a local worker: auto is vllm where .venv-vllm exists and a GPU is
    present, else transformers."""
    if settings.engine != "auto":
        return settings.engine
    return "vllm" if gpus and VLLM_PYTHON.exists() else "transformers"


def redis_server(port: int, data_dir: Path, config: Path | None = None) -> list[str]:
    """An embedded Redis: AOF, fsync every second, loopback only, no RDB snapshots. What
    must not be on its command line (the password) comes from the ``config`` file."""
    data_dir.mkdir(parents=True, exist_ok=True)
    return [
        "redis-server",
        *([str(config)] if config else []),  # redis-server takes a config file first
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--dir", str(data_dir),
        "--appendonly", "yes",
        "--appendfsync", "everysec",
        "--save", "",
        "--protected-mode", "yes",
    ]  # fmt: skip


def worker(name: str, loglevel: str = "info", engine: str = "transformers") -> list[str]:
    """One GPU worker: solo pool, so the model and CUDA live in the one process. A vllm
    worker runs on .venv-vllm's Python (set ENGINE=vllm in its environment too)."""
    python = str(VLLM_PYTHON) if engine == "vllm" else PYTHON
    return [
        python, "-m", "celery", "-A", "workers.celery_app", "worker",
        "--pool=solo", f"--hostname={name}", "--queues=gpu", f"--loglevel={loglevel}",
    ]  # fmt: skip


def webhook_worker(name: str, loglevel: str = "info") -> list[str]:
    """The webhook worker: its own light app and queue; threads, as attempts wait on I/O."""
    return [
        PYTHON, "-m", "celery", "-A", "webhooks.celery_app", "worker",
        "--queues=webhooks", "--pool=threads", "--concurrency=8",
        f"--hostname={name}", f"--loglevel={loglevel}",
    ]  # fmt: skip


def gateway() -> list[str]:
    return [
        PYTHON,
        "-m",
        "gunicorn",
        "-c",
        str(ROOT / "gateway/gunicorn_conf.py"),
        "gateway.wsgi:app",
    ]


def flower(settings: Settings) -> list[str]:
    # FLOWER_BASIC_AUTH, if set, is read by Flower itself from the environment.
    return [
        PYTHON, "-m", "celery", "-A", "workers.celery_app", "flower",
        f"--address={settings.gateway_host}", f"--port={settings.flower_port}",
    ]  # fmt: skip


def worker_name(index: int) -> str:
    return f"infer{index}@{socket.gethostname()}"


def webhook_worker_name() -> str:
    return f"webhooks@{socket.gethostname()}"
