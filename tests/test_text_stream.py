"""Token streaming: the deltas of a row, joined, are exactly its final Completion text."""

from __future__ import annotations

import random
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer, StoppingCriteriaList

from shared.protocol import JobInput
from workers import demo_model
from workers.decoding import RowSettings, RowStopper
from workers.text_stream import RowText, TokenStreamer
from workers.transformers_engine import TransformersEngine as Engine

Decode = Callable[[list[int]], str]
FFFD = "\ufffd"


def final_text(decode: Decode, ids: list[int], stop: list[str]) -> str:
    """The text Engine._completion gives: the decode, cut at the first stop string."""
    text = decode(ids)
    cuts = [text.find(s) for s in stop if s in text]
    return text[: min(cuts)] if cuts else text


def stream(decode: Decode, ids: list[int], stop: list[str], last: bool = False) -> list[str]:
    """Push the ids one token at a time, then finish; check the invariants on the way."""
    final = final_text(decode, ids, stop)
    row = RowText(decode, stop)
    deltas = []
    for k in range(1, len(ids) + 1):
        deltas.append(row.push(ids[:k], last=last and k == len(ids)))
        assert final.startswith(row.emitted), (row.emitted, final)
    deltas.append(row.finish(final))
    assert "".join(deltas) == final
    assert row.emitted == final
    return deltas


# A byte-level vocabulary where some tokens hold part of a UTF-8 character, and 0 is special.
BYTES = {
    0: b"",
    1: b"a",
    2: b" ",
    3: "中".encode()[:1],
    4: "中".encode()[1:2],
    5: "中".encode()[2:],
    6: "🙂".encode()[:2],
    7: "🙂".encode()[2:],
    8: "é".encode()[:1],
    9: "é".encode()[1:],
    10: b"ST",
    11: b"OP",
    12: b"S",
    13: b"b",
    14: b"\xff",  # never valid UTF-8
}


def byte_decode(ids: list[int]) -> str:
    return b"".join(BYTES[i] for i in ids).decode("utf-8", errors="replace")


def test_partial_utf8_waits_for_the_whole_character():
    ids = [1, 3, 4, 5, 2, 6, 7, 8, 9, 1, 0]
    deltas = stream(byte_decode, ids, [])
    assert FFFD not in "".join(deltas)
    assert "".join(deltas) == "a中 🙂éa"
    # Conservative: after k tokens, exactly the text of the first k-1 tokens is out.
    assert deltas[:-1] == ["", "a", "", "", "中", " ", "", "🙂", "", "é", "a"]


def test_invalid_bytes_are_sent_once_followed():
    deltas = stream(byte_decode, [1, 14, 1, 14, 3], [])
    assert "".join(deltas) == f"a{FFFD}a{FFFD}{FFFD}"
    assert deltas[:-1] == ["", "a", "", f"{FFFD}a", ""]


def merge_decode(ids: list[int]) -> str:
    """Like clean_up_tokenization_spaces and ligatures: a token rewrites the one before."""
    pieces = {1: "Hello", 2: " ", 3: ".", 4: "f", 5: "i", 6: "x", 7: " world"}
    return "".join(pieces[i] for i in ids).replace(" .", ".").replace("fi", "\ufb01")


def test_text_that_the_next_token_rewrites_is_held():
    ids = [1, 2, 3, 6, 4, 5, 6, 2, 7, 2, 3]
    deltas = stream(merge_decode, ids, [])
    assert "".join(deltas) == "Hello.x\ufb01x  world."
    # The all-but-last decode "Hello " is not sent: the "." that follows removes the space.
    assert deltas[2] == "" and deltas[3] == "."


def metaspace_decode(ids: list[int]) -> str:
    """Like SentencePiece: the decode drops the leading space of its first token."""
    pieces = {1: " Hello", 2: " world", 3: "!", 4: " again"}
    text = "".join(pieces[i] for i in ids)
    return text[1:] if text.startswith(" ") else text


def test_window_keeps_spaces_that_a_partial_decode_drops():
    deltas = stream(metaspace_decode, [1, 2, 3, 4, 2, 2, 3], [])
    assert "".join(deltas) == "Hello world! again world world!"
    assert deltas[:3] == ["", "Hello", " world"]


