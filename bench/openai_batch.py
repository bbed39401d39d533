"""``python -m bench.openai_batch [--requests N] [--rounds R] [--tokens T]``: the same
batch through the native path and the OpenAI Batch API path.

One fleet (its own Redis, one worker, the gateway). Each round runs N greedy completions
(distinct prompts, T tokens each) twice, once per path, alternating which goes first so
the machine's drift falls on both: the native path is ``POST /v1/batches`` (JSON), polled,
then its JSONL results; the OpenAI path uploads a file, creates the batch, polls it and
downloads its output file, with the ``openai`` SDK. Reported: each run's wall time, the
OpenAI-only steps (upload, create, download), and the throughput ratio OpenAI / native: of
the best runs, of the medians, and the geometric mean of each round's pair (the issue asks
>= 0.95). On a shared machine the runs drift by more than the paths differ: read the
paired ratio, and run enough rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid

import openai
import requests

from bench.fleet import running_fleet

POLL_S = 0.5


def native(base: str, prompts: list[str], tokens: int) -> dict[str, float]:
    began = time.monotonic()
    requests_ = [
        {"custom_id": f"r{i}", "prompt": p, "max_new_tokens": tokens} for i, p in enumerate(prompts)
    ]
    batch = requests.post(base + "/v1/batches", json={"requests": requests_}, timeout=120).json()
    while requests.get(f"{base}/v1/batches/{batch['id']}", timeout=30).json()["status"] != (
        "completed"
    ):
        time.sleep(POLL_S)
    ran = time.monotonic()
    lines = requests.get(f"{base}/v1/batches/{batch['id']}/results", timeout=120).text
    assert len(lines.splitlines()) == len(prompts)
    return {"wall_s": time.monotonic() - began, "download_s": time.monotonic() - ran}


def via_openai(client: openai.OpenAI, model: str, prompts: list[str], tokens: int) -> dict:
    began = time.monotonic()
    lines = [
        json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                    "body": {"model": model, "prompt": p, "max_tokens": tokens, "temperature": 0}})
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    file = client.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
    uploaded = time.monotonic()
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
    )
    created = time.monotonic()
    while (batch := client.batches.retrieve(batch.id)).status != "completed":
        time.sleep(POLL_S)
    ran = time.monotonic()
    out = client.files.content(batch.output_file_id).text
    assert len(out.splitlines()) == len(prompts)
    return {
        "wall_s": time.monotonic() - began,
        "upload_s": uploaded - began,
        "create_s": created - uploaded,
        "download_s": time.monotonic() - ran,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    settings = {"BATCH_MAX_REQUESTS": str(args.requests), "CACHE_ENABLED": "0"}
    runs: dict[str, list[dict]] = {"native": [], "openai": []}
    with running_fleet(settings) as fleet:
        client = openai.OpenAI(base_url=fleet.base_url + "/openai/v1", api_key="-", max_retries=0)
        model = client.models.list().data[0].id
        for r in range(args.rounds):
            for path in ("native", "openai") if r % 2 == 0 else ("openai", "native"):
                tag = uuid.uuid4().hex[:8]
                prompts = [f"Request {i} of {tag}: tell me a story" for i in range(args.requests)]
                if path == "native":
                    run = native(fleet.base_url, prompts, args.tokens)
                else:
                    run = via_openai(client, model, prompts, args.tokens)
                runs[path].append(run)
                print(f"round {r} {path:6}: " + " ".join(f"{k} {v:.3f}" for k, v in run.items()))
    walls = {path: [run["wall_s"] for run in found] for path, found in runs.items()}
    best = {path: min(w) for path, w in walls.items()}
    median = {path: statistics.median(w) for path, w in walls.items()}
    # Each round's two runs are neighbours in time: their ratio leaves the machine's drift out.
    paired = statistics.geometric_mean(
        n / o for n, o in zip(walls["native"], walls["openai"], strict=True)
    )
    print(json.dumps({
        "requests": args.requests, "tokens": args.tokens, "runs": runs,
        "throughput_ratio_best": round(best["native"] / best["openai"], 3),
        "throughput_ratio_median": round(median["native"] / median["openai"], 3),
        "throughput_ratio_paired": round(paired, 3),
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
