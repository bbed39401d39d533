"""Per-row decoding controls, so one ``generate`` call can serve a mixed micro-batch.

``transformers.generate`` applies one sampling setting to a whole batch. We run it in greedy
mode and let :class:`RowSampler` pick the token of each sampling row itself (its own
temperature, top_p and seeded generator); greedy rows are left untouched, so their output
is the same as when they run alone. :class:`RowStopper` ends each row at its own
``max_new_tokens``, end-of-sequence token or stop string.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessor, StoppingCriteria

# A lower temperature samples as greedy, as vLLM's does: dividing the logits by it would
# overflow them to inf, and the softmax to NaN.
GREEDY_BELOW = 1e-5


@dataclass
class RowSettings:
    max_new_tokens: int
    temperature: float
    top_p: float
    stop: list[str]
    seed: int | None


class RowSampler(LogitsProcessor):
    """Samples the next token of each non-greedy row and forces greedy search to pick it."""

    def __init__(self, rows: list[RowSettings], device: torch.device) -> None:
        self.rows = rows
        self.generators: dict[int, torch.Generator] = {}
        for i, row in enumerate(rows):
            if row.temperature >= GREEDY_BELOW:
                gen = torch.Generator(device=device)
                if row.seed is None:
                    gen.seed()
                else:
                    gen.manual_seed(row.seed)
                self.generators[i] = gen

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for i, gen in self.generators.items():
            row = self.rows[i]
            probs = torch.softmax(scores[i].float() / row.temperature, dim=-1)
            if row.top_p < 1.0:
                probs = _top_p(probs, row.top_p)
            token = torch.multinomial(probs, 1, generator=gen)
            forced = torch.full_like(scores[i], float("-inf"))
            forced[token] = 0.0
            scores[i] = forced
        return scores


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p: at least the
    most likely one, whatever top_p (one below float32's least is 0.0 on the tensor)."""
    sorted_probs, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    dropped = before >= top_p
    dropped[0] = False
    sorted_probs[dropped] = 0.0
    kept = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return kept / kept.sum()


@dataclass
class RowOutcome:
    """Why and after how many generated tokens a row ended (None: still running)."""

    tokens: int | None = None
    reason: str | None = None


@dataclass
class RowStopper(StoppingCriteria):
    """Ends each row at its own limit, end-of-sequence token or stop string."""

    rows: list[RowSettings]
    prompt_len: int
    eos_ids: set[int]
    decode: Callable[[list[int]], str]
    # Asked every token: a reason to stop row i now ("canceled", "expired") or None.
    interrupt: Callable[[int], str | None] = lambda _i: None
    outcomes: list[RowOutcome] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.outcomes = [RowOutcome() for _ in self.rows]

    def __call__(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs
    ) -> torch.BoolTensor:
        generated = input_ids.shape[1] - self.prompt_len
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for i, row in enumerate(self.rows):
            outcome = self.outcomes[i]
            if outcome.reason is None:
                reason = self._check(i, row, input_ids[i], generated)
                if reason is not None:
                    outcome.tokens, outcome.reason = generated, reason
            done[i] = outcome.reason is not None
        return done

    def _check(self, i: int, row: RowSettings, ids: torch.Tensor, generated: int) -> str | None:
        reason = self.interrupt(i)
        if reason is not None:
            return reason
        if int(ids[-1]) in self.eos_ids:
            return "eos"
        if row.stop:
            # A stop string of n characters spans at most 4n byte-level tokens.
            window = 4 * max(len(s) for s in row.stop) + 4
            tail = self.decode(ids[max(self.prompt_len, ids.shape[0] - window) :].tolist())
            if any(s in tail for s in row.stop):
                return "stop"
        if generated >= row.max_new_tokens:
            return "length"
        return None
