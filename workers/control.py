"""Remote-control commands of the GPU workers (``celery -A workers.celery_app ...``).

* ``celery -A workers.celery_app inspect fleet_model`` returns each worker's loaded model.
* ``celery -A workers.celery_app control fleet_drain -d NAME`` drains one worker: it stops
  reading, finishes and acknowledges its current micro-batch, then shuts down warm.
"""

from __future__ import annotations

from celery.worker.control import control_command, inspect_command


def _step(state):
    return getattr(state.consumer.controller, "fleet_step", None)


@inspect_command()
def fleet_model(state) -> dict:
    """The loaded model, its device and counters."""
    step = _step(state)
    return step.describe() if step is not None else {"state": "no micro-batch loop"}


@control_command()
def fleet_drain(state) -> dict:
    """Stop reading, finish the current micro-batch, then exit."""
    step = _step(state)
    if step is None:
        return {"error": "no micro-batch loop"}
    step.drain()
    return {"ok": "draining"}
