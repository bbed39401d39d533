"""Every Lua script touches only the keys it declares (or derives from a declared base).

Two checks, on a real Redis running as a one-node Redis Cluster:

* Redis's own: in cluster mode a ``#!lua`` script that touches a key outside the hash
  slot of its KEYS fails ("Script attempted to access keys that do not hash to the same
  slot"), and KEYS that span slots fail (CROSSSLOT). The scenario below runs every script
  through the code that calls it in the fleet, so any such key fails the test.
* Ours, for keys of the same slot that Redis lets through: MONITOR records each command a
  script ran; each key it touched must be in the script's KEYS or start with a model base
  (``P:{m}:``) passed in its ARGV, and be a name :class:`shared.keys.Keys` gives.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import redis

from fleet.processes import Process, free_port, wait_until
from shared import scripts
from shared.batch_store import BatchStore
from shared.cache import CacheWrites
from shared.cache import fingerprint as cache_fingerprint
from shared.dead_letters import DeadLetters
from shared.job_consumer import JobConsumer
from shared.job_store import JobStore
from shared.keys import Keys
from shared.protocol import BatchOptions, BatchRequest, JobInput, Output, Usage
from shared.records import terminal_fields, webhook_fields
from shared.registry import WorkerRegistry
from shared.states import DeliveryState, JobStatus, Lane
from webhooks.store import DeliveryStore

MODEL = "m/odel-1"
_ARG = re.compile(r'"((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|.)")
_CALIBRATION = "#!lua\nreturn redis.call('EXISTS', KEYS[1])"


@pytest.fixture(scope="module")
def cluster_url(tmp_path_factory) -> Iterator[str]:
    """A redis-server in cluster mode that serves every slot itself."""
    port, data = _cluster_port(), tmp_path_factory.mktemp("cluster")
    command = [
        "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data),
        "--save", "", "--appendonly", "no", "--cluster-enabled", "yes",
        "--cluster-config-file", str(data / "nodes.conf"),
    ]  # fmt: skip
    proc = Process("redis-cluster", command, os.environ.copy(), data / "log")
    client = redis.Redis(port=port, decode_responses=True)
    wait_until(lambda: _pings(client), 20, "cluster node did not start", proc)
    client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
    wait_until(lambda: "cluster_state:ok" in client.execute_command("CLUSTER", "INFO"), 20,
               "cluster never became ok", proc)  # fmt: skip
    yield f"redis://127.0.0.1:{port}/0"
    proc.stop()


@pytest.fixture
def cluster_node(cluster_url) -> redis.Redis:
    return redis.Redis.from_url(cluster_url, decode_responses=True)


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free and valid too."""
    for _ in range(100):
        port = free_port()
        if port <= 55535:
            with socket.socket() as bus:
                try:
                    bus.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


@dataclass
class Call:
    """One script run: its sha, KEYS, ARGV and the commands it ran."""

    sha: str
    keys: list[str]
    argv: list[str]
    commands: list[list[str]] = field(default_factory=list)


