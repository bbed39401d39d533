"""Token streaming: each row's new text, step by step, while a micro-batch generates.

A delta is only sent once no later token can change it, so the deltas of a row, joined,
are exactly the prefix of the row's final ``Completion.text`` streamed so far, and
:meth:`RowText.finish` sends the rest. Three things could otherwise change sent text:

* a token holding only part of a multi-byte UTF-8 character decodes to U+FFFD until the
  rest arrives, so trailing U+FFFD is never sent;
* a decoder may rewrite text at a token boundary (cleanup of ``" ."``, merges), so the
  text of the newest token is held back and only text that the newest token left
  unchanged is sent;
* a stop string cuts the final text at its first occurrence, so text from a stop
  string on is never sent, and a tail that could still grow into a stop string waits.

Wiring into ``Engine.generate`` (``sink(i, delta)`` gets row i's text as it comes)::

    stopper = RowStopper(...)  # as now
    texts = [RowText(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True), r.stop)
             for r in rows]  # None for a row that does not stream
    streamer = TokenStreamer(stopper, width, texts, sink)
    out = self.model.generate(..., stopping_criteria=[stopper, streamer])  # streamer last
    completions = [self._completion(...) for i in range(len(rows))]  # as now
    streamer.finish([c.text for c in completions])  # each row's last delta, if any
    return completions

A row that ends inside generate (limit, end of sequence, stop string, cancel, deadline) is
flushed at that step, so ``finish`` only sends something for a row generate left running;
it raises AssertionError if the streamed text is not a prefix of the final text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import StoppingCriteria

from workers.decoding import RowStopper

REPLACEMENT = "\ufffd"  # what a decode shows for an unfinished UTF-8 character


class RowText:
    """One row's text as safe deltas: sent text is never changed or taken back later.

    Decoding is windowed like vLLM's detokenizer (prefix and read offsets): a step decodes
    only the tokens from ``_prefix`` on (the last settled chunk, kept as context for
    decoders that treat a leading token specially, plus the unsettled tokens), so it
    costs a few tokens, not the whole row: two decodes of the window a step, a third
    when it slides, and a stop-string search over the unsent tail only. The window only
    grows while its text is unsettled (inside a multi-byte character, or a run of invalid
    bytes that ends in U+FFFD); a decoder whose text never settles would make each step
    decode the whole row (quadratic in its length, still fine for a few hundred tokens).
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str]) -> None:
        self._decode = decode
        self._stop = list(stop)
        self._prefix = 0  # the window: tokens from here on are decoded each step
        self._read = 0  # tokens whose whole text is settled
        self._window = ""  # the part of the window's decode already in _text
        self._text = ""  # settled text: no later token changes it
        self._sent = 0  # how much of _text went out (the rest may start a stop string)
        self._done = False

    @property
    def emitted(self) -> str:
        return self._text[: self._sent]

    def push(self, generated_ids: list[int], last: bool = False) -> str:
        """Take all the row's generated ids so far; return the new safe text ("" if none).

        ``last``: no token follows (the row ended), so the newest token, a tail that starts
        a stop string and a trailing U+FFFD need not wait; the ids must then be the ones
        the final text is decoded from (an end-of-sequence token dropped).
        """
        if self._done:
            return ""
        ids = generated_ids
        end = len(ids) if last else len(ids) - 1
        full = self._decode(ids[self._prefix : end])
        if last:  # the final text, an unfinished character (U+FFFD) included
            safe = full
        else:
            safe = _common_prefix(full, self._decode(ids[self._prefix :])).rstrip(REPLACEMENT)
        if safe.startswith(self._window):  # else the decoder rewrote settled text: wait
            self._text += safe[len(self._window) :]
            self._window = safe
            if safe == full and end > self._read:  # all of ids[:end] settled: slide
                self._prefix, self._read = self._read, end
                self._window = self._decode(ids[self._prefix : end])
        self._done = last
        return self._release(last)

    def finish(self, final_text: str) -> str:
        """Return what is left of ``final_text`` (the row's Completion.text) to send."""
        sent = self.emitted
        if not final_text.startswith(sent):
            raise AssertionError(f"streamed {sent!r} is not a prefix of {final_text!r}")
        self._text, self._sent, self._done = final_text, len(final_text), True
        return final_text[len(sent) :]

    def _release(self, last: bool) -> str:
        """Send settled text up to the first stop string and any tail that may start one.

        The final text is cut where the earliest stop string begins, so a stop found here
        is only the cut once no longer one that begins before it can still complete.
        A stop string can only begin in unsent text: sent text holds none, nor ends with
        the beginning of one.
        """
        text, start = self._text, self._sent
        free = len(text) if last else len(text) - _stop_start(text, start, self._stop)
        cut = min((i for s in self._stop if (i := text.find(s, start)) >= 0), default=None)
        if cut is not None and cut <= free:
            free, self._done = cut, True
        self._sent = max(start, free)
        return text[start : self._sent]


def _common_prefix(a: str, b: str) -> str:
    if b.startswith(a):
        return a
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return a[:n]


def _stop_start(text: str, start: int, stops: list[str]) -> int:
    """Length of the longest tail of text[start:] that is a proper prefix of a stop string."""
    room, best = len(text) - start, 0
    for s in stops:
        for k in range(min(len(s) - 1, room), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class TokenStreamer(StoppingCriteria):
    """Streams each row's new text every step; never stops a row itself.

    It must come after ``stopper`` in ``stopping_criteria``: transformers calls every
    criterion each step, in list order (its defaults, then ours), ORing the results, so
    the stopper's outcome of this step is known here. A row that ended this step counts
    only its first ``outcome.tokens`` tokens, less a final end-of-sequence token (as
    ``Engine._completion`` does), and is flushed at once; later steps skip it.

    ``sink(i, delta)`` runs inside the decoding loop: keep it cheap (e.g. a queue put).
    """

    def __init__(
        self,
        stopper: RowStopper,
        width: int,
        rows: list[RowText | None],
        sink: Callable[[int, str], None],
    ) -> None:
        self.stopper = stopper
        self.width = width  # every left-padded prompt ends at this column
        self.rows = rows
        self.sink = sink
        self.ids: list[list[int]] = [[] for _ in rows]
        self.live = [row is not None for row in rows]
        self.seen = 0  # generated columns already read

    def __call__(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor | None, **kwargs
    ) -> torch.BoolTensor:
        if any(self.live):
            new = input_ids[:, self.width + self.seen :].tolist()  # one small copy a step
            for i, row in enumerate(self.rows):
                if row is None or not self.live[i]:
                    continue
                ids = self.ids[i]
                ids.extend(new[i])
                outcome = self.stopper.outcomes[i]
                if outcome.reason is None:
                    delta = row.push(ids)
                else:  # ended this step: HF appended the token that ended it
                    self.live[i] = False
                    n = min(outcome.tokens or len(ids), len(ids))
                    if outcome.reason == "eos":
                        n -= 1
                    delta = row.push(ids[:n], last=True)
                if delta:
                    self.sink(i, delta)
        self.seen = input_ids.shape[1] - self.width
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def finish(self, texts: list[str]) -> None:
        """After generate: send each streaming row's rest of its Completion text."""
        for i, row in enumerate(self.rows):
            if row is not None and (delta := row.finish(texts[i])):
                self.sink(i, delta)
