"""The engine in-process on the real demo AWQ checkpoint: loading, batching, limits."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from shared.protocol import JobInput
from workers.engine import PromptTooLong
from workers.transformers_engine import TransformersEngine as Engine

PROMPTS = ["Hello", "The queue worker runs quickly and the model", "A", "Stream redis job prompt"]


@pytest.fixture(scope="module")
def engine(demo_model_path) -> Engine:
    engine = Engine(str(demo_model_path), torch.device("cpu"))
    engine.warm_up()
    return engine


def test_demo_model_is_a_complete_awq_checkpoint(demo_model_path):
    model, info = AutoModelForCausalLM.from_pretrained(demo_model_path, output_loading_info=True)
    assert not info["missing_keys"], info["missing_keys"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.config.model_type == "qwen3_5_text"
    quant = model.config.quantization_config.to_dict()
    assert quant["quant_method"] == "awq" and quant["bits"] == 4
    quantized = [m for m in model.modules() if type(m).__name__.endswith("AwqLinear")]
    assert len(quantized) > 10


def test_greedy_is_the_same_alone_and_in_a_mixed_batch(engine):
    alone = [engine.generate([JobInput(prompt=p, max_new_tokens=20)])[0] for p in PROMPTS]
    mixed = [JobInput(prompt=p, max_new_tokens=20) for p in PROMPTS] + [
        JobInput(prompt="Cat dog", max_new_tokens=30, temperature=0.9, seed=3),
        JobInput(prompt="Tree", max_new_tokens=3),
        JobInput(prompt="River", max_new_tokens=25, temperature=1.0, top_p=0.3),
    ]
    batched = engine.generate(mixed)
    assert batched[: len(PROMPTS)] == alone
    assert batched[5].completion_tokens == 3
    assert batched[4].completion_tokens <= 30 and batched[6].completion_tokens <= 25


def test_seeded_sampling_repeats_and_seeds_differ(engine):
    def sample(seed):
        return engine.generate(
            [JobInput(prompt="Cat", max_new_tokens=16, temperature=1.0, seed=seed)]
        )[0]

    assert sample(1) == sample(1)
    assert len({sample(s).text for s in range(2, 6)}) > 1


def test_prompt_longer_than_context_is_refused(engine):
    job = JobInput(prompt="x", max_new_tokens=engine.max_context)
    with pytest.raises(PromptTooLong):
        engine.check_fits(engine.prompt_ids(job), job)