def test_stop_strings_on_fake_bytes():
    # "ST" then "OP": the stop spans two tokens; nothing of it is ever sent.
    assert "".join(stream(byte_decode, [1, 2, 10, 11, 1], ["STOP"])) == "a "
    # "ST" held while it could start "STOP", sent once "b" rules it out.
    deltas = stream(byte_decode, [1, 10, 13, 13, 1], ["STOP"])
    assert deltas[:-1] == ["", "a", "", "STb", "b"]
    # A stop that is a prefix of another; the earliest occurrence wins.
    assert "".join(stream(byte_decode, [1, 12, 10, 11, 1], ["STOP", "SS"])) == "a"
    assert "".join(stream(byte_decode, [10, 11, 1, 1], ["STOP"])) == ""
    # "OP" shows up first, but "aSTOPa", begun earlier, completes later and is the cut.
    assert "".join(stream(byte_decode, [13, 1, 10, 11, 1, 13], ["OP", "aSTOPa"])) == "b"
    assert "".join(stream(byte_decode, [13, 1, 10, 11, 13, 13], ["OP", "aSTOPa"])) == "baST"


def test_last_push_sends_everything_that_is_final():
    row = RowText(byte_decode, ["STOP"])
    assert row.push([1, 10]) == "a"
    assert row.push([1, 10, 3, 4], last=True) == f"ST{FFFD}"  # ends in half a character
    assert row.push([1, 10, 3, 4, 5]) == ""  # ended: later pushes do nothing
    assert row.finish(f"aST{FFFD}") == ""


def test_finish_refuses_a_final_text_that_contradicts_the_stream():
    row = RowText(byte_decode, [])
    row.push([1, 1, 1])
    with pytest.raises(AssertionError):
        row.finish("b")


@pytest.mark.parametrize(
    ("decode", "vocab"),
    [(byte_decode, list(BYTES)), (merge_decode, range(1, 8)), (metaspace_decode, range(1, 5))],
)
def test_random_sequences_on_fake_decoders(decode, vocab):
    rng = random.Random(3)
    for _ in range(500):
        ids = [rng.choice(vocab) for _ in range(rng.randrange(1, 25))]
        text = decode(ids)
        starts = [rng.randrange(len(text)) for _ in range(rng.randrange(3))] if text else []
        stream(decode, ids, [text[i : i + rng.randrange(1, 6)] for i in starts], rng.random() < 0.5)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(demo_model.build())


@pytest.fixture(scope="module")
def decode(tokenizer) -> Decode:
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


TEXTS = [
    "café au lait, naïve façade, Ångström",
    "中文字符和日本語のテキスト",
    "emoji 🙂🚀 mixed 👩‍👩‍👧 with ZWJ and flags 🇫🇷",
    "Ω≈ç√∫ ∑ €100 — “quotes” …",
    "the queue worker runs quickly",
]


@pytest.mark.parametrize("text", TEXTS)
def test_real_tokenizer_never_sends_half_a_character(tokenizer, decode, text):
    ids = tokenizer.encode(text)
    assert any(FFFD in decode([i]) for i in ids) or text.isascii()
    row = RowText(decode, [])
    deltas = []
    for k in range(1, len(ids) + 1):
        deltas.append(row.push(ids[:k]))
        assert row.emitted == decode(ids[: k - 1]).rstrip(FFFD)  # as eager as is safe
    deltas.append(row.finish(text))
    assert not any(FFFD in d for d in deltas)
    assert "".join(deltas) == text
    assert "".join(stream(decode, [*ids, tokenizer.eos_token_id], [], last=True)) == text


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("hello wörld STOPPING here", ["STOP"], "hello wörld "),
        ("a ST b STO c STOP d", ["STOP"], "a ST b STO c "),
        ("STOP at the start", ["STOP"], ""),
        ("x 中文 y 中 z 中文字", ["中文字"], "x 中文 y 中 z "),
        ("emoji 🙂🚀 end", ["🚀", "🙂🚀 e"], "emoji "),  # the earliest start wins
        ("emoji 🙂🚀 end", ["🚀", "🙂🚀 x"], "emoji 🙂"),
        ("one. two.. three", ["..", "three"], "one. two"),
        ("no stop here", ["zzz"], "no stop here"),
    ],
)
def test_real_tokenizer_stop_strings(tokenizer, decode, text, stop, expected):
    ids = tokenizer.encode(text)
    deltas = stream(decode, ids, stop)
    assert "".join(deltas) == expected
    assert not any(FFFD in d for d in deltas)
    assert "".join(stream(decode, ids, stop, last=True)) == expected


