"""A batch's progress on stderr: a live bar in a terminal, a line now and then elsewhere.

The bar shows finished / total, how many failed, the rate and the ETA. It redraws twice a
second at most, and only the numbers the last poll brought change: following a batch of
10,000 requests costs the CLI almost nothing.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from fleet.batch_api import BatchState

PLAIN_EVERY_S = 10.0  # without a terminal: one progress line this often


class CountsColumn(ProgressColumn):
    def render(self, task: Task) -> Text:
        total = "?" if task.total is None else f"{task.total:,.0f}"
        text = Text(f"{task.completed:,.0f}/{total}", style="progress.download")
        failed = task.fields.get("failed", 0)
        text.append(f"  {failed:,} failed", style="red" if failed else "dim")
        cancelled = task.fields.get("cancelled", 0)
        if cancelled:
            text.append(f"  {cancelled:,} cancelled", style="yellow")
        return text


class RateColumn(ProgressColumn):
    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        shown = f"{speed:,.1f} req/s" if speed else "- req/s"
        return Text(shown, style="progress.data.speed")


class ProgressView:
    """Shows each :class:`BatchState` it is given; use it as a context manager."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.live = console.is_terminal
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            CountsColumn(),
            RateColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            refresh_per_second=2,
            transient=False,
        )
        self.task = None
        self.started = time.monotonic()
        self.last_line = 0.0

    def __enter__(self) -> ProgressView:
        if self.live:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.live:
            self.progress.stop()

    def show(self, state: BatchState) -> None:
        if self.live:
            self._update_bar(state)
        elif not state.ended and time.monotonic() - self.last_line >= PLAIN_EVERY_S:
            self.last_line = time.monotonic()
            total = "?" if state.total is None else state.total
            elapsed = time.monotonic() - self.started
            self.console.print(
                f"{state.id} {state.status}: {state.finished}/{total} done, "
                f"{state.failed} failed ({elapsed:.0f}s)",
                highlight=False,
            )

    def _update_bar(self, state: BatchState) -> None:
        fields = {"failed": state.failed, "cancelled": state.cancelled}
        if self.task is None:
            self.task = self.progress.add_task(
                state.status, total=state.total, completed=state.finished, **fields
            )
        self.progress.update(
            self.task, description=state.status, total=state.total,
            completed=state.finished, **fields,
        )  # fmt: skip
