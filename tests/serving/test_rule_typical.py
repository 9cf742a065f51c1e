"""serving/decoding/typical.py: Medusa typical acceptance (lossy, deterministic).

The rule has no randomness, so every test is exact: hand-computed thresholds, the limits of the two
knobs (serving/decoding/typical.py), greedy equivalence for a one-hot target, and monotonicity in epsilon.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from serving.decoding.typical import typical_thresholds, typical_verify


def random_case(rng: np.random.Generator, gamma: int, vocab: int = 6, zeros: bool = False):
    """Draft tokens drawn from the target rows themselves, so a mix of likely and unlikely tokens."""
    target_probs = torch.tensor(rng.dirichlet(np.full(vocab, 0.5), size=gamma + 1), dtype=torch.float32)
    if zeros:
        target_probs[torch.tensor(rng.random((gamma + 1, vocab)) < 0.3)] = 0.0
        target_probs[:, 0] += 1e-3                              # keep every row non-empty
        target_probs /= target_probs.sum(-1, keepdim=True)
    draft_probs = torch.tensor(rng.dirichlet(np.ones(vocab), size=gamma), dtype=torch.float32)
    draft_tokens = torch.tensor(rng.integers(0, vocab, size=gamma), dtype=torch.long)
    return draft_tokens, draft_probs, target_probs


def test_hand_computed_thresholds():
    """eps binds on a peaked row, alpha * exp(-H) on a flat one (Medusa defaults eps 0.09, alpha 0.3)."""
    peaked = [0.85, 0.05, 0.05, 0.05]
    entropy = -(0.85 * math.log(0.85) + 3 * 0.05 * math.log(0.05))            # 0.5875 nats
    assert 0.3 * math.exp(-entropy) > 0.09                                     # so the bound is eps = 0.09
    flat = [0.25] * 4                                                          # bound 0.3 / 4 = 0.075 < eps
    thresholds = typical_thresholds(torch.tensor([peaked, flat]), 0.09, 0.3)
    torch.testing.assert_close(thresholds, torch.tensor([0.09, 0.075]))

    target_probs = torch.tensor([peaked, flat, peaked, flat])
    draft_probs = torch.full((3, 4), 0.25)
    # 0.85 > 0.09 accept; 0.25 > 0.075 accept; 0.05 < 0.09 reject -> 2 accepted, argmax of row 2
    result = typical_verify(torch.tensor([0, 2, 1]), draft_probs, target_probs)
    assert (result.num_accepted, result.next_token) == (2, 0)


def test_entropy_adaptive_bound_accepts_tokens_of_a_flat_target():
    """On a uniform 32-token row the bound is 0.3 / 32 ~ 0.0094, so a 1/32 token passes although < eps."""
    target_probs = torch.full((2, 32), 1 / 32)
    result = typical_verify(torch.tensor([7]), torch.full((1, 32), 1 / 32), target_probs)
    assert result.num_accepted == 1
    result = typical_verify(torch.tensor([7]), torch.full((1, 32), 1 / 32), target_probs, posterior_alpha=10.0)
    assert result.num_accepted == 0                               # bound min(0.09, 10/32) = 0.09 > 1/32


def test_one_hot_target_is_greedy_decoding():
    """T = 0: accepted = common prefix of draft tokens and target argmaxes, then the target argmax."""
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(200):
        gamma = int(rng.integers(1, 6))
        argmax = torch.tensor(rng.integers(0, 5, size=gamma + 1))
        target_probs = torch.nn.functional.one_hot(argmax, 5).float()
        agree = int(rng.integers(0, gamma + 1))
        draft_tokens = argmax[:gamma].clone()
        if agree < gamma:
            draft_tokens[agree] = (draft_tokens[agree] + 1 + int(rng.integers(0, 4))) % 5
        result = typical_verify(draft_tokens, torch.full((gamma, 5), 0.2), target_probs)
        assert result.num_accepted == agree
        assert result.next_token == int(argmax[agree])
        seen.add(agree)
    assert seen == set(range(6))


def test_zero_thresholds_accept_every_token_the_target_can_emit():
    rng = np.random.default_rng(1)
    stopped_early = 0
    for _ in range(300):
        draft_tokens, draft_probs, target_probs = random_case(rng, 4, zeros=True)
        positive = target_probs[torch.arange(4), draft_tokens] > 0
        expected = int(positive.long().cumprod(0).sum())
        result = typical_verify(draft_tokens, draft_probs, target_probs, posterior_threshold=0.0, posterior_alpha=0.0)
        assert result.num_accepted == expected
        assert result.next_token == int(target_probs[expected].argmax())
        stopped_early += expected < 4
    assert 0 < stopped_early < 300            # the zeros did stop some steps, not all


def test_large_thresholds_accept_nothing():
    """eps >= 1 and alpha >= vocab: the bound is >= 1 (H <= log vocab), even for a token of probability 1."""
    rng = np.random.default_rng(2)
    for _ in range(200):
        draft_tokens, draft_probs, target_probs = random_case(rng, 3)
        target_probs[0] = torch.nn.functional.one_hot(draft_tokens[0], 6).float()   # P(x_0) = 1 exactly
        result = typical_verify(draft_tokens, draft_probs, target_probs, posterior_threshold=1.0, posterior_alpha=6.0)
        assert (result.num_accepted, result.next_token) == (0, int(draft_tokens[0]))


def test_accepted_length_is_non_increasing_in_eps():
    rng = np.random.default_rng(3)
    grid = np.linspace(0.0, 1.0, 41)
    varied = 0
    for _ in range(100):
        draft_tokens, draft_probs, target_probs = random_case(rng, 5)
        lengths = [typical_verify(draft_tokens, draft_probs, target_probs, posterior_threshold=float(eps),
                                  posterior_alpha=1.0).num_accepted for eps in grid]
        assert all(a >= b for a, b in zip(lengths, lengths[1:])), lengths
        varied += lengths[0] != lengths[-1]
    assert varied > 50


def test_no_randomness_is_used():
    rng = np.random.default_rng(4)
    for seed in range(50):
        case = random_case(rng, 4)
        gen = torch.Generator().manual_seed(seed)
        state = gen.get_state()
        assert typical_verify(*case, gen) == typical_verify(*case, torch.Generator().manual_seed(seed + 1)) \
            == typical_verify(*case)
        assert torch.equal(gen.get_state(), state)


def test_gamma_zero_emits_the_target_argmax():
    result = typical_verify(torch.zeros(0, dtype=torch.long), torch.zeros(0, 3), torch.tensor([[0.2, 0.5, 0.3]]))
    assert (result.num_accepted, result.next_token) == (0, 1)


@pytest.mark.parametrize("knobs,match", [
    ({"posterior_threshold": -0.1}, "posterior_threshold"), ({"posterior_alpha": float("nan")}, "posterior_alpha"),
    ({"posterior_alpha": True}, "posterior_alpha"),
])
def test_bad_knobs(knobs, match):
    with pytest.raises(ValueError, match=match):
        typical_verify(torch.tensor([0]), torch.full((1, 3), 1 / 3), torch.full((2, 3), 1 / 3), **knobs)


def test_shape_errors():
    with pytest.raises(ValueError, match="target_probs"):
        typical_verify(torch.tensor([0, 1]), torch.full((2, 3), 1 / 3), torch.full((2, 3), 1 / 3))
    with pytest.raises(ValueError, match="integer"):
        typical_verify(torch.tensor([0.0]), torch.full((1, 3), 1 / 3), torch.full((2, 3), 1 / 3))
