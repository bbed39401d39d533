"""API keys on a real fleet (REQUIRE_API_KEYS=1): 401/403, ownership, per-key idempotency,
requests and tokens per minute, the per-key queue cap, the admin routes, the CLI, /metrics'
own token, and the openai SDK with a key."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import openai
import pytest
import redis
import requests

from shared.api_keys import ApiKeyStore
from shared.keys import Keys
from shared.settings import DEMO_MODEL_ID
from tests.conftest import fleet_env, start_fleet

PREFIX = "auth"
MODEL = DEMO_MODEL_ID
METRICS_TOKEN = "metrics-" + uuid.uuid4().hex


class Caller:
    """One API key's view of the fleet, over HTTP."""

    def __init__(self, base_url: str, secret: str | None) -> None:
        self.base_url, self.secret = base_url, secret
        self.http = requests.Session()
        if secret:
            self.http.headers["Authorization"] = f"Bearer {secret}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def get(self, path: str, **kwargs) -> requests.Response:
        return self.http.get(self.url(path), timeout=60, **kwargs)

    def post(self, path: str, body: dict | None = None, **kwargs) -> requests.Response:
        return self.http.post(self.url(path), json=body, timeout=90, **kwargs)

    def submit(self, body: dict, wait: int | None = None, **headers) -> requests.Response:
        if wait:
            headers["Prefer"] = f"wait={wait}"
        return self.post("/v1/jobs", body, headers=headers)

    def wait_done(self, job_id: str, timeout_s: float = 120) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            job = self.get(f"/v1/jobs/{job_id}").json()
            if job["status"] not in ("queued", "running"):
                return job
            time.sleep(0.1)
        raise AssertionError(f"job {job_id} did not end")


