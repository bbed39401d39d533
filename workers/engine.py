"""What every engine shares: the completion it returns, prompt building, context checks, and
which engine a worker runs (ENGINE).

Two engines serve the same jobs:

- ``transformers`` (:mod:`workers.transformers_engine`): micro-batches, one ``generate()``
  each, run by :class:`workers.batcher.MicroBatchLoop`; any machine, .venv;
- ``vllm`` (:mod:`workers.vllm_engine`): vLLM's engine, fed one decode step at a time by
  :class:`workers.continuous.ContinuousLoop` (continuous batching); .venv-vllm, which pins
  vLLM's own torch and transformers.

Neither module is imported here: each needs its own environment.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Protocol

from shared.protocol import JobInput

INTERRUPTIONS = ("canceled", "expired")


class PromptTooLong(ValueError):
    """The prompt plus max_new_tokens does not fit the model's context."""


class TextSink(Protocol):
    """Where the rows that stream send their text as it is generated."""

    def streams(self, row: int) -> bool: ...
    def delta(self, row: int, text: str) -> None: ...
    def step(self) -> None: ...  # a decode step ended: send what it produced


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str  # "stop" or "length"; "canceled" or "expired" if interrupted
    prompt_tokens: int
    completion_tokens: int


def choose_engine(setting: str) -> str:
    """ENGINE=auto is vllm where vLLM is installed (this process runs in .venv-vllm or a
    vLLM image) and a GPU is present; transformers otherwise."""
    if setting != "auto":
        return setting
    if importlib.util.find_spec("vllm") is None:
        return "transformers"
    import torch

    return "vllm" if torch.cuda.is_available() else "transformers"


def prompt_ids(tokenizer: Any, job: JobInput) -> list[int]:
    """The job's prompt as token ids: its messages through the chat template, or its text."""
    if job.messages is not None:
        text = tokenizer.apply_chat_template(
            [m.model_dump() for m in job.messages], add_generation_prompt=True, tokenize=False
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(job.prompt)["input_ids"]


def check_fits(ids: list[int], job: JobInput, max_context: int) -> None:
    if len(ids) + job.max_new_tokens > max_context:
        raise PromptTooLong(
            f"prompt has {len(ids)} tokens; with max_new_tokens={job.max_new_tokens} "
            f"that exceeds the model's context of {max_context} tokens"
        )


def quantization_label(config: Any) -> str:
    """E.g. "awq 4-bit g128"; "none" for an unquantized checkpoint."""
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return "none"
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    method = getattr(quant.get("quant_method"), "value", quant.get("quant_method"))
    return f"{method} {quant.get('bits', '?')}-bit g{quant.get('group_size', '?')}"


class Engine(Protocol):
    """What the worker's loops and liveness ask of either engine."""

    continuous: bool  # True: per-step scheduling (ContinuousLoop); False: micro-batches
    load_seconds: float

    def describe(self) -> dict[str, object]: ...
    def memory(self) -> dict[str, int]: ...
    def nvml_index(self) -> int | None: ...
    def warm_up(self) -> None: ...
    def prompt_ids(self, job: JobInput) -> list[int]: ...
    def check_fits(self, ids: list[int], job: JobInput) -> None: ...