def test_a_stop_prefix_that_does_not_complete_is_released(tokenizer, decode):
    text = "a STO b and more words after it"
    ids = tokenizer.encode(text)
    row = RowText(decode, ["STOP"])
    for k in range(1, len(ids) + 1):
        row.push(ids[:k])
    assert row.emitted.startswith("a STO b")  # sent before the end, not only by finish


def test_random_token_sequences_and_stops(tokenizer, decode):
    """Any ids (invalid bytes, specials included) and stops cut from their own text."""
    rng = random.Random(7)
    vocab = len(tokenizer)
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        text = decode(ids)
        stop = []
        for _ in range(rng.randrange(3)):
            if text:
                i = rng.randrange(len(text))
                stop.append(text[i : i + rng.randrange(1, 4)])
        stop += rng.sample(["\ufffd", "a", "the", "zz"], rng.randrange(2))
        stream(decode, ids, stop, last=rng.random() < 0.5)


def completion_text(tokenizer, eos: set[int], ids: list[int], row: RowSettings, outcome) -> str:
    decode = lambda t: tokenizer.decode(t, skip_special_tokens=True)  # noqa: E731
    fake = SimpleNamespace(tokenizer=tokenizer, eos_ids=eos, _decode=decode)
    return Engine._completion(fake, ids, row, outcome, 0).text


def test_streamer_follows_the_stopper_of_each_row(tokenizer, decode):
    """Drive the criteria as transformers does: one column per step, finished rows padded."""
    eos, pad, width = {0, 2}, 0, 3
    texts = ["done é", "ends 中文 at the limit", "until STOP x", "not streamed", "canceled 🙂 here"]
    ids = [tokenizer.encode(t) for t in texts]
    ids[0] += [2, 5, 6]  # an end-of-sequence token, then what a sampler would have said
    rows = [RowSettings(40, 0.0, 1.0, [], None) for _ in texts]
    rows[1].max_new_tokens = len(ids[1]) - 2
    rows[2].stop = ["STOP"]
    cancel_at = 8
    stopper = RowStopper(rows, width, eos, tokenizer.decode)
    stopper.interrupt = lambda i: "canceled" if i == 4 and step >= cancel_at else None
    sent: list[list[str]] = [[] for _ in texts]
    row_texts = [RowText(decode, r.stop) for r in rows]
    row_texts[3] = None
    streamer = TokenStreamer(stopper, width, row_texts, lambda i, d: sent[i].append(d))
    criteria = StoppingCriteriaList([stopper, streamer])
    columns = torch.full((len(texts), width), 7)
    finished = torch.zeros(len(texts), dtype=torch.bool)
    step = 0
    while not finished.all():
        step += 1
        new = [row[step - 1] if step <= len(row) else 9 for row in ids]
        new = torch.tensor(new).masked_fill(finished, pad)
        columns = torch.cat([columns, new[:, None]], dim=1)
        finished |= criteria(columns, None)
        # The streamer stops nothing: exactly the rows the stopper ended are done.
        assert finished.tolist() == [o.reason is not None for o in stopper.outcomes]
    reasons = [o.reason for o in stopper.outcomes]
    assert reasons == ["eos", "length", "stop", "length", "canceled"]
    generated = columns[:, width:].tolist()
    for i, row_text in enumerate(row_texts):
        if row_text is None:
            assert sent[i] == []
            continue
        final = completion_text(tokenizer, eos, generated[i], rows[i], stopper.outcomes[i])
        assert "".join(sent[i]) == final  # whole before generate returns: last=True flush
        assert len(sent[i]) > 2
        assert row_text.finish(final) == ""
    assert "".join(sent[0]) == "done é"
    assert "".join(sent[2]) == "until "


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(str(demo_model.build()), torch.device("cpu"))


