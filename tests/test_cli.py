"""The ``fleet`` command, run as installed (``.venv/bin/fleet``) against a running fleet:
the batch progress bar and Ctrl-C in a pseudo-terminal, ``submit --stream``, the batch
commands by id, errors and their exit codes, FLEET_API_KEY against a gateway that requires
keys, and the operator commands under the one entry point."""

from __future__ import annotations

import fcntl
import json
import os
import re
import struct
import subprocess
import sys
import termios
import threading
import time
import uuid
from pathlib import Path

import pytest
import requests

from fleet import commands
from fleet.processes import Process, free_port, wait_until
from tests.conftest import fleet_env

FLEET = Path(sys.executable).parent / "fleet"  # the console script `make install` puts there
ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")
BATCH_ID = r"batch (batch_[0-9a-f]{32})"


@pytest.fixture(scope="module", autouse=True)
def installed() -> None:
    assert FLEET.exists(), f"{FLEET} is missing: `make install` installs the project"


@pytest.fixture(scope="module")
def env(fleet, redis_url) -> dict[str, str]:
    """The environment of a user's shell pointed at ``fleet`` (and at its Redis, for the
    operator commands)."""
    env = fleet_env(redis_url, key_prefix=fleet.prefix)
    for name in ("FLEET_API_KEY", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "NO_COLOR"):
        env.pop(name, None)
    return env | {"FLEET_URL": fleet.base_url, "TERM": "xterm-256color"}


def run(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(FLEET), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


class Terminal:
    """The command in a pseudo-terminal, as a user at a keyboard runs it: a controlling
    terminal 160 columns wide, so Ctrl-C (``\\x03``) is a SIGINT from the line discipline."""

    def __init__(self, env: dict[str, str], *args: str) -> None:
        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))
        self.proc = subprocess.Popen(
            [str(FLEET), *args], stdin=slave, stdout=slave, stderr=slave, env=env,
            start_new_session=True, preexec_fn=_take_terminal,
        )  # fmt: skip
        os.close(slave)
        self.raw = bytearray()
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: the command exited and closed the terminal
                chunk = b""
            with self.changed:
                self.raw += chunk
                self.changed.notify_all()
            if not chunk:
                return

    @property
    def text(self) -> str:
        return ANSI.sub(b"", bytes(self.raw)).decode("utf-8", "replace")

    def expect(self, pattern: str, timeout_s: float = 30) -> re.Match:
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while not (found := re.search(pattern, self.text)):
                left = deadline - time.monotonic()
                if left <= 0 or not self.reader.is_alive():
                    raise AssertionError(f"{pattern!r} not shown; the terminal:\n{self.text}")
                self.changed.wait(left)
        return found

    def send(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def wait(self, timeout_s: float = 60) -> int:
        code = self.proc.wait(timeout_s)
        self.reader.join(5)
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


def _take_terminal() -> None:
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)  # the new session's controlling terminal


@pytest.fixture
def terminal():
    opened: list[Terminal] = []

    def open_(env: dict[str, str], *args: str) -> Terminal:
        opened.append(Terminal(env, *args))
        return opened[-1]

    yield open_
    for term in opened:
        term.close()


def requests_file(path: Path, count: int, max_new_tokens: int) -> Path:
    tag = uuid.uuid4().hex[:8]
    with path.open("w") as out:
        for i in range(count):
            line = {"custom_id": f"r{i}", "prompt": f"cli {tag} {i}",
                    "max_new_tokens": max_new_tokens}  # fmt: skip
            out.write(json.dumps(line) + "\n")
    return path


def test_batch_run_shows_a_progress_bar_and_writes_every_result(env, terminal, tmp_path):
    file = requests_file(tmp_path / "in.jsonl", 300, 8)
    out = tmp_path / "out.jsonl"
    term = terminal(env, "batch", "run", str(file), "-o", str(out))
    term.expect(BATCH_ID + r" \(native API\): 300 requests")
    term.expect(r"300/300  0 failed .*req/s")
    assert term.wait() == 0, term.text
    assert re.search(r"completed: 300 succeeded, 0 failed, 0 cancelled; results in", term.text)
    assert "ETA" in term.text
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in results) == sorted(f"r{i}" for i in range(300))
    assert {r["status"] for r in results} == {"succeeded"}


