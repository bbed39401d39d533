"""Fuzz the live gateway against its own OpenAPI document with schemathesis.

``st run`` reads /openapi.json from a real fleet and sends what it generates from it over
HTTP: the document's examples, boundary values of every schema (coverage), random valid and
invalid requests (fuzzing), and stateful sequences that follow the document's links (create
a job, then read, cancel, stream it; create a batch, then read it, its results, cancel it).
Every answer must be no 5xx and exactly what the document says: a documented status, its
content type, its schema, its headers (tests/schemathesis_hooks.py adds event streams).

With API keys (shared/api_keys.py) the fleet requires them: the fuzz runs once with a valid
key (all of the above) and once without (every route answers 401, in the documented shape).

The run is bounded for CI: a fixed seed and few examples per operation, max_new_tokens at
most 4 on the fleet so the worker keeps up, a request timeout so that no stream can hang
the run. A failure shows schemathesis' report: each problem with a curl line to reproduce it.
"""

from __future__ import annotations

import base64
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.conftest import ROOT, Fleet, fleet_env, start_fleet

KEYS = (ROOT / "shared" / "api_keys.py").exists()
ST = [sys.executable, "-m", "schemathesis.cli"]  # `st`, from this interpreter
SEED = "20261201"
CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "event_data_conforms",  # tests/schemathesis_hooks.py
)


@pytest.fixture(scope="module")
def fuzz_fleet(redis_url, demo_model_path, tmp_path_factory) -> Iterator[Fleet]:
    """A fleet of its own: tiny generations (MAX_NEW_TOKENS_LIMIT=4) and batches, webhooks
    on (so webhook URLs are checked, and deliveries listed), API keys on where they exist."""
    logs = tmp_path_factory.mktemp("fuzz-logs")
    settings: dict[str, object] = {
        "max_new_tokens_limit": 4,
        "batch_max_requests": 16,
        "webhook_secret": "whsec_" + base64.b64encode(os.urandom(32)).decode(),
    }
    if KEYS:
        settings["require_api_keys"] = 1
    running, worker, gateway = start_fleet(redis_url, logs, "fuzz", **settings)
    running.env = fleet_env(redis_url, key_prefix="fuzz", **settings)
    yield running
    gateway.stop()
    worker.stop()


def st_run(fleet: Fleet, tmp_path: Path, *options: str) -> str:
    """Run ``st run`` on the fleet's document; fail with its report unless all passed."""
    argv = [
        *ST, "run", fleet.url("/openapi.json"),
        "--seed", SEED,
        "--request-timeout", "30",  # an event stream ends with its job: 4 tokens at most
        "--suppress-health-check", "too_slow",
        "--generation-database", "none",
        "--output-sanitize", "false",  # keep max_tokens & co. in the curl lines (a test key)
        "--no-color",
        *options,
    ]  # fmt: skip
    env = os.environ | {"PYTHONPATH": str(ROOT), "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks"}
    done = subprocess.run(
        argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400, check=False
    )
    report = done.stdout + done.stderr
    print(report)  # the whole report, with -s or in the captured output of a failure
    if done.returncode != 0:
        found = re.search(r"^=+ (FAILURES|ERRORS) =+$", report, re.MULTILINE)
        pytest.fail(report[found.start() :] if found else report, pytrace=False)
    return report


def make_key(fleet: Fleet) -> str:
    """An admin key, made with the CLI as an operator makes one."""
    made = subprocess.run(
        [sys.executable, "-m", "fleet.keys", "create", "--name", "fuzz",
         "--scopes", "jobs,batches,admin"],
        env=fleet.env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return made.stdout.strip()


def test_the_document_links_each_create_to_its_object_and_asks_for_a_key(fuzz_fleet):
    spec = requests.get(fuzz_fleet.url("/openapi.json"), timeout=10).json()
    [scheme] = [
        name for name, s in spec["components"]["securitySchemes"].items()
        if s["type"] == "http" and s["scheme"] == "bearer"
    ]  # fmt: skip
    paths = spec["paths"]
    assert not {"/healthz", "/readyz", "/metrics"} & set(paths)
    for path, operations in paths.items():
        for method, operation in operations.items():
            assert [*operation["security"][0]] == [scheme], (method, path)
            assert "401" in operation["responses"], (method, path)
    for create, status, parameter, prefix in (
        ("/v1/jobs", "202", "job_id", "/v1/jobs/{job_id}"),
        ("/v1/batches", "202", "batch_id", "/v1/batches/{batch_id}"),
    ):
        links = paths[create]["post"]["responses"][status]["links"].values()
        linked = {link["operationId"] for link in links}
        by_id = {
            operation["operationId"]
            for path, operations in paths.items() if path.startswith(prefix)
            for operation in operations.values()
        }  # fmt: skip
        assert linked == by_id and len(by_id) == 4, create
        assert all(link["parameters"] == {parameter: "$response.body#/id"} for link in links)


@pytest.mark.timeout(480)
def test_every_answer_conforms_to_the_document(fuzz_fleet, tmp_path):
    """No 5xx, and every answer documented, with a valid key where keys exist; stateful
    runs follow the links from the create operations."""
    auth = ["--header", f"Authorization: Bearer {make_key(fuzz_fleet)}"] if KEYS else []
    report = st_run(
        fuzz_fleet, tmp_path,
        "--checks", ",".join(CHECKS),
        "--max-examples", "25",
        # These could revoke the run's own key or drain its only worker (following a link
        # from GET /v1/admin/keys or /workers): the rest would test nothing but 401s, or
        # wait on jobs that never run.
        "--exclude-name", "DELETE /v1/admin/keys/{key_id}",
        "--exclude-name", "POST /v1/admin/workers/{name}/drain",
        *auth,
    )  # fmt: skip
    # The links are followed: each create operation leads to its by-id operations.
    assert re.search(r"API Links:\s+[1-9]\d* covered", report), report[-3000:]


@pytest.mark.skipif(not KEYS, reason="API keys (shared/api_keys.py) are not there yet")
@pytest.mark.timeout(300)
def test_without_a_key_every_route_is_refused(fuzz_fleet, tmp_path):
    """No key (or a made-up one, from the bearer scheme): 401, WWW-Authenticate, the
    documented error shape, and no 5xx, whatever the request."""
    checks = ("not_a_server_error", "refused_without_a_key", *CHECKS[1:-1])
    st_run(
        fuzz_fleet, tmp_path,
        "--checks", ",".join(checks),
        "--phases", "examples,coverage,fuzzing",  # nothing is created: no links to follow
        "--max-examples", "10",
    )  # fmt: skip