def streaming_generate(
    engine: Engine, jobs: list[JobInput], monkeypatch, interrupt=None
) -> tuple[list, list[list[str]], list[str]]:
    """Engine.generate with a TokenStreamer put in as text_stream's docstring says."""
    sent: list[list[str]] = [[] for _ in jobs]
    real = engine.model.generate
    streamers = []

    def generate(*, stopping_criteria, **kwargs):
        stopper = stopping_criteria[0]
        width = kwargs["input_ids"].shape[1]
        decode = lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        texts = [RowText(decode, r.stop) for r in stopper.rows]
        streamers.append(TokenStreamer(stopper, width, texts, lambda i, d: sent[i].append(d)))
        return real(stopping_criteria=[*stopping_criteria, streamers[0]], **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(engine.model, "generate", generate)
        completions = engine.generate(jobs, interrupt=interrupt)
    before_finish = ["".join(s) for s in sent]
    streamers[0].finish([c.text for c in completions])
    return completions, sent, before_finish


def test_engine_streams_each_row_of_a_micro_batch(engine, monkeypatch):
    probe = engine.generate([JobInput(prompt="The queue worker", max_new_tokens=24)])[0].text
    at = next(i for i in range(14, len(probe) - 1) if FFFD not in probe[i : i + 2])
    stop = probe[at : at + 2]
    jobs = [
        JobInput(prompt="Hello", max_new_tokens=6),
        JobInput(prompt="The queue worker", max_new_tokens=24, stop=[stop]),
        JobInput(prompt="Redis job", max_new_tokens=20),
    ]
    completions, sent, before_finish = streaming_generate(engine, jobs, monkeypatch)
    assert [c.finish_reason for c in completions] == ["length", "stop", "length"]
    assert completions[1].text == probe[: probe.find(stop)]  # the streamer stopped nothing
    for c, deltas, early in zip(completions, sent, before_finish, strict=True):
        assert "".join(deltas) == c.text
        assert early == c.text  # each row was flushed when it ended, inside generate
        assert len(deltas) > 2  # step by step, not at the end


def test_engine_streams_an_interrupted_row(engine, monkeypatch):
    calls = [0, 0]

    def interrupt(i: int) -> str | None:
        calls[i] += 1
        return "canceled" if i == 1 and calls[i] > 6 else None

    jobs = [JobInput(prompt="River", max_new_tokens=14), JobInput(prompt="Tree", max_new_tokens=20)]
    completions, sent, _ = streaming_generate(engine, jobs, monkeypatch, interrupt)
    assert completions[1].finish_reason == "canceled"
    assert completions[1].completion_tokens == 7
    for c, deltas in zip(completions, sent, strict=True):
        assert "".join(deltas) == c.text


def test_a_final_eos_is_dropped_even_if_the_decode_keeps_it(tokenizer):
    """Like _completion, the streamer drops the EOS that ended a row, special or not."""
    keep_eos = lambda ids: tokenizer.decode(ids)  # noqa: E731
    eos, width = {2}, 1
    ids = [*tokenizer.encode("abc é"), 2]
    rows = [RowSettings(10, 0.0, 1.0, [], None)]
    stopper = RowStopper(rows, width, eos, keep_eos)
    sent: list[str] = []
    streamer = TokenStreamer(stopper, width, [RowText(keep_eos, [])], lambda _i, d: sent.append(d))
    criteria = StoppingCriteriaList([stopper, streamer])
    for k in range(1, len(ids) + 1):
        criteria(torch.tensor([[5, *ids[:k]]]), None)
    tok = SimpleNamespace(decode=lambda t, **_: keep_eos(t))
    fake = SimpleNamespace(tokenizer=tok, eos_ids=eos, _decode=keep_eos)
    final = Engine._completion(fake, ids, rows[0], stopper.outcomes[0], 0).text
    assert keep_eos(ids).endswith(tokenizer.decode([2])) and final == "abc é"
    assert "".join(sent) == final
