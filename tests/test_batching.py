"""Mixed micro-batches through the real fleet: each job gets exactly what it asked for."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor


def _clean_stop(text: str) -> str:
    """A 3-character piece from the middle of text, free of partial UTF-8 characters."""
    for start in range(len(text) // 3, len(text) - 3):
        piece = text[start : start + 3]
        if "\ufffd" not in piece and piece.strip() == piece and piece:
            return piece
    raise AssertionError(f"no usable stop string in {text!r}")


def test_mixed_batch_gives_each_job_its_own_settings(fleet):
    greedy = {"prompt": "Water and fire", "max_new_tokens": 6}
    long_greedy = {"prompt": "The fleet reads a stream", "max_new_tokens": 24}
    seeded = {"prompt": "Cat dog bird", "max_new_tokens": 10, "temperature": 0.8, "seed": 7}
    nucleus = {"prompt": "Sun moon", "max_new_tokens": 8, "temperature": 1.0, "top_p": 0.5}

    # References, each run alone.
    alone = {name: fleet.run(body) for name, body in
             [("greedy", greedy), ("long", long_greedy), ("seeded", seeded)]}  # fmt: skip
    assert all(j["metrics"]["batch_size"] == 1 for j in alone.values())
    stop = _clean_stop(alone["long"]["output"]["text"])
    stopped = dict(long_greedy, stop=[stop])

    # A blocker keeps the worker busy while the mixed jobs queue up behind it, so they are
    # read as one micro-batch.
    blocker = fleet.submit({"prompt": "Blocker", "max_new_tokens": 150}).json()
    while fleet.get(blocker["id"])["status"] == "queued":
        time.sleep(0.01)
    bodies = {"greedy": greedy, "stopped": stopped, "seeded": seeded, "nucleus": nucleus,
              "long": long_greedy}  # fmt: skip
    with ThreadPoolExecutor(len(bodies)) as pool:
        ids = dict(
            zip(
                bodies,
                pool.map(lambda b: fleet.submit(b).json()["id"], bodies.values()),
                strict=True,
            )
        )
    fleet.wait_done(blocker["id"])
    done = {name: fleet.wait_done(job_id) for name, job_id in ids.items()}

    assert all(j["status"] == "succeeded" for j in done.values()), done
    assert {j["started_at"] for j in done.values()} == {done["greedy"]["started_at"]}
    assert all(j["metrics"]["batch_size"] == len(bodies) for j in done.values())

    # Greedy output is token-for-token the same alone and inside the mixed batch.
    for name in ("greedy", "long"):
        assert done[name]["output"] == alone[name]["output"], name
    # Seeded sampling is reproducible, whatever else is in the batch.
    assert done["seeded"]["output"] == alone["seeded"]["output"]
    # The stop string ends its job early and is not returned.
    ref_text = alone["long"]["output"]["text"]
    assert done["stopped"]["output"]["text"] == ref_text[: ref_text.index(stop)]
    assert done["stopped"]["output"]["finish_reason"] == "stop"
    assert done["stopped"]["output"]["usage"]["completion_tokens"] < 24
    # Limits are per job.
    for name, body in bodies.items():
        usage = done[name]["output"]["usage"]
        assert usage["completion_tokens"] <= body["max_new_tokens"]
        if done[name]["output"]["finish_reason"] == "length":
            assert usage["completion_tokens"] == body["max_new_tokens"]