class ScriptRecorder:
    """MONITOR on its own connection: groups the commands each script ran under its call."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.lines: list[str] = []
        self._monitor = client.monitor()
        self._monitor.__enter__()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        # Whether MONITOR shows a script's commands before or after its EVALSHA line
        # differs between Redis versions: one known script tells.
        client.evalsha(client.script_load(_CALIBRATION), 1, "calibration")

    def _read(self) -> None:
        connection = self._monitor.connection
        while True:
            try:
                line = connection.read_response()
            except (redis.ConnectionError, OSError, ValueError):
                return
            self.lines.append(line if isinstance(line, str) else line.decode())

    def stop(self) -> list[Call]:
        self.client.ping()  # a marker: everything before it was read once it shows
        wait_until(lambda: any('"PING"' in line for line in self.lines[-5:]), 10, "no marker")
        self._monitor.connection.disconnect()
        parsed = [_parse(line) for line in self.lines]
        parsed = [(src, args) for src, args in parsed if src == "lua" or args[:1] == ["EVALSHA"]]
        commands_first = parsed[0][0] == "lua"  # the calibration script's own command
        calls: list[Call] = []
        inner: list[list[str]] = []
        for source, args in parsed:
            if source == "lua":
                (inner if commands_first or not calls else calls[-1].commands).append(args)
                continue
            numkeys = int(args[2])
            call = Call(args[1], args[3 : 3 + numkeys], args[3 + numkeys :])
            if commands_first:
                call.commands, inner = inner, []
            calls.append(call)
        return calls


def _parse(line: str) -> tuple[str, list[str]]:
    """(client kind, args) of a MONITOR line: ``time [db lua] "CMD" "arg" ...``."""
    header, _, rest = line.partition("] ")
    source = "lua" if header.endswith(" lua") else "client"
    return source, [_unescape(arg) for arg in _ARG.findall(rest)]


def _unescape(arg: str) -> str:
    def one(match: re.Match) -> str:
        code = match.group(1)
        if code.startswith("x"):
            return chr(int(code[1:], 16))
        return {"n": "\n", "r": "\r", "t": "\t", "a": "\a", "b": "\b"}.get(code, code)

    return _ESCAPE.sub(one, arg)


def touched_keys(client: redis.Redis, command: list[str]) -> list[str]:
    """The keys a command names, as Redis itself sees them (COMMAND GETKEYS)."""
    try:
        return client.command_getkeys(*command)
    except redis.ResponseError:  # a command without keys (PUBLISH)
        return []


def undeclared(client: redis.Redis, call: Call) -> list[str]:
    """Keys the call touched that are neither in its KEYS nor under a base in its ARGV."""
    bases = [a for a in call.argv if re.fullmatch(r".+:\{[^{}]+\}:", a)]
    return [
        key
        for command in call.commands
        for key in touched_keys(client, command)
        if key not in call.keys and not any(key.startswith(base) for base in bases)
    ]


def _done(text: str = "ok") -> dict[str, str]:
    usage = Usage(prompt_tokens=1, completion_tokens=1)
    output = Output(text=text, finish_reason="length", usage=usage)
    return terminal_fields(status=JobStatus.SUCCEEDED, output=output)


def run_every_script(client: redis.Redis, keys: Keys) -> set[str]:
    """Drive each script through the code that calls it; returns the ids it made."""
    store, consumer = JobStore(client, keys, 60), JobConsumer(client, keys, 60)
    batches, dead = BatchStore(client, keys, 60), DeadLetters(client, keys, 60)
    webhook = webhook_fields("http://127.0.0.1:9/x", ["job.started", "job.completed"])
    webhook["stream"] = "1"  # and its text goes to its token stream
    ids: set[str] = set()
    # submit (with an Idempotency-Key and a webhook), start, finish
    # by an API key with a cap on unfinished jobs, charged tokens it gives back as it ends
    owned = {"owner": "key_t", "queue_cap": 5, "charged_tokens": 64}
    first = store.submit(
        MODEL, JobInput(prompt="a"), {}, idempotency_key="k1", extra=webhook, **owned
    )
    assert store.submit(MODEL, JobInput(prompt="a"), {}, idempotency_key="k1", **owned).replayed
    [entry] = consumer.read_next(MODEL, "w", 10, None)
    [started], _ = consumer.start(MODEL, [entry], "w")
    consumer.append_tokens(MODEL, [(entry.job_id, "o", 0)], cap=100)
    consumer.finish(MODEL, [(entry, _done())], {entry.job_id: ("k", 1)})
    # end_if (cancel a queued job); request_cancel (a running one)
    queued = store.submit(MODEL, JobInput(prompt="b"), {}).job
    store.cancel(MODEL, queued.id)
    running = store.submit(MODEL, JobInput(prompt="c"), {}).job
    entries = consumer.read_next(MODEL, "w", 10, None)
    [now_running], [was_canceled] = consumer.start(MODEL, entries, "w")
    assert was_canceled.job_id == queued.id
    assert store.cancel(MODEL, running.id).cancel_requested
    consumer.drop(MODEL, [was_canceled, now_running.entry])
    ids |= {first.job.id, queued.id, running.id}
    # commit_batch, dead_letter, requeue, cancel_batch; a batch request's end
    options = BatchOptions(webhook="http://127.0.0.1:9/x", webhook_events=["batch.cancelled"])
    requests = [BatchRequest(custom_id=str(i), prompt="p") for i in range(3)]
    batch = batches.create(MODEL, requests, options, idempotency_key="k2").batch
    assert batches.create(MODEL, requests, options, idempotency_key="k2").replayed
    poison, running_request, _ = consumer.read_next(MODEL, "w", 3, None)
    consumer.dead_letter(MODEL, poison, times_delivered=4)
    [letter] = dead.list(MODEL)
    assert dead.requeue(MODEL, letter["id"])
    consumer.start(MODEL, [running_request], "w")
    assert batches.cancel(MODEL, batch.id).status == "cancelling"
    consumer.finish(MODEL, [(running_request, _done())])
    assert batches.get(MODEL, batch.id).status == "cancelled"
    ids |= {batch.id, *client.lrange(keys.batch_jobs(MODEL, batch.id), 0, -1)}
    # the result cache: a leader, a follower that leaves, one that follows to the end, a
    # hit; a leader its client leaves while it is followed; a batch whose lines repeat
    consumer.cache_writes = CacheWrites("v1", 60, 1 << 20)
    registry = WorkerRegistry(client, keys, 60)
    registry.set_model_version(MODEL, "v1")
    greedy = JobInput(prompt="same", temperature=0.0)
    leader = store.submit(MODEL, greedy, {}, cache_owner="", extra={"stream": "1"})
    follower = store.submit(MODEL, greedy, {}, cache_owner="", extra={"stream": "1"})
    leaving = store.submit(MODEL, greedy, {}, cache_owner="")
    assert (leader.cache, follower.cache, leaving.cache) == ("miss", "coalesced", "coalesced")
    store.cancel(MODEL, leaving.job.id)
    consumer.drop(MODEL, consumer.read(MODEL, "w", 10, None, lanes=(Lane.BATCH,)))
    [entry] = consumer.read_next(MODEL, "w", 10, None)
    consumer.start(MODEL, [entry], "w")
    assert store.cancel(MODEL, leader.job.id).status == "canceled"  # goes on for the follower
    consumer.finish(MODEL, [(entry, _done("same"))])
    assert store.get(MODEL, follower.job.id).output.text == "same"
    hit = store.submit(MODEL, greedy, {}, cache_owner="")
    assert hit.cache == "hit" and hit.job.output.text == "same"
    cached = [BatchRequest(custom_id=str(i), prompt=f"q{i % 2}", temperature=0.0)
              for i in range(4)]  # fmt: skip
    repeated = batches.create(MODEL, cached, BatchOptions(), cache_owners=[""] * 4).batch
    entries = consumer.read_next(MODEL, "w", 10, None)
    assert len(entries) == 2
    consumer.start(MODEL, entries, "w")
    consumer.dead_letter(MODEL, entries[0], times_delivered=4)
    consumer.finish(MODEL, [(entries[1], _done())])
    assert batches.get(MODEL, repeated.id).status == "completed"
    ids |= {leader.job.id, follower.job.id, leaving.job.id, hit.job.id, repeated.id,
            *client.lrange(keys.batch_jobs(MODEL, repeated.id), 0, -1)}  # fmt: skip
    fingerprints = [cache_fingerprint(JobInput(prompt=p, temperature=0.0).model_dump_json(
        exclude_none=True), "") for p in ("same", "q0", "q1")]  # fmt: skip
    # the webhook store's scripts
    deliveries = DeliveryStore(client, keys)
    assert deliveries.create("msg_1", "http://127.0.0.1:9/x", "job.completed", "{}", 60, "job_x")
    assert deliveries.claim("msg_1", 1, lease_s=60) is not None
    deliveries.record_attempt("msg_1", {"attempt": 1}, DeliveryState.DELIVERED, None, None, 60)
    assert started.entry.job_id == first.job.id
    return ids | {"msg_1", "job_x"}, fingerprints


def names_keys_gives(keys: Keys, ids: set[str], fingerprints: list[str]) -> set[str]:
    """Every key name :class:`Keys` gives for the scenario's model, ids and requests."""
    per_model = [keys.dead_letters, keys.stats, keys.recent, keys.events, keys.workers,
                 keys.cache_index, keys.model_version]  # fmt: skip
    names = {f(MODEL) for f in per_model} | {
        keys.stream(MODEL, lane) for lane in ("interactive", "batch")
    }
    names |= {keys.idempotency(MODEL, "k1", "key_t"), keys.batch_idempotency(MODEL, "k2"),
              keys.owner_active(MODEL, "key_t"), keys.token_refunds(MODEL),
              keys.jobs_of(MODEL, "key_t"), keys.jobs_of(MODEL, "")}  # fmt: skip
    for one in ids:
        names |= {keys.job(MODEL, one), keys.batch(MODEL, one), keys.batch_jobs(MODEL, one),
                  keys.batch_results(MODEL, one), keys.webhook(one), keys.webhook_owner(one),
                  keys.tokens(MODEL, one),
                  keys.webhook_attempts(one), keys.followers(MODEL, one)}  # fmt: skip
    for fp in fingerprints:
        digest = hashlib.sha1(f"v1 {fp}".encode()).hexdigest()
        names |= {keys.inflight(MODEL, fp), keys.cache(MODEL, digest)}
    return names