@pytest.fixture(scope="module")
def secured(redis_url, demo_model_path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("auth-logs")
    running, worker, gateway = start_fleet(
        redis_url, logs, PREFIX, require_api_keys=1, metrics_token=METRICS_TOKEN,
        cache_enabled=1,
    )  # fmt: skip
    store = ApiKeyStore(redis.Redis.from_url(redis_url, decode_responses=True), Keys(PREFIX), 60)
    running.store, running.logs = store, logs
    yield running
    gateway.stop()
    worker.stop()


def make(fleet, name: str = "team", scopes=("jobs", "batches"), **limits) -> Caller:
    return Caller(fleet.base_url, fleet.store.create(name, scopes, **limits).secret)


def prompt(**fields) -> dict:
    return {"prompt": f"auth {uuid.uuid4().hex}", "max_new_tokens": 4} | fields


def test_no_key_or_a_bad_one_is_a_401_that_says_nothing_about_keys(secured):
    anonymous = Caller(secured.base_url, None)
    missing = anonymous.submit(prompt())
    assert missing.status_code == 401
    assert missing.headers["WWW-Authenticate"] == 'Bearer realm="fleet"'
    assert missing.json()["error"]["code"] == "missing_api_key"
    unknown = Caller(secured.base_url, "fk-" + "x" * 43).submit(prompt())
    assert unknown.status_code == 401
    assert 'error="invalid_token"' in unknown.headers["WWW-Authenticate"]
    revoked = make(secured)
    assert revoked.submit(prompt()).status_code == 202
    secured.store.revoke(secured.store.list()[-1].id)
    after = revoked.submit(prompt())  # the very next request
    assert after.status_code == 401 and after.json() == unknown.json()  # same words
    for path in ("/v1/jobs/job_x", "/v1/models", "/v1/batches/batch_x", "/openai/v1/models"):
        assert anonymous.get(path).status_code == 401, path
    for path in ("/healthz", "/readyz"):
        assert anonymous.get(path).status_code == 200, path


def test_metrics_has_its_own_token(secured):
    assert requests.get(secured.url("/metrics"), timeout=10).status_code == 401
    api_key = make(secured, "not-metrics")
    assert api_key.get("/metrics").status_code == 401  # an API key is not the metrics token
    ok = requests.get(
        secured.url("/metrics"), headers={"Authorization": f"Bearer {METRICS_TOKEN}"}, timeout=10
    )
    assert ok.status_code == 200 and "fleet_jobs_submitted_total" in ok.text


def test_a_key_without_the_scope_gets_403(secured):
    jobs_only = make(secured, "jobs-only", ("jobs",))
    assert jobs_only.submit(prompt()).status_code == 202
    batch = {"requests": [{"custom_id": "a", "prompt": "hi", "max_new_tokens": 2}]}
    refused = jobs_only.post("/v1/batches", batch)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "permission_denied"
    assert "'batches'" in refused.json()["error"]["message"]
    assert jobs_only.get("/v1/admin/keys").status_code == 403
    batches_only = make(secured, "batches-only", ("batches",))
    assert batches_only.submit(prompt()).status_code == 403
    assert batches_only.post("/v1/batches", batch).status_code == 202
    admin = make(secured, "root", ("admin",))
    assert admin.submit(prompt()).status_code == 202
    assert admin.post("/v1/batches", batch).status_code == 202
    assert admin.get("/v1/admin/keys").status_code == 200


def test_what_a_key_made_is_a_404_to_another_key_and_visible_to_admins(secured):
    owner, other = make(secured, "owner"), make(secured, "other")
    admin = make(secured, "admin", ("admin",))
    job = owner.submit(prompt(), wait=60).json()
    assert job["status"] == "succeeded"
    batch = owner.post(
        "/v1/batches", {"requests": [{"custom_id": "a", "prompt": "hi", "max_new_tokens": 2}]}
    ).json()
    owner.get(f"/v1/batches/{batch['id']}")
    batch_job = secured.redis.lrange(Keys(PREFIX).batch_jobs(MODEL, batch["id"]), 0, 0)
    unknown_job = other.get("/v1/jobs/job_00000000000000000000000000")
    for path in (
        f"/v1/jobs/{job['id']}",
        f"/v1/jobs/{job['id']}/events",
        f"/v1/jobs/{job['id']}/webhook_deliveries",
        f"/v1/jobs/{batch_job[0]}",
        f"/v1/batches/{batch['id']}",
        f"/v1/batches/{batch['id']}/results",
        f"/v1/batches/{batch['id']}/webhook_deliveries",
    ):
        theirs = other.get(path)
        assert theirs.status_code == 404, path
        assert owner.get(path).status_code == 200, path
        assert admin.get(path).status_code == 200, path
    assert (
        other.get(f"/v1/jobs/{job['id']}").json()["error"]["code"]
        == (unknown_job.json()["error"]["code"])
    )
    assert other.post(f"/v1/jobs/{job['id']}/cancel").status_code == 404
    assert other.post(f"/v1/batches/{batch['id']}/cancel").status_code == 404


def test_a_key_lists_its_own_recent_jobs_newest_first(secured):
    mine, theirs = make(secured, "lister"), make(secured, "other-lister")
    made = [mine.submit(prompt()).json()["id"] for _ in range(5)]
    theirs.submit(prompt())
    first = mine.get("/v1/jobs", params={"limit": 3}).json()
    assert [job["id"] for job in first["data"]] == made[::-1][:3]
    assert first["has_more"] and first["last_id"] == made[2]
    rest = mine.get("/v1/jobs", params={"limit": 3, "after": first["last_id"]}).json()
    assert [job["id"] for job in rest["data"]] == made[1::-1] and not rest["has_more"]
    assert not set(made) & {job["id"] for job in theirs.get("/v1/jobs").json()["data"]}
    bad = mine.get("/v1/jobs", params={"after": made[0][:-1] + "x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "after"
    assert mine.get("/v1/jobs", params={"limit": 0}).status_code == 422


def test_an_idempotency_key_belongs_to_the_api_key_that_sent_it(secured):
    first, second = make(secured, "idem-a"), make(secured, "idem-b")
    body, same_key = prompt(), {"Idempotency-Key": f"order-{uuid.uuid4().hex}"}
    a = first.submit(body, **same_key)
    b = second.submit(body, **same_key)
    assert a.status_code == b.status_code == 202
    assert a.json()["id"] != b.json()["id"]
    assert "Idempotent-Replayed" not in b.headers
    again = first.submit(body, **same_key)
    assert again.headers["Idempotent-Replayed"] == "true" and again.json()["id"] == a.json()["id"]


def test_a_key_is_answered_only_from_its_own_cached_results(secured):
    first, second = make(secured, "cache-a"), make(secured, "cache-b")
    body = prompt(temperature=0)
    assert first.submit(body, wait=60).headers["Fleet-Cache"] == "miss"
    assert second.submit(body, wait=60).headers["Fleet-Cache"] == "miss"  # CACHE_SCOPE=key
    assert first.submit(body, wait=60).headers["Fleet-Cache"] == "hit"


def test_requests_per_minute_with_ratelimit_headers(secured):
    limited, bystander = make(secured, "rpm", rpm=3), make(secured, "bystander", rpm=3)
    remaining = []
    for _ in range(3):
        ok = limited.get("/v1/models")
        assert ok.status_code == 200
        assert ok.headers["RateLimit-Policy"] == '"requests";q=3;w=60'
        remaining.append(ok.headers["RateLimit"])
    assert [r.split(";")[1] for r in remaining] == ["r=2", "r=1", "r=0"]
    refused = limited.submit(prompt())
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "rate_limited"
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    assert refused.headers["RateLimit"].startswith('"requests";r=0;t=')
    assert bystander.get("/v1/models").status_code == 200  # its own counter


def test_tokens_per_minute_charge_max_new_tokens_and_give_back_the_unused(secured):
    key = make(secured, "tpm", tpm=100)
    too_big = key.submit(prompt(max_new_tokens=101))
    assert too_big.status_code == 429 and "Retry-After" not in too_big.headers
    assert "at all" in too_big.json()["error"]["message"]
    first = key.submit(prompt(max_new_tokens=60))
    assert first.status_code == 202
    assert '"tokens";q=100;w=60' in first.headers["RateLimit-Policy"]
    assert '"tokens";r=40;' in first.headers["RateLimit"]
    refused = key.submit(prompt(max_new_tokens=60))
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limited"
    assert "tokens per minute" in refused.json()["error"]["message"]
    # Once the first job ends, what it did not generate comes back.
    ended = key.wait_done(first.json()["id"])
    generated = ended["output"]["usage"]["completion_tokens"] if ended["output"] else 0
    asked = 100 - 60 + (60 - generated)
    deadline = time.monotonic() + 10
    while (again := key.submit(prompt(max_new_tokens=asked))).status_code == 429:
        assert time.monotonic() < deadline, again.text
        time.sleep(0.3)
    assert again.status_code == 202


def test_a_key_at_its_cap_of_unfinished_jobs_gets_429_and_others_go_on(secured):
    capped, other = make(secured, "capped", max_queued=2), make(secured, "uncapped")
    long = prompt(max_new_tokens=200)
    accepted = [capped.submit(long | {"prompt": f"cap {i} {uuid.uuid4().hex}"}) for i in range(2)]
    assert [r.status_code for r in accepted] == [202, 202]
    full = capped.submit(prompt())
    assert full.status_code == 429 and full.json()["error"]["code"] == "rate_limited"
    assert "2 unfinished jobs" in full.json()["error"]["message"]
    assert full.headers["Retry-After"]
    assert other.submit(prompt()).status_code == 202
    for response in accepted:
        capped.wait_done(response.json()["id"])
    assert capped.submit(prompt()).status_code == 202


def test_admins_manage_keys_and_dead_letters_over_http(secured):
    admin = make(secured, "ops", ("admin",))
    made = admin.post("/v1/admin/keys", {"name": "via-http", "scopes": ["jobs"], "rpm": 50})
    assert made.status_code == 201
    created = made.json()
    assert created["secret"].startswith("fk-") and created["rpm"] == 50
    assert Caller(secured.base_url, created["secret"]).submit(prompt()).status_code == 202
    listed = admin.get("/v1/admin/keys").json()["data"]
    mine = [k for k in listed if k["id"] == created["id"]]
    assert mine and "secret" not in mine[0] and mine[0]["last_used_at"]
    assert created["secret"] not in json.dumps(listed)
    bad = admin.post("/v1/admin/keys", {"name": "x", "scopes": ["root"]})
    assert bad.status_code == 422 and bad.json()["error"]["param"].startswith("scopes")
    assert admin.http.delete(admin.url(f"/v1/admin/keys/{created['id']}")).status_code == 200
    gone = Caller(secured.base_url, created["secret"]).submit(prompt())
    assert gone.status_code == 401
    # A dead letter (as the worker writes one) of a job that ran: re-queued, it runs again.
    job = admin.submit(prompt(), wait=60).json()
    keys = Keys(PREFIX)
    letter = secured.redis.xadd(
        keys.dead_letters(MODEL),
        {"job": job["id"], "entry": "0-1", "deliveries": "4", "at": str(time.time()),
         "lane": "interactive"},
    )  # fmt: skip
    letters = admin.get("/v1/admin/dead_letters").json()["data"]
    assert any(row["id"] == letter and row["job"] == job["id"] for row in letters)
    requeued = admin.post(f"/v1/admin/dead_letters/{letter}/requeue")
    assert requeued.status_code == 200 and requeued.json()["requeued"] is True
    assert admin.wait_done(job["id"])["status"] == "succeeded"
    assert admin.post(f"/v1/admin/dead_letters/{letter}/requeue").status_code == 404
    assert admin.post("/v1/admin/dead_letters/not-an-id/requeue").status_code == 404
    assert make(secured).get("/v1/admin/dead_letters").status_code == 403


def test_the_openai_sdk_with_a_key(secured):
    secret = secured.store.create("sdk", ("jobs",)).secret
    client = openai.OpenAI(base_url=secured.url("/openai/v1"), api_key=secret, max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert reply.choices[0].message.content is not None
    wrong = openai.OpenAI(base_url=secured.url("/openai/v1"), api_key="fk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    batches_only = secured.store.create("sdk-batches", ("batches",)).secret
    denied = openai.OpenAI(base_url=secured.url("/openai/v1"), api_key=batches_only, max_retries=0)
    with pytest.raises(openai.PermissionDeniedError):
        denied.completions.create(model=MODEL, prompt="hi", max_tokens=2)


def test_the_keys_cli_and_no_secret_in_any_log(secured, redis_url):
    env = fleet_env(redis_url, key_prefix=PREFIX)
    run = [sys.executable, "-m", "fleet.keys"]
    made = subprocess.run(
        [*run, "create", "--name", "cli-team", "--scopes", "jobs", "--tpm", "5000"],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    secret = made.stdout.strip()
    assert secret.startswith("fk-") and "\n" not in secret  # stdout is the key alone
    assert "shown once" in made.stderr and secret not in made.stderr
    assert Caller(secured.base_url, secret).submit(prompt()).status_code == 202
    listed = subprocess.run(
        [*run, "list"], env=env, capture_output=True, text=True, timeout=60, check=True
    ).stdout
    rows = [json.loads(line) for line in listed.splitlines()]
    row = next(r for r in rows if r["name"] == "cli-team")
    assert row["scopes"] == ["jobs"] and row["tpm"] == 5000 and secret not in listed
    bad = subprocess.run(
        [*run, "create", "--name", "x", "--scopes", "root"], env=env, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "unknown scope 'root'" in bad.stderr
    revoked = subprocess.run(
        [*run, "revoke", "cli-team"], env=env, capture_output=True, text=True, timeout=60
    )
    assert revoked.returncode == 0 and row["id"] in revoked.stdout
    assert Caller(secured.base_url, secret).submit(prompt()).status_code == 401
    # Neither this key nor the metrics token reached a log.
    for log in secured.logs.iterdir():
        text = log.read_text(errors="replace")
        assert secret not in text and METRICS_TOKEN not in text, log.name


def test_an_admin_drains_a_worker_over_http(secured):
    """Last in this module: it drains the module fleet's only worker."""
    admin = make(secured, "drainer", ("admin",))
    workers = admin.get("/v1/admin/workers").json()["data"]
    assert [w["name"] for w in workers] == [secured.worker] and workers[0]["model"] == MODEL
    live = workers[0]  # as the worker's last heartbeat told it
    assert live["state"] in ("idle", "busy") and float(live["tokens_per_s"]) >= 0
    assert int(live["jobs_succeeded"]) > 0  # the module's earlier tests ran jobs on it
    assert admin.post("/v1/admin/workers/nobody@nowhere/drain").status_code == 404
    assert make(secured).post(f"/v1/admin/workers/{secured.worker}/drain").status_code == 403
    drained = admin.post(f"/v1/admin/workers/{secured.worker}/drain")
    assert drained.status_code == 202 and drained.json()["state"] == "draining"
    deadline = time.monotonic() + 60
    while admin.get("/v1/admin/workers").json()["data"]:  # it left the registry as it exited
        assert time.monotonic() < deadline, "the worker did not drain"
        time.sleep(0.5)
