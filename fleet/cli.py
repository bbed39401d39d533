"""``fleet``: the fleet's command line, one entry point for users and operators.

    fleet submit "prompt" [--stream] [--max-tokens N] ...   one job, its text printed
    fleet batch run requests.jsonl -o results.jsonl         a batch, with a progress bar
    fleet batch status|results|cancel ID
    fleet status                                            the fleet at a glance
    fleet keys ..., fleet deadletters ...                   operator commands

``submit`` and ``batch`` talk to the gateway at FLEET_URL (default http://127.0.0.1:8000)
with FLEET_API_KEY; ``status``, ``keys`` and ``deadletters`` read Redis as the fleet does
(REDIS_URL, KEY_PREFIX). Exit codes: 0 done, 1 failed, 2 bad usage, 130 interrupted.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.markup import escape

from fleet import cli_batch
from fleet.cli_http import FleetClient, FleetError

INTERRUPTED = cli_batch.INTERRUPTED
WAIT_S = 60  # Prefer: wait on submit; a longer job is followed on its event stream
RESUMES = 3  # a broken stream is resumed (Last-Event-ID) this many times

app = typer.Typer(
    help="The fleet's command line: jobs, batches and the operator commands.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,  # locals hold the API key
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(cli_batch.app, name="batch")
err = cli_batch.err
PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


@app.command()
def submit(
    prompt: Annotated[str, typer.Argument(help="The prompt; - reads it from stdin.")],
    stream: Annotated[bool, typer.Option(help="Print the text as it is generated.")] = False,
    max_tokens: Annotated[int | None, typer.Option(min=1, help="Most tokens to generate.")] = None,
    temperature: Annotated[float | None, typer.Option(help="0 is greedy.")] = None,
    top_p: Annotated[float | None, typer.Option()] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string, repeatable.")] = None,
    seed: Annotated[int | None, typer.Option()] = None,
    system: Annotated[str | None, typer.Option(help="A system message before the prompt.")] = None,
    model: Annotated[str | None, typer.Option(help="Served model id.")] = None,
    cache: Annotated[bool, typer.Option(help="Allow an answer from the result cache.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print the whole job object.")] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Say on stderr which job ran, and how fast.")
    ] = False,
) -> None:
    """Run one prompt and print its text. Ctrl-C cancels the job."""
    text = sys.stdin.read() if prompt == "-" else prompt
    body: dict = {"prompt": text}
    if system is not None:
        body = {"messages": [{"role": "system", "content": system},
                             {"role": "user", "content": text}]}  # fmt: skip
    fields = {"max_new_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
              "stop": stop, "seed": seed, "model": model}  # fmt: skip
    body |= {k: v for k, v in fields.items() if v is not None}
    if not cache:
        body["cache"] = False
    client = FleetClient.from_env()
    job_id: list[str] = []  # filled as soon as the job exists, for Ctrl-C
    try:
        if stream:
            job = _stream(client, body, job_id, echo=not as_json)
        else:
            job = _wait(client, body, job_id)
    except KeyboardInterrupt:
        if job_id:
            client.request("POST", f"/v1/jobs/{job_id[0]}/cancel", ok=(200, 202, 404, 409))
            err.print(f"\ncancelled job {job_id[0]}")
        raise typer.Exit(INTERRUPTED) from None
    if as_json:
        print(json.dumps(job, indent=2), flush=True)
    elif not stream and job.get("output"):
        print(job["output"]["text"], flush=True)
    if verbose:
        err.print(_summary(job))
    if job["status"] != "succeeded":
        error = job.get("error") or {}
        err.print(f"[red]job {job['id']} {job['status']}[/]: {escape(error.get('message', ''))}")
        raise typer.Exit(1)


def _summary(job: dict) -> str:
    """``job_... succeeded: 16 tokens, queued 0.01 s, ran 0.42 s``"""
    metrics, usage = job.get("metrics") or {}, (job.get("output") or {}).get("usage") or {}
    parts = [f"{usage['completion_tokens']} tokens"] if usage else []
    for name, label in (("queue_seconds", "queued"), ("inference_seconds", "ran")):
        if metrics.get(name) is not None:
            parts.append(f"{label} {metrics[name]:.2f} s")
    if metrics.get("cache_hit"):
        parts.append("from the result cache")
    return f"{job['id']} {job['status']}: " + ", ".join(parts)


def _wait(client: FleetClient, body: dict, job_id: list[str]) -> dict:
    """Submit and hold the request open; a job still running is followed on its events."""
    job = client.post_json("/v1/jobs", body, headers={"Prefer": f"wait={WAIT_S}"})
    job_id.append(job["id"])
    if job["status"] in ("queued", "running"):
        job = _followed(client, job["id"], _events_after(client, job["id"], "0"), echo=False)
    return job


def _stream(client: FleetClient, body: dict, job_id: list[str], echo: bool) -> dict:
    """Submit with ``stream: true`` and print each token as it comes; the final job."""
    response = client.request("POST", "/v1/jobs", json=body | {"stream": True}, stream=True)
    job_id.append(response.headers["Fleet-Job-Id"])
    return _followed(client, job_id[0], response, echo)


def _events_after(client: FleetClient, job: str, after: str):
    headers = {"Last-Event-ID": after}
    return client.request("GET", f"/v1/jobs/{job}/events", stream=True, headers=headers)


def _followed(client: FleetClient, job: str, response, echo: bool) -> dict:
    """Follow the job's events to ``done`` (the final job), printing the deltas if ``echo``;
    a stream that breaks off is resumed right after its last event."""
    after, ended_line = "0", True
    for attempt in range(RESUMES + 1):
        if attempt:
            response = _events_after(client, job, after)
        for event in client.events(response):
            after = event.id or after
            if event.name == "token" and echo:
                delta = event.json()["delta"]
                sys.stdout.write(delta)
                sys.stdout.flush()
                ended_line = delta.endswith("\n") if delta else ended_line
            elif event.name == "restart" and echo:
                err.print("\n[yellow](its worker died: the text starts again)[/]")
            elif event.name == "done":
                if echo and not ended_line:
                    sys.stdout.write("\n")
                    sys.stdout.flush()
                return event.json()
            elif event.name == "error":
                break
    raise FleetError(f"the stream of job {job} keeps breaking off; read the job at "
                     f"{client.url}/v1/jobs/{job}")  # fmt: skip


@app.command()
def status() -> None:
    """The fleet at a glance: workers, backlog, throughput, latency (reads Redis)."""
    from fleet import status as status_view

    raise typer.Exit(status_view.main())


@app.command(context_settings=PASS_THROUGH, add_help_option=False)
def keys(ctx: typer.Context) -> None:
    """API keys: create, list, revoke (`fleet keys --help`)."""
    from fleet import keys as keys_cli

    raise typer.Exit(keys_cli.main(ctx.args, prog="fleet keys"))


@app.command(context_settings=PASS_THROUGH, add_help_option=False)
def deadletters(ctx: typer.Context) -> None:
    """Dead letters: list, requeue (`fleet deadletters --help`)."""
    from fleet import deadletters as deadletters_cli

    raise typer.Exit(deadletters_cli.main(ctx.args, prog="fleet deadletters"))


def main() -> None:
    try:
        app(prog_name="fleet")
    except FleetError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        sys.exit(1)


if __name__ == "__main__":
    main()
