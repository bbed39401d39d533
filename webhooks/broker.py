"""The webhooks Celery app's configuration, shared by the worker and every producer.

Its broker keys carry the fleet's KEY_PREFIX (kombu's ``global_keyprefix``), so the
``webhooks`` queue and its unacked messages are apart from the GPU workers' (whose
one-hour visibility timeout would otherwise re-queue our long retry countdowns) and
from other fleets sharing the Redis.
"""

from __future__ import annotations

from celery import Celery

from shared.keys import Keys
from shared.settings import Settings
from webhooks.policy import retry_after_cap_s

QUEUE = "webhooks"
DELIVER_TASK = "webhooks.deliver"
# An unacked message (a retry held by the worker until its countdown) is re-queued after
# the visibility timeout, so it must outlast the longest countdown by a margin.
VISIBILITY_MARGIN_S = 3600


def create_app(settings: Settings, *, main: bool = False) -> Celery:
    visibility = retry_after_cap_s(settings.webhook_retry_schedule_s) + VISIBILITY_MARGIN_S
    app = Celery("webhooks", broker=settings.effective_redis_url, set_as_current=main)
    app.conf.update(
        broker_connection_retry_on_startup=True,
        broker_transport_options={
            "global_keyprefix": Keys(settings.key_prefix).webhook_broker_prefix(),
            "visibility_timeout": int(visibility),
        },
        task_default_queue=QUEUE,
        task_routes={DELIVER_TASK: {"queue": QUEUE}},
        task_acks_late=True,  # a worker killed mid-attempt leaves its message to re-run
        task_ignore_result=True,
        worker_prefetch_multiplier=1,
        worker_send_task_events=True,
    )
    return app