def test_ctrl_c_asks_and_cancels_the_batch(fleet, env, terminal, tmp_path):
    file = requests_file(tmp_path / "in.jsonl", 2000, 16)
    out = tmp_path / "out.jsonl"
    term = terminal(env, "batch", "run", str(file), "-o", str(out))
    batch_id = term.expect(BATCH_ID).group(1)
    term.expect(r"[1-9][\d,]*/2,000")  # some requests done: the bar moves
    term.send("\x03")
    term.expect(rf"Cancel batch {batch_id} .*n leaves it running")
    term.send("y\r")
    assert term.wait() == 130, term.text
    assert re.search(rf"batch {batch_id} cancelled: [\d,]+ succeeded", term.text)
    batch = fleet.http.get(fleet.url(f"/v1/batches/{batch_id}"), timeout=10).json()
    assert batch["status"] == "cancelled"
    assert batch["request_counts"]["cancelled"] > 0
    written = out.read_text().splitlines()  # what ended, cancelled requests included
    assert len(written) == 2000


def test_ctrl_c_can_leave_the_batch_running_and_the_id_commands_follow_it(
    fleet, env, terminal, tmp_path
):
    file = requests_file(tmp_path / "in.jsonl", 2000, 16)
    term = terminal(env, "batch", "run", str(file), "-o", str(tmp_path / "out.jsonl"))
    batch_id = term.expect(BATCH_ID).group(1)
    term.expect(r"/2,000")
    term.send("\x03")
    term.expect(r"Cancel batch")
    term.send("n\r")
    assert term.wait() == 130, term.text
    assert f"batch {batch_id} keeps running" in term.text
    assert f"fleet batch results {batch_id}" in term.text
    assert not (tmp_path / "out.jsonl").exists()

    status = run(env, "batch", "status", batch_id)
    assert status.returncode == 0, status.stderr
    assert re.match(rf"{batch_id}  (queued|in_progress)  [\d,]+/2000 done", status.stdout)
    cancelled = run(env, "batch", "cancel", batch_id)
    assert cancelled.returncode == 0, cancelled.stderr
    assert re.match(rf"{batch_id}  (cancelling|cancelled)", cancelled.stdout)
    wait_until(lambda: _ended(fleet, batch_id), 30, f"{batch_id} did not end")
    as_json = json.loads(run(env, "batch", "status", batch_id, "--json").stdout)
    assert as_json["status"] == "cancelled"
    results = run(env, "batch", "results", batch_id)
    assert results.returncode == 0, results.stderr
    assert len(results.stdout.splitlines()) == 2000
    again = run(env, "batch", "cancel", batch_id)
    assert again.returncode == 1
    assert "already cancelled" in again.stderr


def _ended(fleet, batch_id: str) -> bool:
    batch = fleet.http.get(fleet.url(f"/v1/batches/{batch_id}"), timeout=10).json()
    return batch["status"] == "cancelled"


def test_submit_streams_the_text_of_the_job(fleet, env):
    done = run(env, "submit", "Once upon a time", "--stream", "--max-tokens", "16", "-v")
    assert done.returncode == 0, done.stderr
    job_id = re.search(r"(job_[0-9a-f]{32}) succeeded: 16 tokens", done.stderr).group(1)
    job = fleet.get(job_id)
    assert job["stream"] is True
    assert done.stdout == job["output"]["text"] + "\n"

    waited = run(env, "submit", "Once upon a time", "--max-tokens", "4", "--json")
    assert waited.returncode == 0, waited.stderr
    assert json.loads(waited.stdout)["status"] == "succeeded"


