"""Every bad input gets a 4xx JSON error that says what is wrong, and writes nothing."""

from __future__ import annotations

import json

import pytest

from shared.keys import Keys

GOOD = {"prompt": "Hello"}


def _job_keys(fleet) -> int:
    return len(fleet.redis.keys(Keys(fleet.prefix).job("*", "*")))


def _stream_entries(fleet) -> int:
    return sum(fleet.redis.xlen(k) for k in fleet.redis.keys(Keys(fleet.prefix).stream("*")))


BAD_BODIES = [
    ("malformed json", "{bad", 400, "invalid_json", "not valid JSON"),
    ("not an object", "[1, 2]", 400, "invalid_json", "JSON object"),
    ("NaN", '{"prompt": "x", "temperature": NaN}', 400, "invalid_json", "NaN"),
    ("neither prompt nor messages", "{}", 422, "invalid_request", "exactly one of"),
    (
        "both prompt and messages",
        json.dumps({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}),
        422,
        "invalid_request",
        "exactly one of",
    ),
    ("prompt wrong type", '{"prompt": 5}', 422, "invalid_request", "'prompt'"),
    ("string for int", '{"prompt": "x", "max_new_tokens": "5"}', 422, "invalid_request", "'max_new_tokens'"),
    ("bool for float", '{"prompt": "x", "temperature": true}', 422, "invalid_request", "'temperature'"),
    ("max_new_tokens over limit", '{"prompt": "x", "max_new_tokens": 99999}', 422, "invalid_request", "MAX_NEW_TOKENS_LIMIT"),
    ("max_new_tokens zero", '{"prompt": "x", "max_new_tokens": 0}', 422, "invalid_request", "'max_new_tokens'"),
    ("temperature negative", '{"prompt": "x", "temperature": -1}', 422, "invalid_request", "'temperature'"),
    ("top_p zero", '{"prompt": "x", "top_p": 0}', 422, "invalid_request", "'top_p'"),
    ("too many stops", json.dumps({"prompt": "x", "stop": list("abcde")}), 422, "invalid_request", "'stop'"),
    ("empty stop", json.dumps({"prompt": "x", "stop": [""]}), 422, "invalid_request", "'stop.0'"),
    ("negative seed", '{"prompt": "x", "seed": -1}', 422, "invalid_request", "'seed'"),
    ("unknown field", '{"prompt": "x", "max_tokens": 5}', 422, "invalid_request", "'max_tokens'"),
    ("metadata value not string", '{"prompt": "x", "metadata": {"a": 1}}', 422, "invalid_request", "'metadata.a'"),
    ("bad role", json.dumps({"messages": [{"role": "robot", "content": "y"}]}), 422, "invalid_request", "'messages.0.role'"),
    ("empty messages", '{"messages": []}', 422, "invalid_request", "'messages'"),
    ("unknown model", '{"prompt": "x", "model": "no/such-model"}', 422, "model_not_found", "no/such-model"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("body", "status", "code", "says"),
    [case[1:] for case in BAD_BODIES],
    ids=[case[0] for case in BAD_BODIES],
)
def test_bad_body_is_rejected_with_a_clear_error(fleet, body, status, code, says):
    before = (_job_keys(fleet), _stream_entries(fleet))
    response = fleet.http.post(
        fleet.url("/v1/jobs"), data=body, headers={"Content-Type": "application/json"}, timeout=10
    )
    assert response.status_code == status, response.text
    assert response.headers["Content-Type"] == "application/json"
    error = response.json()["error"]
    assert error["code"] == code
    assert says in error["message"]
    assert (_job_keys(fleet), _stream_entries(fleet)) == before


def test_wrong_content_type_is_415(fleet):
    response = fleet.http.post(fleet.url("/v1/jobs"), data="prompt=x", timeout=10)
    assert response.status_code == 415
    assert response.json()["error"]["code"] == "unsupported_media_type"


def test_oversized_body_is_413(fleet):
    body = json.dumps({"prompt": "a" * 2_000_000})
    response = fleet.http.post(
        fleet.url("/v1/jobs"), data=body, headers={"Content-Type": "application/json"}, timeout=30
    )
    assert response.status_code == 413
    assert "MAX_REQUEST_BYTES" in response.json()["error"]["message"]


def test_unknown_job_is_404(fleet):
    for job_id in ("job_" + "0" * 32, "nonsense", "job_../../etc"):
        response = fleet.http.get(fleet.url(f"/v1/jobs/{job_id}"), timeout=10)
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "job_not_found"


def test_unknown_route_and_method_are_json(fleet):
    assert (
        fleet.http.get(fleet.url("/v2/nothing"), timeout=10).json()["error"]["code"] == "not_found"
    )
    response = fleet.http.delete(fleet.url("/v1/jobs"), timeout=10)
    assert response.status_code == 405
    assert response.json()["error"]["code"] == "method_not_allowed"
    assert "POST" in response.headers["Allow"]


@pytest.mark.parametrize("prefer", ["wait=0", "wait=61", "wait=abc", "wait=-1"])
def test_bad_prefer_wait_is_400(fleet, prefer):
    before = _job_keys(fleet)
    response = fleet.http.post(
        fleet.url("/v1/jobs"), json=GOOD, headers={"Prefer": prefer}, timeout=10
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_header"
    assert _job_keys(fleet) == before
