"""The Celery app of the GPU workers: ``celery -A workers.celery_app worker --pool=solo``.

Celery gives the fleet its worker lifecycle, remote control and Flower; the micro-batches
themselves come from Redis Streams (kombu has no Streams transport), read by the micro-batch
loop that :class:`workers.bootstep.MicroBatchLoopStep` runs beside the event loop.
"""

from __future__ import annotations

from celery import Celery

from shared.settings import get_settings
from workers import control  # noqa: F401  (registers the fleet_* remote-control commands)
from workers.bootstep import MicroBatchLoopStep

GPU_QUEUE = "gpu"  # GPU workers consume no Celery tasks today; this keeps them off others


def create_celery() -> Celery:
    settings = get_settings()
    app = Celery("fleet", broker=settings.effective_redis_url)
    app.conf.update(
        broker_connection_retry_on_startup=True,
        task_default_queue=GPU_QUEUE,
        worker_send_task_events=True,
        worker_prefetch_multiplier=1,
    )
    app.steps["worker"].add(MicroBatchLoopStep)
    return app


app = create_celery()
