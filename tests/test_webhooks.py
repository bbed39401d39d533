"""Webhook delivery against real processes: Redis, the webhook Celery worker started with
its production argv, and an HTTP receiver on loopback that answers as each test scripts.

Retries are short here (0.5 s steps, 1 s timeout) so the whole file runs in seconds; the
SSRF guard and the retry policy are also tested alone, without any network.
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
import socket
import ssl
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from email.utils import format_datetime
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
import redis
from pydantic import ValidationError
from standardwebhooks import Webhook

from fleet import commands
from fleet.processes import Process, free_port, wait_until
from shared.keys import Keys
from shared.settings import Settings
from shared.states import DeliveryState
from tests.webhook_receiver import Received, Receiver, handler
from webhooks import (
    UnresolvableURLError,
    UnsafeURLError,
    WebhookConfigError,
    check_url,
    delivery,
    enqueue_event,
    ssrf,
    transport,
)
from webhooks.broker import create_app
from webhooks.policy import next_delay, parse_retry_after
from webhooks.store import DeliveryStore

SCHEDULE = "0.5,0.5,0.5"
TIMEOUT_S = 1.0


# --- the webhook workers -----------------------------------------------------------------


def _secret() -> str:
    return "whsec_" + base64.b64encode(os.urandom(32)).decode()


@dataclass
class Fleet:
    settings: Settings  # what the enqueuing side uses
    worker: Process


def _start_worker(redis_url: str, logs: Path, prefix: str, secret: str, allow_private: bool):
    env = os.environ.copy()
    env.update(
        PYTHONPATH=str(commands.ROOT),
        REDIS_URL=redis_url,
        KEY_PREFIX=prefix,
        WEBHOOK_SECRET=secret,
        WEBHOOK_ALLOW_PRIVATE="1" if allow_private else "0",
        WEBHOOK_RETRY_SCHEDULE_S=SCHEDULE,
        WEBHOOK_TIMEOUT_S=str(TIMEOUT_S),
    )
    name = f"{prefix}@localhost"
    log = logs / f"{prefix}.log"
    return name, Process(prefix, commands.webhook_worker(name), env, log)


def _settings(redis_url: str, prefix: str, secret: str, allow_private: bool) -> Settings:
    return Settings(
        redis_url=redis_url,
        key_prefix=prefix,
        webhook_secret=secret,
        webhook_allow_private=allow_private,
        webhook_retry_schedule_s=SCHEDULE,
        webhook_timeout_s=TIMEOUT_S,
    )


def _wait_ready(settings: Settings, name: str, proc: Process) -> None:
    control = create_app(settings).control
    wait_until(
        lambda: bool(control.ping(destination=[name], timeout=0.5)),
        60,
        f"webhook worker {name} did not answer ping",
        proc,
    )


@pytest.fixture(scope="module")
def fleets(redis_url, tmp_path_factory) -> Iterator[tuple[Fleet, Fleet]]:
    """Two webhook workers on their own prefixes: one allows loopback receivers (as tests
    must), one does not (as production does). Started together to share the start-up."""
    logs, run = tmp_path_factory.mktemp("webhook-logs"), uuid.uuid4().hex[:8]
    secret = f"{_secret()} {_secret()}"  # a rotation: new, old
    prefix_open, prefix_strict = f"wh-{run}", f"wh-strict-{run}"
    name_open, open_proc = _start_worker(redis_url, logs, prefix_open, secret, True)
    name_strict, strict_proc = _start_worker(redis_url, logs, prefix_strict, secret, False)
    try:
        # The strict worker's deliveries are enqueued by a side that allows private URLs, so
        # the worker's own check, at delivery time, is what refuses them.
        open_fleet = Fleet(_settings(redis_url, prefix_open, secret, True), open_proc)
        strict_fleet = Fleet(_settings(redis_url, prefix_strict, secret, True), strict_proc)
        _wait_ready(open_fleet.settings, name_open, open_proc)
        _wait_ready(strict_fleet.settings, name_strict, strict_proc)
        yield open_fleet, strict_fleet
    finally:
        open_proc.stop()
        strict_proc.stop()


@pytest.fixture(scope="module")
def fleet(fleets) -> Fleet:
    return fleets[0]


def _wait_ended(fleet: Fleet, delivery_id: str, timeout_s: float = 20) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = delivery(delivery_id, fleet.settings)
        if found and found["state"] != "pending":
            return found
        if not fleet.worker.alive():
            raise AssertionError(f"webhook worker exited\n{fleet.worker.tail()}")
        time.sleep(0.05)
    raise AssertionError(f"{delivery_id} still pending: {found}\n{fleet.worker.tail()}")


def _verify(fleet: Fleet, request: Received) -> dict:
    """The payload, verified with the new secret (and with the old one: the same payload)."""
    new, old = fleet.settings.webhook_secrets
    payload = Webhook(new).verify(request.body, request.headers)
    assert Webhook(old).verify(request.body, request.headers) == payload
    return payload


def _ts(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


# --- end to end --------------------------------------------------------------------------


def test_delivery_is_signed_per_standard_webhooks(fleet, receiver):
    url = receiver.script("/signed", 204)
    delivery_id = enqueue_event(url, "job.succeeded", {"id": "job_1", "n": 2}, fleet.settings)

    done = _wait_ended(fleet, delivery_id)

    assert done["state"] == "delivered", done
    (request,) = receiver.requests("/signed")
    assert request.headers["webhook-id"] == delivery_id
    assert request.headers["Content-Type"] == "application/json"
    signatures = request.headers["webhook-signature"].split(" ")
    assert len(signatures) == 2 and all(s.startswith("v1,") for s in signatures)  # rotation
    assert abs(int(request.headers["webhook-timestamp"]) - time.time()) < 10
    payload = _verify(fleet, request)
    assert payload["type"] == "job.succeeded"
    assert payload["data"] == {"id": "job_1", "n": 2}
    assert abs(_ts(payload["timestamp"]) - time.time()) < 10
    with pytest.raises(Exception, match="signature"):  # any other secret does not verify
        Webhook(_secret()).verify(request.body, request.headers)
    (attempt,) = done["attempts"]
    assert attempt["status"] == 204 and attempt["error"] is None
    assert attempt["next_retry_at"] is None and done["next_retry_at"] is None


def test_failures_are_retried_with_the_same_id_honouring_retry_after(fleet, receiver):
    url = receiver.script("/flaky", 500, (429, {"Retry-After": "1"}, 0.0), 200)
    delivery_id = enqueue_event(url, "batch.completed", {"id": "batch_1"}, fleet.settings)

    done = _wait_ended(fleet, delivery_id)

    assert done["state"] == "delivered", done
    requests = receiver.requests("/flaky")
    assert len(requests) == 3
    assert {r.headers["webhook-id"] for r in requests} == {delivery_id}
    assert len({r.body for r in requests}) == 1  # the same event each time
    for request in requests:
        _verify(fleet, request)  # each attempt is signed anew, and verifies
    assert requests[1].at - requests[0].at >= 0.4  # 0.5 s - 20% jitter
    assert requests[2].at - requests[1].at >= 0.9  # Retry-After: 1 beats 0.5 s
    first, second, third = done["attempts"]
    assert (first["status"], first["error"]) == (500, "HTTP 500")
    assert (second["status"], second["error"]) == (429, "HTTP 429")
    assert (third["status"], third["error"]) == (200, None)
    assert [a["attempt"] for a in done["attempts"]] == [1, 2, 3]
    assert first["next_retry_at"] and second["next_retry_at"]
    assert _ts(second["next_retry_at"]) - _ts(second["at"]) >= 0.99  # ms rounding
    assert third["next_retry_at"] is None


def test_timeout_is_retried(fleet, receiver):
    url = receiver.script("/slow", (200, {}, TIMEOUT_S + 1), 200)
    delivery_id = enqueue_event(url, "job.succeeded", {}, fleet.settings)

    done = _wait_ended(fleet, delivery_id)

    assert done["state"] == "delivered", done
    first, second = done["attempts"]
    assert first["status"] is None and "timed out" in first["error"]
    assert first["duration_ms"] < (TIMEOUT_S + 0.5) * 1000
    assert second["status"] == 200


def test_retries_end_in_failed_when_the_schedule_is_used_up(fleet, receiver):
    url = receiver.script("/down", 503)
    delivery_id = enqueue_event(url, "job.failed", {}, fleet.settings)

    done = _wait_ended(fleet, delivery_id)

    assert done["state"] == "failed", done
    assert [a["status"] for a in done["attempts"]] == [503] * 4  # 1 + 3 retries
    assert done["attempts"][-1]["next_retry_at"] is None
    assert "gave up after 4 attempts" in done["error"]
    assert len(receiver.requests("/down")) == 4


def test_connection_errors_are_retried(fleet):
    url = f"http://127.0.0.1:{free_port()}/closed"  # nothing listens there
    delivery_id = enqueue_event(url, "job.succeeded", {}, fleet.settings)

    done = _wait_ended(fleet, delivery_id)

    assert done["state"] == "failed", done
    assert len(done["attempts"]) == 4
    assert all(a["status"] is None and "refused" in a["error"] for a in done["attempts"])


@pytest.mark.parametrize(
    ("status", "headers", "state"),
    [
        (410, {}, "gone"),
        (404, {}, "failed"),
        (302, {"Location": "/redirect-target"}, "failed"),
    ],
)
def test_no_retry_after_410_other_4xx_or_a_redirect(fleet, receiver, status, headers, state):
    path = f"/final-{status}"
    url = receiver.script(path, (status, headers, 0.0))
    delivery_id = enqueue_event(url, "job.succeeded", {}, fleet.settings)

    done = _wait_ended(fleet, delivery_id)

    assert done["state"] == state, done
    (attempt,) = done["attempts"]
    assert attempt["status"] == status and attempt["next_retry_at"] is None
    time.sleep(1.0)  # a retry, were one scheduled, would come within ~0.6 s
    assert len(receiver.requests(path)) == 1
    assert receiver.requests("/redirect-target") == []
    assert delivery(delivery_id, fleet.settings)["attempts"] == done["attempts"]


def test_private_url_is_refused_at_delivery_time(fleets, receiver):
    _, strict = fleets  # this worker runs with WEBHOOK_ALLOW_PRIVATE off
    url = receiver.script("/private", 200)
    delivery_id = enqueue_event(url, "job.succeeded", {}, strict.settings)

    done = _wait_ended(strict, delivery_id)

    assert done["state"] == "failed", done
    (attempt,) = done["attempts"]
    assert attempt["status"] is None
    assert attempt["error"].startswith("URL refused:") and "loopback" in attempt["error"]
    assert receiver.requests("/private") == []


def test_private_url_is_refused_at_enqueue_time(fleet, receiver):
    settings = fleet.settings.model_copy(update={"webhook_allow_private": False})
    with pytest.raises(UnsafeURLError, match="loopback"):
        enqueue_event(receiver.url("/never"), "job.succeeded", {}, settings)


def test_enqueue_needs_a_secret(fleet):
    settings = fleet.settings.model_copy(update={"webhook_secret": None})
    with pytest.raises(WebhookConfigError):
        enqueue_event("http://127.0.0.1/", "job.succeeded", {}, settings)


def test_each_attempt_is_claimed_once(redis_url):
    """A Celery message delivered twice (restored unacked, duplicated retry) makes one
    request: the second copy of an attempt finds it claimed, or already made."""
    store = DeliveryStore(redis.Redis.from_url(redis_url, decode_responses=True), Keys("wh-c"))
    delivery_id = f"msg_{uuid.uuid4().hex}"
    store.create(delivery_id, "http://example.com/", "t", "{}", ttl_s=60)

    assert store.claim(delivery_id, 2, lease_s=60) is None  # not due yet
    assert store.claim(delivery_id, 1, lease_s=60).url == "http://example.com/"
    assert store.claim(delivery_id, 1, lease_s=60) is None  # running elsewhere
    assert store.claim(delivery_id, 1, lease_s=0) is not None  # its worker died: re-run
    attempt = {"attempt": 1, "status": 500}
    store.record_attempt(
        delivery_id, attempt, DeliveryState.PENDING, time.time() + 5, None, ttl_s=60
    )
    assert store.claim(delivery_id, 1, lease_s=0) is None  # made and recorded
    assert store.claim(delivery_id, 2, lease_s=60) is not None
    store.record_attempt(delivery_id, {"attempt": 2}, DeliveryState.DELIVERED, None, None, ttl_s=60)
    assert store.claim(delivery_id, 3, lease_s=0) is None  # ended


def test_request_goes_to_the_checked_address_without_resolving_again(monkeypatch, receiver):
    """DNS rebinding: the host is resolved once, checked, and that address is used."""
    real = socket.getaddrinfo
    answers = iter(["127.0.0.1"])

    def rebinding(host, port, *args, **kwargs):
        if host != "rebind.example":
            return real(host, port, *args, **kwargs)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (next(answers), port))]

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)  # a second lookup would raise
    target = ssrf.resolve(f"http://rebind.example:{receiver.port}/pinned?x=1", True)
    response = transport.post(target, b"{}", {"Content-Type": "application/json"}, 5)

    assert response.status == 200
    (request,) = receiver.requests("/pinned?x=1")
    assert request.headers["Host"] == f"rebind.example:{receiver.port}"


@pytest.fixture
def tls_receiver(tmp_path) -> Iterator[tuple[int, Path]]:
    """An HTTPS receiver whose self-signed certificate names only ``localhost``."""
    if not shutil.which("openssl"):
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    state = Receiver(0)
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler(state))
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], cert
    server.shutdown()
    server.server_close()


def test_https_verifies_the_url_host_name_while_pinned_to_the_address(monkeypatch, tls_receiver):
    port, cert = tls_receiver
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # trust the test certificate only

    target = ssrf.resolve(f"https://localhost:{port}/tls", allow_private=True)
    assert transport.post(target, b"{}", {}, 5).status == 200

    wrong_name = ssrf.resolve(f"https://127.0.0.1:{port}/tls", allow_private=True)
    with pytest.raises(transport.TransportError, match="CERTIFICATE_VERIFY_FAILED"):
        transport.post(wrong_name, b"{}", {}, 5)


# --- the SSRF guard, without network -----------------------------------------------------

REFUSED = [
    "http://127.0.0.1/hook",
    "http://localhost:8080/hook",
    "http://10.1.2.3/",
    "http://172.16.0.1/",
    "http://192.168.1.10/",
    "http://169.254.10.20/",
    "http://100.64.0.1/",
    "http://0.0.0.0/",
    "http://224.0.0.1/",
    "http://240.0.0.1/",
    "http://[::1]/",
    "http://[fe80::1]/",
    "http://[fc00::1]/",
    "http://[::ffff:10.0.0.1]/",
    "http://[2002:7f00:1::]/",
    "http://[64:ff9b::7f00:1]/",
]
ALWAYS_REFUSED = [
    "http://169.254.169.254/latest/meta-data/",
    "http://[fd00:ec2::254]/",
    "http://[::ffff:169.254.169.254]/",
    "ftp://93.184.215.14/",
    "file:///etc/passwd",
    "gopher://127.0.0.1/",
    "http:///nohost",
    "http://user:pw@93.184.215.14/",
]
ALLOWED = ["http://93.184.215.14/hook", "https://1.1.1.1:8443/x?y=1", "https://[2606:4700::1]/"]


@pytest.mark.parametrize("url", REFUSED)
def test_ssrf_refuses_non_public_addresses_unless_allowed(url):
    with pytest.raises(UnsafeURLError):
        check_url(url, allow_private=False)
    check_url(url, allow_private=True)


@pytest.mark.parametrize("url", ALWAYS_REFUSED)
def test_ssrf_refuses_metadata_and_bad_urls_always(url):
    for allow_private in (False, True):
        with pytest.raises(UnsafeURLError):
            check_url(url, allow_private=allow_private)


@pytest.mark.parametrize("url", ALLOWED)
def test_ssrf_allows_public_addresses(url):
    check_url(url, allow_private=False)


def test_ssrf_refuses_when_any_resolved_address_is_private(monkeypatch):
    def fake(host, port, *args, **kwargs):
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.215.14", port)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.7", port)),
        ]

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    with pytest.raises(UnsafeURLError, match=r"10\.0\.0\.7, a private address"):
        check_url("https://mixed.example/hook", allow_private=False)


def test_ssrf_unresolvable_host_is_refused(monkeypatch):
    def fake(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    with pytest.raises(UnresolvableURLError, match="does not resolve"):
        check_url("https://nowhere.example/", allow_private=True)


# --- the retry policy and settings -------------------------------------------------------


def test_backoff_follows_the_schedule_with_jitter_and_retry_after():
    rng, schedule = random.Random(1), (5.0, 300.0)
    delays = [next_delay(schedule, 1, None, rng) for _ in range(200)]
    assert 4.0 <= min(delays) < 4.5 and 5.5 < max(delays) <= 6.0
    assert 240 <= next_delay(schedule, 2, None, rng) <= 360
    assert next_delay(schedule, 3, None, rng) is None
    assert next_delay(schedule, 1, 120.0, rng) == 120.0  # the larger of the two
    assert next_delay(schedule, 1, 10**9, rng) == 3600.0  # capped (see retry_after_cap_s)
    assert next_delay((), 1, None, rng) is None


def test_retry_after_takes_seconds_or_an_http_date():
    now = time.time()
    assert parse_retry_after("7", now) == 7.0
    in_a_minute = format_datetime(datetime.fromtimestamp(now + 60).astimezone(), usegmt=False)
    assert 58 <= parse_retry_after(in_a_minute, now) <= 61
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now) == 0.0
    assert parse_retry_after("soon", now) is None
    assert parse_retry_after(None, now) is None


def test_webhook_settings_are_validated():
    assert Settings(webhook_retry_schedule_s="5, 300,1800").webhook_retry_schedule_s == (
        5.0,
        300.0,
        1800.0,
    )
    default = Settings().webhook_retry_schedule_s
    assert 80_000 <= sum(default) <= 120_000  # about a day
    one, two = _secret(), _secret()
    assert Settings(webhook_secret=f" {one}, {two} ").webhook_secrets == [one, two]
    assert Settings(webhook_secret=one).webhook_secrets == [one]
    assert Settings(webhook_secret="").webhook_secrets == []
    for bad in ("abc123", "whsec_!!!", "whsec_" + base64.b64encode(b"short").decode(),
                f"{one} whsec_!!!", f"{one} {two} {_secret()}"):  # fmt: skip
        with pytest.raises(ValidationError) as error:
            Settings(webhook_secret=bad)
        assert one not in str(error.value)  # a secret never reaches a message
    with pytest.raises(ValidationError):
        Settings(webhook_retry_schedule_s="5,-1")


def test_webhook_worker_imports_no_torch():
    code = "import sys, webhooks.celery_app; assert 'torch' not in sys.modules"
    env = os.environ | {"PYTHONPATH": str(commands.ROOT)}
    subprocess.run([commands.PYTHON, "-c", code], check=True, env=env, timeout=60)
    argv = commands.webhook_worker("w@h")
    assert "--queues=webhooks" in argv and "--pool=threads" in argv
    assert json.dumps(argv).count("workers.celery_app") == 0
