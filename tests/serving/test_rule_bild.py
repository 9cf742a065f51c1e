"""serving/decoding/bild.py: BiLD fallback predicate and rollback rule (lossy).

Exact tests: the threshold limits of the two policies (serving/decoding/bild.py), a hand-computed rollback,
and the documented use of the generator (one `sample` from the target row at the rollback or bonus position), which
makes "output = target sample" an equality rather than a statistical statement.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from serving.decoding.bild import bild_rollback_index, bild_should_fallback, bild_verify
from serving.decoding.warp import sample


def random_case(rng: np.random.Generator, gamma: int, vocab: int = 6):
    target_probs = torch.tensor(rng.dirichlet(np.full(vocab, 0.5), size=gamma + 1), dtype=torch.float32)
    draft_probs = torch.tensor(rng.dirichlet(np.full(vocab, 0.5), size=gamma), dtype=torch.float32)
    draft_tokens = torch.stack([sample(row, torch.Generator().manual_seed(int(rng.integers(1 << 30))))
                                for row in draft_probs]) if gamma else torch.zeros(0, dtype=torch.long)
    return draft_tokens, draft_probs, target_probs


def test_fallback_predicate():
    row = torch.tensor([0.5, 0.3, 0.2])
    assert not bild_should_fallback(row, 0.5)          # strict: max 0.5 is not < 0.5
    assert bild_should_fallback(row, 0.6)
    assert not bild_should_fallback(row, 0.0)          # 0 never falls back
    rng = np.random.default_rng(0)
    for _ in range(100):
        row = torch.tensor(rng.dirichlet(np.full(8, 0.3)), dtype=torch.float32)
        assert bild_should_fallback(row, 1.0 + 1e-6)  # > 1: always (max prob <= 1)
        assert not bild_should_fallback(row, 0.0)
        top = float(row.max())
        assert bild_should_fallback(row, top + 1e-6) and not bild_should_fallback(row, top)


def test_hand_computed_rollback():
    """threshold 3: rolled back iff target prob < e^-3 = 0.0498."""
    target_at = [0.5, 0.06, 0.04, 0.9]
    target_probs = torch.zeros(5, 3)
    for i, prob in enumerate(target_at):
        target_probs[i] = torch.tensor([prob, (1 - prob) / 2, (1 - prob) / 2])
    target_probs[4] = torch.tensor([0.0, 1.0, 0.0])
    tokens = torch.zeros(4, dtype=torch.long)
    assert bild_rollback_index(tokens, target_probs, 3.0) == 2          # first, even though 3 would pass
    smallest = float(target_probs[2, 0])                                 # 0.04 as stored (fp32)
    assert bild_rollback_index(tokens, target_probs, -math.log(smallest)) == 4   # not > itself: none rolled back
    for seed in range(20):
        result = bild_verify(tokens, torch.full((4, 3), 1 / 3), target_probs, torch.Generator().manual_seed(seed))
        assert result.num_accepted == 2 and result.next_token in (0, 1, 2)
        assert result.next_token == int(sample(target_probs[2], torch.Generator().manual_seed(seed)))


def test_infinite_rollback_keeps_every_draft_token():
    """fallback 0 and rollback inf: pure draft generation plus one bonus target token per step, even when the
    target gives a draft token probability 0."""
    rng = np.random.default_rng(1)
    for seed in range(100):
        draft_tokens, draft_probs, target_probs = random_case(rng, 4)
        target_probs[1, draft_tokens[1]] = 0.0
        assert not any(bild_should_fallback(row, 0.0) for row in draft_probs)
        result = bild_verify(draft_tokens, draft_probs, target_probs, torch.Generator().manual_seed(seed),
                             rollback_threshold=math.inf)
        assert result.num_accepted == 4
        assert result.next_token == int(sample(target_probs[4], torch.Generator().manual_seed(seed)))


def test_zero_rollback_is_target_sampling():
    """Every token with target prob < 1 is rolled back, so the step is one sample of target_probs[0]."""
    rng = np.random.default_rng(2)
    for seed in range(200):
        draft_tokens, draft_probs, target_probs = random_case(rng, 3)
        result = bild_verify(draft_tokens, draft_probs, target_probs, torch.Generator().manual_seed(seed),
                             rollback_threshold=0.0)
        assert result.num_accepted == 0
        assert result.next_token == int(sample(target_probs[0], torch.Generator().manual_seed(seed)))


def test_rollback_matches_a_per_token_loop():
    rng = np.random.default_rng(3)
    seen = set()
    for seed in range(300):
        draft_tokens, draft_probs, target_probs = random_case(rng, 4)
        threshold = float(rng.choice([0.5, 1.0, 2.0, 3.0]))
        expected = 4
        for i in range(4):
            if -math.log(float(target_probs[i, draft_tokens[i]])) > threshold:
                expected = i
                break
        result = bild_verify(draft_tokens, draft_probs, target_probs, torch.Generator().manual_seed(seed),
                             rollback_threshold=threshold)
        assert result.num_accepted == expected
        assert result.next_token == int(sample(target_probs[expected], torch.Generator().manual_seed(seed)))
        seen.add(expected)
    assert seen == set(range(5))


def test_gamma_zero_samples_the_target():
    result = bild_verify(torch.zeros(0, dtype=torch.long), torch.zeros(0, 3), torch.tensor([[0.0, 0.0, 1.0]]))
    assert (result.num_accepted, result.next_token) == (0, 2)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), "3", None])
def test_bad_thresholds(bad):
    with pytest.raises(ValueError, match="rollback_threshold"):
        bild_verify(torch.tensor([0]), torch.full((1, 3), 1 / 3), torch.full((2, 3), 1 / 3), rollback_threshold=bad)
    with pytest.raises(ValueError, match="fallback_threshold"):
        bild_should_fallback(torch.full((3,), 1 / 3), bad)


def test_bad_rows():
    with pytest.raises(ValueError, match=r"\[vocab\]"):
        bild_should_fallback(torch.full((2, 3), 1 / 3), 0.5)
    with pytest.raises(ValueError, match="float"):
        bild_should_fallback(torch.tensor([0, 1]), 0.5)
    with pytest.raises(ValueError, match="draft_probs"):
        bild_verify(torch.tensor([0]), torch.full((2, 3), 1 / 3), torch.full((2, 3), 1 / 3))
