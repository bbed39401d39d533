"""Throughput of the bare model: ``Engine.generate`` in this process, no queue, no HTTP.

This is the ceiling the fleet is compared against. The same prompts and parameters are
used for the fleet's requests, so the two numbers count the same kind of tokens.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import asdict, dataclass

from shared.protocol import JobInput

MAX_NEW_TOKENS = 32
WARM_UP_S = 5.0  # the first few seconds of generate run up to 30% slower on this machine

# Fixed, distinct prompts: greedy output is then deterministic, and a batch of n gets n
# different rows (identical rows would flatter nothing on CPU, but they would look odd).
PROMPTS = [
    f"The {a} {b} the {c} {d}"
    for a, b, c, d in [
        ("worker", "reads", "queue", "quickly"),
        ("model", "writes", "answer", "again"),
        ("fleet", "keeps", "batch", "together"),
        ("redis", "holds", "stream", "often"),
        ("cat", "finds", "light", "at night"),
        ("river", "runs", "mountain", "alone"),
        ("city", "waits", "sun", "never"),
        ("bird", "sings", "tree", "after the day"),
        ("job", "sends", "prompt", "while"),
        ("token", "opens", "gpu", "fast"),
        ("dog", "learns", "stone", "slow"),
        ("wind", "closes", "water", "always"),
        ("moon", "builds", "fire", "quietly"),
        ("queue", "reads", "worker", "because"),
        ("answer", "keeps", "model", "when"),
        ("stream", "finds", "redis", "together"),
    ]
]


def job_input(index: int) -> JobInput:
    """The benchmark's one kind of request: greedy, MAX_NEW_TOKENS, a fixed prompt."""
    return JobInput(
        prompt=PROMPTS[index % len(PROMPTS)], max_new_tokens=MAX_NEW_TOKENS, temperature=0.0
    )


@dataclass(frozen=True)
class EngineResult:
    batch_size: int
    repeats: int
    tokens_per_batch: int
    best_tokens_per_s: float
    median_tokens_per_s: float
    median_batch_s: float

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def measure_engine(batch_sizes: list[int], repeats: int) -> list[EngineResult]:
    """Load the demo model, warm it up, then time ``repeats`` runs of each batch size.

    The engine is deleted before returning, so its threads and memory are not competing
    with the fleet's worker that is started next (the machine has only a few cores).
    """
    import torch

    from workers import demo_model
    from workers.transformers_engine import TransformersEngine as Engine

    engine = Engine(str(demo_model.build()), torch.device("cpu"))
    try:
        engine.warm_up()
        warm_until = time.monotonic() + WARM_UP_S
        while time.monotonic() < warm_until:
            engine.generate([job_input(0)])
        results = []
        for size in batch_sizes:
            jobs = [job_input(i) for i in range(size)]
            engine.generate(jobs)  # the first run of a new shape pays for allocation
            rates, durations, tokens = [], [], 0
            for _ in range(repeats):
                began = time.perf_counter()
                completions = engine.generate(jobs)
                seconds = time.perf_counter() - began
                tokens = sum(c.completion_tokens for c in completions)
                rates.append(tokens / seconds)
                durations.append(seconds)
            results.append(
                EngineResult(
                    batch_size=size,
                    repeats=repeats,
                    tokens_per_batch=tokens,
                    best_tokens_per_s=max(rates),
                    median_tokens_per_s=statistics.median(rates),
                    median_batch_s=statistics.median(durations),
                )
            )
        return results
    finally:
        del engine
        gc.collect()