def test_errors_say_what_to_do_and_exit_non_zero(env, tmp_path):
    down = run(env | {"FLEET_URL": f"http://127.0.0.1:{free_port()}"}, "submit", "hi")
    assert down.returncode == 1
    assert "cannot reach the fleet" in down.stderr
    assert "make up" in down.stderr

    too_long = run(env, "submit", "hi", "--max-tokens", "100000")
    assert too_long.returncode == 1
    assert "error: 'max_new_tokens': must be at most" in too_long.stderr

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"custom_id": "a", "prompt": "x"}\n{"custom_id": "b"}\n')
    refused = run(env, "batch", "run", str(bad))
    assert refused.returncode == 1
    assert "line 2" in refused.stderr

    unknown = run(env, "batch", "status", "batch_" + "0" * 32)
    assert unknown.returncode == 1
    assert "no batch batch_" in unknown.stderr

    missing = run(env, "batch", "run", str(tmp_path / "missing.jsonl"))
    assert missing.returncode == 2  # usage


def test_openai_format_files_go_through_the_openai_batch_api(fleet, env, tmp_path):
    file = tmp_path / "openai.jsonl"
    with file.open("w") as out:
        for i in range(5):
            body = {"model": "demo/qwen3.5-tiny-awq", "max_tokens": 4,
                    "messages": [{"role": "user", "content": f"hi {i}"}]}  # fmt: skip
            out.write(json.dumps({"custom_id": f"o{i}", "method": "POST",
                                  "url": "/v1/chat/completions", "body": body}) + "\n")  # fmt: skip
    result = tmp_path / "out.jsonl"
    done = run(env, "batch", "run", str(file), "-o", str(result))
    served = fleet.http.get(fleet.url("/openai/v1/files"), timeout=10).status_code == 200
    if not served:  # until the fleet serves OpenAI's Files and Batch API
        assert done.returncode == 1
        assert "OpenAI Files and Batch API" in done.stderr
        return
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in result.read_text().splitlines()]
    assert sorted(line["custom_id"] for line in lines) == [f"o{i}" for i in range(5)]
    assert all(line["response"]["status_code"] == 200 for line in lines)


@pytest.fixture(scope="module")
def secured(fleet, redis_url, tmp_path_factory):
    """A second gateway on the same fleet that requires API keys."""
    port = free_port()
    env = fleet_env(redis_url, key_prefix=fleet.prefix, gateway_port=port, require_api_keys=1)
    log = tmp_path_factory.mktemp("cli-logs") / "gateway.log"
    gateway = Process("gateway", commands.gateway(), env, log)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: _ready(url), 60, "secured gateway did not start", gateway)
    yield url
    gateway.stop()


def _ready(url: str) -> bool:
    try:
        return requests.get(url + "/readyz", timeout=2).status_code == 200
    except requests.ConnectionError:
        return False


def test_fleet_api_key_is_sent_and_a_missing_one_is_explained(env, secured, tmp_path):
    env = env | {"FLEET_URL": secured}
    made = run(env, "keys", "create", "--name", f"cli-{uuid.uuid4().hex[:6]}")
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()

    missing = run(env, "submit", "hi", "--max-tokens", "2")
    assert missing.returncode == 1
    assert "needs an API key: set FLEET_API_KEY" in missing.stderr
    wrong = run(env | {"FLEET_API_KEY": "fk_wrong"}, "submit", "hi")
    assert wrong.returncode == 1
    assert "FLEET_API_KEY was refused" in wrong.stderr

    keyed = env | {"FLEET_API_KEY": key}
    done = run(keyed, "submit", "hi", "--max-tokens", "4")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
    out = tmp_path / "out.jsonl"
    batch = run(keyed, "batch", "run", str(requests_file(tmp_path / "in.jsonl", 20, 2)),
                "-o", str(out))  # fmt: skip
    assert batch.returncode == 0, batch.stderr
    assert len(out.read_text().splitlines()) == 20


def test_operator_commands_under_one_entry_point(env):
    status = run(env, "status")
    assert status.returncode == 0, status.stderr
    assert "workers: " in status.stdout
    letters = run(env, "deadletters", "list")
    assert letters.returncode == 0, letters.stderr
    usage = run(env, "keys", "--help")
    assert usage.returncode == 0
    assert usage.stdout.startswith("usage: fleet keys")
