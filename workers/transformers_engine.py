"""The transformers engine: one loaded AWQ model and the ``generate()`` a micro-batch runs
through (ENGINE=transformers).

AWQ checkpoints load through transformers 5, which hands ``quant_method: awq`` to
gptqmodel's kernels (Marlin/GEMM on CUDA, a Torch kernel on CPU). autoawq is archived and
cannot load into transformers 5.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, StoppingCriteria

from shared.protocol import JobInput
from workers.decoding import RowOutcome, RowSampler, RowSettings, RowStopper
from workers.engine import (
    INTERRUPTIONS,
    Completion,
    TextSink,
    check_fits,
    prompt_ids,
    quantization_label,
)
from workers.text_stream import RowText, TokenStreamer

log = logging.getLogger(__name__)


class _StepEnd(StoppingCriteria):
    """Runs after the streamer at every decode step; never stops a row."""

    def __init__(self, sink: TextSink) -> None:
        self.sink = sink

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs):
        self.sink.step()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def pick_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


class TransformersEngine:
    """A model and its tokenizer, loaded once per worker process."""

    continuous = False  # runs whole micro-batches (workers.batcher.MicroBatchLoop)

    def __init__(self, model_path: str, device: torch.device) -> None:
        os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(2, os.cpu_count() or 2)))
        started = time.monotonic()
        self.model_path = model_path
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.tokenizer.padding_side = "left"
        # AWQ kernels want float16 on CUDA; the CPU kernel runs in bfloat16 or float32.
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, device_map={"": str(device)}
        )
        self.model.eval()
        config = self.model.config
        self.max_context = int(getattr(config, "max_position_embeddings", 0) or 32_768)
        gen_config = self.model.generation_config
        eos = (
            gen_config.eos_token_id if gen_config.eos_token_id is not None else config.eos_token_id
        )
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos_ids)
        self.load_seconds = time.monotonic() - started
        log.info("loaded %s on %s in %.1fs", model_path, device, self.load_seconds)

    def describe(self) -> dict[str, object]:
        """What this engine serves, for stats and the model's inspect command."""
        config = self.model.config
        return {
            "engine": "transformers",
            "model_path": self.model_path,
            "architecture": (config.architectures or [config.model_type])[0],
            "device": str(self.device),
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "quantization": quantization_label(config),
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "max_context": self.max_context,
        }

    def memory(self) -> dict[str, int]:
        """GPU memory this process holds, and the device's total (empty on CPU)."""
        if self.device.type != "cuda":
            return {}
        return {
            "gpu_memory_used_bytes": torch.cuda.memory_reserved(self.device),
            "gpu_memory_total_bytes": torch.cuda.get_device_properties(self.device).total_memory,
        }

    def nvml_index(self) -> int | None:
        """The GPU's NVML index (CUDA_VISIBLE_DEVICES renumbers devices for torch only)."""
        if self.device.type != "cuda":
            return None
        index = self.device.index or 0
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
        return int(visible[index]) if index < len(visible) and visible[index].isdigit() else index

    def warm_up(self) -> None:
        """Run one small batch so the first real job does not pay for lazy initialisation."""
        self.generate([JobInput(prompt="Hello", max_new_tokens=2)])

    def prompt_ids(self, job: JobInput) -> list[int]:
        return prompt_ids(self.tokenizer, job)

    def check_fits(self, ids: list[int], job: JobInput) -> None:
        check_fits(ids, job, self.max_context)

    @torch.inference_mode()
    def generate(
        self,
        jobs: list[JobInput],
        prompts: list[list[int]] | None = None,
        interrupt: Callable[[int], str | None] | None = None,
        sink: TextSink | None = None,
    ) -> list[Completion]:
        """Run one micro-batch; each job gets its own limits, stop strings and sampling.

        ``interrupt(i)`` is asked every token; a reason it returns ends row i there (cancel,
        deadline) while the other rows go on. The rows ``sink`` streams get their text sent
        there as it is generated; the deltas of a row that completes add up to its text.
        """
        prompts = prompts or [self.prompt_ids(job) for job in jobs]
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, ids in enumerate(prompts):  # left padding: every row ends at the same column
            input_ids[i, width - len(ids) :] = torch.tensor(ids)
            attention[i, width - len(ids) :] = 1
        rows = [RowSettings(j.max_new_tokens, j.temperature, j.top_p, j.stop, j.seed) for j in jobs]
        stopper = RowStopper(rows, width, self.eos_ids, self.tokenizer.decode)
        if interrupt is not None:
            stopper.interrupt = interrupt
        texts = [
            RowText(self._decode, row.stop) if sink and sink.streams(i) else None
            for i, row in enumerate(rows)
        ]
        criteria: list[StoppingCriteria] = [stopper]
        if sink is not None and any(texts):
            criteria += [TokenStreamer(stopper, width, texts, sink.delta), _StepEnd(sink)]
        out = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention.to(self.device),
            generation_config=GenerationConfig(
                max_new_tokens=max(r.max_new_tokens for r in rows),
                do_sample=False,
                pad_token_id=self.pad_id,
                eos_token_id=sorted(self.eos_ids),
            ),
            logits_processor=[RowSampler(rows, self.device)],
            stopping_criteria=criteria,
        )
        completions = [
            self._completion(out[i, width:].tolist(), rows[i], stopper.outcomes[i], len(prompts[i]))
            for i in range(len(rows))
        ]
        for i, text in enumerate(texts):
            if text is not None and completions[i].finish_reason not in INTERRUPTIONS:
                try:
                    sink.delta(i, text.finish(completions[i].text))  # the held-back rest
                except AssertionError:  # a tokenizer that rewrote text it had settled
                    log.error("row %d: its streamed text is not a prefix of its output", i)
        return completions

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _completion(
        self, generated: list[int], row: RowSettings, outcome: RowOutcome, prompt_tokens: int
    ) -> Completion:
        n = min(outcome.tokens or len(generated), row.max_new_tokens, len(generated))
        tokens = generated[:n]
        finish = "length"
        if outcome.reason in INTERRUPTIONS:
            finish = outcome.reason
        elif tokens and tokens[-1] in self.eos_ids:
            tokens, finish = tokens[:-1], "stop"
        text = self._decode(tokens)
        cuts = [text.find(s) for s in row.stop if s in text]
        if cuts:
            text, finish = text[: min(cuts)], "stop"
        return Completion(text, finish, prompt_tokens, n)