def test_every_script_touches_only_keys_it_declares(cluster_node, cluster_url):
    keys = Keys(f"t{time.monotonic_ns()}")
    recorder = ScriptRecorder(redis.Redis.from_url(cluster_url, decode_responses=True))
    ids, fingerprints = run_every_script(cluster_node, keys)
    calls = recorder.stop()
    by_sha = {
        redis.commands.core.Script(cluster_node, scripts.source(n)).sha: n for n in scripts.NAMES
    }
    calls = [c for c in calls if c.sha in by_sha]  # not the calibration
    assert {by_sha[c.sha] for c in calls} == set(scripts.NAMES), "every script ran"
    for call in calls:
        assert not undeclared(cluster_node, call), f"{by_sha[call.sha]}: {call}"
    touched = {k for c in calls for cmd in c.commands for k in touched_keys(cluster_node, cmd)}
    names = names_keys_gives(keys, ids, fingerprints)
    assert touched <= names, touched - names


def test_the_checks_catch_an_undeclared_key(cluster_node, cluster_url):
    """Both checks can fail: another slot is refused by Redis, the same slot by MONITOR."""
    declared = "p:{m}:declared"
    other_slot = cluster_node.register_script("#!lua\nredis.call('SET', 'p:{x}:sneaky', 1)")
    with pytest.raises(redis.ResponseError, match="same slot"):
        other_slot(keys=[declared])
    recorder = ScriptRecorder(redis.Redis.from_url(cluster_url, decode_responses=True))
    same_slot = cluster_node.register_script("#!lua\nredis.call('SET', 'p:{m}:sneaky', 1)")
    same_slot(keys=[declared])
    [call] = [c for c in recorder.stop() if c.sha == same_slot.sha and c.commands]
    assert undeclared(cluster_node, call) == ["p:{m}:sneaky"]
