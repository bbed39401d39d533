"""ParentWatch on its own: a worker whose parent is gone drains, then exits at the grace."""

from __future__ import annotations

import os
import threading

from workers.parent_watch import ABANDONED_EXIT_CODE, ParentWatch


class Recorder:
    def __init__(self) -> None:
        self.drained = threading.Event()
        self.exited: list[int] = []
        self.exit_called = threading.Event()

    def drain(self) -> None:
        self.drained.set()

    def exit_now(self, code: int) -> None:
        self.exited.append(code)
        self.exit_called.set()


def orphaned_watch(grace_s: float) -> tuple[ParentWatch, Recorder]:
    recorder = Recorder()
    watch = ParentWatch(grace_s, recorder.drain, recorder.exit_now)
    watch.parent = os.getppid() + 100_000  # as if the parent it started with were gone
    return watch, recorder


def test_an_orphan_drains_then_exits_at_the_grace():
    watch, recorder = orphaned_watch(grace_s=0.3)
    watch.start()
    assert recorder.drained.wait(5)
    assert recorder.exit_called.wait(5)
    assert recorder.exited == [ABANDONED_EXIT_CODE]


def test_a_worker_that_stops_within_the_grace_is_not_killed():
    watch, recorder = orphaned_watch(grace_s=30)
    watch.start()
    assert recorder.drained.wait(5)
    watch.stop()  # the drain finished: the worker shuts down on its own
    watch._thread.join(5)
    assert recorder.exited == []


def test_a_live_parent_is_left_alone():
    recorder = Recorder()
    watch = ParentWatch(0.1, recorder.drain, recorder.exit_now)
    watch.start()
    assert not recorder.drained.wait(1.2)
    watch.stop()
