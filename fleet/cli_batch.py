"""``fleet batch``: run a JSONL file as a batch with a live progress bar, or follow a batch
by its id (``status``, ``results``, ``cancel``).

``run`` polls the batch about twice a second (one GET each) and, once it ends, streams the
results into the output file as they arrive from the server, unparsed. Ctrl-C stops
following and asks whether to cancel the batch or leave it running; either way it prints
the batch's id.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.prompt import Confirm

from fleet.batch_api import OPENAI, Batches, BatchState, NativeBatches, OpenAIBatches, find
from fleet.batch_api import line_format as detect_line_format
from fleet.cli_http import FleetClient, FleetError
from fleet.cli_progress import ProgressView

POLL_S = 0.5
RECONNECT_FOR_S = 60.0  # a poll that fails is retried this long (a gateway restarting)
INTERRUPTED = 130  # the shell's code for a command stopped by Ctrl-C

app = typer.Typer(
    help="Batches: run a JSONL file with a progress bar, or follow one by its id.",
    no_args_is_help=True,
)
err = Console(stderr=True, highlight=False, soft_wrap=True)  # errors stay on one line

Output = Annotated[
    Path | None,
    typer.Option("--output", "-o", help="Write the results here (JSONL). Default: stdout."),
]


@app.command()
def run(
    file: Annotated[
        Path, typer.Argument(exists=True, dir_okay=False, readable=True, help="requests, JSONL")
    ],
    output: Output = None,
    model: Annotated[str | None, typer.Option(help="Served model (native files).")] = None,
    metadata: Annotated[
        list[str] | None, typer.Option("--metadata", "-m", help="KEY=VALUE, repeatable.")
    ] = None,
) -> None:
    """Submit FILE as a batch, show its progress, and write its results when it ends.

    FILE holds one request per line, in the native format ({"custom_id", "prompt" or
    "messages", "max_new_tokens", ...}) or OpenAI's ({"custom_id", "method", "url",
    "body"}: sent through the fleet's OpenAI Batch API). Ctrl-C asks whether to cancel the
    batch or leave it running. Exits 0 when the batch completed (failed requests are in
    the results), 1 on an error, 130 when interrupted.
    """
    client = FleetClient.from_env()
    api: Batches = (
        OpenAIBatches(client) if detect_line_format(file) == OPENAI else NativeBatches(client)
    )
    state = api.create(file, model, _metadata(metadata or []))
    total = "?" if state.total is None else f"{state.total:,}"  # OpenAI counts them later
    err.print(f"batch [bold]{state.id}[/] ({api.api} API): {total} requests")
    try:
        state = _follow(api, state)
    except KeyboardInterrupt:
        _finish(api, _interrupted(api, state), output)  # cancelled: what ended is written
        raise typer.Exit(INTERRUPTED) from None
    _finish(api, state, output)


@app.command()
def status(
    batch_id: Annotated[str, typer.Argument(metavar="ID")],
    as_json: Annotated[bool, typer.Option("--json", help="The server's batch object.")] = False,
) -> None:
    """Print a batch's status and request counts."""
    _, state = find(FleetClient.from_env(), batch_id)
    if as_json:
        print(json.dumps(state.raw, indent=2))
        return
    print(
        f"{state.id}  {state.status}  {_done(state)} done: {state.succeeded} succeeded, "
        f"{state.failed} failed, {state.cancelled} cancelled"
    )
    if state.problem:
        print(f"  {state.problem}")


@app.command()
def results(batch_id: Annotated[str, typer.Argument(metavar="ID")], output: Output = None) -> None:
    """Write a batch's results (JSONL): all of them once it ended, those so far before."""
    api, state = find(FleetClient.from_env(), batch_id)
    if not state.ended:
        err.print(f"[yellow]batch {state.id} is {state.status}: these are the results so far")
    with _opened(output) as out:
        api.write_results(state, out)


@app.command()
def cancel(batch_id: Annotated[str, typer.Argument(metavar="ID")]) -> None:
    """Cancel a batch: queued requests end at once, running ones finish."""
    api, state = find(FleetClient.from_env(), batch_id)
    state = api.cancel(state.id)
    print(f"{state.id}  {state.status}  ({_done(state)} ended)")


def _follow(api: Batches, state: BatchState) -> BatchState:
    """Poll until the batch ends, showing each state."""
    with ProgressView(err) as view:
        view.show(state)
        while not state.ended:
            time.sleep(POLL_S)
            state = _poll(api, state)
            view.show(state)
    return state


def _poll(api: Batches, state: BatchState) -> BatchState:
    """The batch now; a failed poll is retried for a while before giving up."""
    give_up = time.monotonic() + RECONNECT_FOR_S
    while True:
        try:
            return api.get(state.id)
        except FleetError as exc:
            if not exc.transient or time.monotonic() > give_up:
                raise FleetError(f"{exc}\nbatch {state.id} may still be running: "
                                 f"`fleet batch status {state.id}`") from None  # fmt: skip
            time.sleep(1.0)


def _interrupted(api: Batches, state: BatchState) -> BatchState:
    """Ctrl-C: cancel the batch and follow it to its end, or leave it running and exit."""
    err.print()
    try:
        state = api.get(state.id)
        if state.ended:
            return state
        cancel = Confirm.ask(
            f"Cancel batch [bold]{state.id}[/] ({_done(state)} done)? "
            "[dim]n leaves it running[/]",
            console=err, default=False,
        )  # fmt: skip
    except (KeyboardInterrupt, EOFError):
        cancel = False
    if not cancel:
        err.print(
            f"batch [bold]{state.id}[/] keeps running. Follow it with `fleet batch status "
            f"{state.id}`, get its results with `fleet batch results {state.id} -o FILE`."
        )
        raise typer.Exit(INTERRUPTED)
    state = api.cancel(state.id)
    err.print(f"cancelling batch [bold]{state.id}[/]: queued requests end now, running ones "
              "finish")  # fmt: skip
    try:
        state = _follow(api, state)
    except KeyboardInterrupt:
        err.print(f"\nbatch [bold]{state.id}[/] is cancelling; its results: "
                  f"`fleet batch results {state.id} -o FILE`")  # fmt: skip
        raise typer.Exit(INTERRUPTED) from None
    return state


def _finish(api: Batches, state: BatchState, output: Path | None) -> None:
    """Write the results and say how the batch ended; a failed batch exits 1."""
    with _opened(output) as out:
        api.write_results(state, out)
    where = f"; results in {output}" if output and str(output) != "-" else ""
    err.print(
        f"batch [bold]{state.id}[/] {state.status}: {state.succeeded:,} succeeded, "
        f"{state.failed:,} failed, {state.cancelled:,} cancelled{where}"
    )
    if state.problem:
        err.print(f"[red]{escape(state.problem)}")
    if state.status not in ("completed", "cancelled"):
        raise typer.Exit(1)


@contextlib.contextmanager
def _opened(output: Path | None) -> Iterator[IO[bytes]]:
    if output is None or str(output) == "-":
        yield sys.stdout.buffer
        sys.stdout.buffer.flush()
        return
    try:
        with output.open("wb") as out:
            yield out
    except OSError as exc:
        raise FleetError(f"cannot write {output}: {exc.strerror}") from None


def _done(state: BatchState) -> str:
    return f"{state.finished}/{'?' if state.total is None else state.total}"


def _metadata(pairs: list[str]) -> dict[str, str]:
    metadata = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"'{pair}': metadata is KEY=VALUE", param_hint="--metadata")
        metadata[key] = value
    return metadata
