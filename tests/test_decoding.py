"""Per-row decoding controls, on plain tensors."""

from __future__ import annotations

import torch

from workers.decoding import RowSampler, RowSettings, RowStopper, _top_p


def row(**kw) -> RowSettings:
    return RowSettings(
        **{"max_new_tokens": 5, "temperature": 0.0, "top_p": 1.0, "stop": [], "seed": None} | kw
    )


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = _top_p(probs.clone(), 0.7)
    assert torch.allclose(kept, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)
    assert torch.equal(_top_p(probs.clone(), 0.4) > 0, torch.tensor([True, False, False, False]))


def test_the_least_top_p_and_temperature_sample_the_most_likely_token():
    """Found by tests/test_fuzz.py: top_p 5e-324 and a temperature of 1e-300 are valid
    requests, and made the sampler's probabilities NaN (the job failed)."""
    probs = torch.tensor([0.5, 0.3, 0.2])
    assert torch.equal(_top_p(probs.clone(), 5e-324), torch.tensor([1.0, 0.0, 0.0]))
    scores = torch.tensor([[1.0, 3.0, 2.0], [1.0, 3.0, 2.0]])
    rows = [row(temperature=1.0, top_p=5e-324, seed=1), row(temperature=1e-300, seed=1)]
    out = RowSampler(rows, torch.device("cpu"))(torch.zeros(2, 1, dtype=torch.long), scores)
    assert out.argmax(-1).tolist() == [1, 1]


def test_sampler_leaves_greedy_rows_alone_and_forces_sampled_tokens():
    scores = torch.randn(3, 10)
    original = scores.clone()
    rows = [row(), row(temperature=1.0, seed=1), row(temperature=0.5, seed=2)]
    out = RowSampler(rows, torch.device("cpu"))(torch.zeros(3, 1, dtype=torch.long), scores)
    assert torch.equal(out[0], original[0])
    for i in (1, 2):
        assert (out[i] == 0).sum() == 1 and torch.isinf(out[i]).sum() == 9
    again = RowSampler(rows, torch.device("cpu"))(
        torch.zeros(3, 1, dtype=torch.long), original.clone()
    )
    assert torch.equal(out.argmax(-1), again.argmax(-1))  # same seeds, same tokens


def test_stopper_ends_each_row_for_its_own_reason():
    text = {1: "a", 2: "b", 3: "STOP", 9: "<eos>"}
    stopper = RowStopper(
        [row(max_new_tokens=2), row(max_new_tokens=9, stop=["STOP"]), row(max_new_tokens=9)],
        prompt_len=1,
        eos_ids={9},
        decode=lambda ids: "".join(text.get(i, "?") for i in ids),
    )
    steps = [[1, 1, 1], [2, 3, 9], [1, 1, 1]]
    ids = torch.zeros(3, 1, dtype=torch.long)
    done = None
    for step in steps:
        ids = torch.cat([ids, torch.tensor(step).unsqueeze(1)], dim=1)
        done = stopper(ids, torch.zeros(3, 10))
    assert done.tolist() == [True, True, True]
    assert [(o.reason, o.tokens) for o in stopper.outcomes] == [
        ("length", 2),
        ("stop", 2),
        ("eos", 2),
    ]
