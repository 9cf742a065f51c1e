"""serving/decoding/mjsd.py: MJSD verification (longest prefix whose joint ratio passes tau) and the
draft's beam sampler (distinct (beam, token) pairs without replacement, proportional to exp(joint log q)).

MJSD is lossy by design, so there is no "output == target" test; the tests pin the rule itself:
degenerate taus, the longest-passing-prefix semantics, monotonicity in tau, the plain target sample
for the next token, and the beam sampler's exact without-replacement probabilities.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from serving.decoding.mjsd import beam_sample_finalize, beam_sample_step, joint_log_ratios, mjsd_verify
from serving.decoding.speculative import recovery_probs
from serving.decoding.warp import sample, warp_logprobs, warp_probs

NEG_INF = float("-inf")


def random_case(rng: np.random.Generator, gamma: int, vocab: int = 5):
    """Random warped-looking rows (Dirichlet(0.5): peaked, varied joint ratios) and draft tokens drawn from them."""
    target_probs = torch.tensor(rng.dirichlet(np.full(vocab, 0.5), size=gamma + 1), dtype=torch.float32)
    draft_probs = torch.tensor(rng.dirichlet(np.full(vocab, 0.5), size=gamma), dtype=torch.float32)
    draft_tokens = torch.stack([sample(row, torch.Generator().manual_seed(int(rng.integers(1 << 31))))
                                for row in draft_probs]) if gamma else torch.zeros(0, dtype=torch.long)
    return draft_tokens, draft_probs, target_probs


def reference_num_accepted(draft_tokens, draft_probs, target_probs, tau: float) -> int:
    """Algorithm 1 with plain fp64 products: eta = largest i with min(1, p(x_1:i)/q(x_1:i)) > tau."""
    if tau <= 0:
        return len(draft_tokens)
    joint_target, joint_draft, eta = 1.0, 1.0, 0
    for i, token in enumerate(draft_tokens.tolist()):
        joint_target *= float(target_probs[i, token])
        joint_draft *= float(draft_probs[i, token])
        if joint_draft > 0 and tau < min(1.0, joint_target / joint_draft):
            eta = i + 1
    return eta


# ------------------------------------------------------------------------------------------- verify

def test_matches_algorithm_1_on_random_cases():
    rng = np.random.default_rng(0)
    lengths = set()
    for case in range(300):
        draft_tokens, draft_probs, target_probs = random_case(rng, gamma=1 + case % 4)
        tau = float(rng.choice([0.05, 0.1, 0.3, 0.7, 0.95]))
        ratios = joint_log_ratios(draft_tokens, draft_probs, target_probs).exp()
        if bool((torch.abs(ratios - tau) < 1e-6).any()):
            continue   # too close to call in floating point
        result = mjsd_verify(draft_tokens, draft_probs, target_probs, torch.Generator().manual_seed(case), tau=tau)
        assert result.num_accepted == reference_num_accepted(draft_tokens, draft_probs, target_probs, tau)
        lengths.add(result.num_accepted)
    assert lengths == {0, 1, 2, 3, 4}   # all lengths exercised


def test_longest_passing_prefix_not_first_failure():
    """Joint ratios 0.25, 0.5, 0.03125: with 0.25 < tau < 0.5 prefix 1 fails but prefix 2 passes -> 2."""
    draft_probs = torch.tensor([[0.5, 0.5, 0.0], [0.25, 0.75, 0.0], [0.5, 0.25, 0.25]])
    target_probs = torch.tensor([[0.125, 0.5, 0.375], [0.5, 0.25, 0.25], [0.03125, 0.5, 0.46875], [0.2, 0.3, 0.5]])
    tokens = torch.tensor([0, 0, 0])
    torch.testing.assert_close(joint_log_ratios(tokens, draft_probs, target_probs).exp(),
                               torch.tensor([0.25, 0.5, 0.03125], dtype=torch.float64))
    expected = {0.3: 2, 0.45: 2, 0.2: 2, 0.01: 3, 0.6: 0, 0.0: 3, 1.0: 0}
    for tau, n in expected.items():
        assert mjsd_verify(tokens, draft_probs, target_probs, tau=tau).num_accepted == n, tau


def test_threshold_is_strict():
    """Algorithm 1 line 10 is `tau < min(1, p/q)`: a ratio exactly equal to tau fails."""
    draft_probs = torch.tensor([[1.0, 0.0]])
    target_probs = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    tokens = torch.tensor([0])
    assert joint_log_ratios(tokens, draft_probs, target_probs)[0].item() == math.log(0.5)   # exact fixture
    assert mjsd_verify(tokens, draft_probs, target_probs, tau=0.5).num_accepted == 0
    assert mjsd_verify(tokens, draft_probs, target_probs, tau=0.4999).num_accepted == 1


def test_degenerate_taus():
    rng = np.random.default_rng(1)
    for case in range(100):
        draft_tokens, draft_probs, target_probs = random_case(rng, gamma=4)
        target_probs[1, draft_tokens[1]] = 0.0   # even a prefix the target cannot produce is accepted at tau <= 0
        for tau in (1.0, 1.5, 100.0):
            assert mjsd_verify(draft_tokens, draft_probs, target_probs, tau=tau).num_accepted == 0
        for tau in (0.0, -0.5):
            assert mjsd_verify(draft_tokens, draft_probs, target_probs, tau=tau).num_accepted == 4


def test_draft_probability_zero_fails_that_prefix_and_longer_ones():
    """Guard instead of dividing by zero: q(x_1:i) = 0 makes prefix i (and every longer one) fail."""
    draft_probs = torch.tensor([[0.5, 0.5], [0.0, 1.0], [0.5, 0.5]])
    target_probs = torch.full((4, 2), 0.5)
    ratios = joint_log_ratios(torch.tensor([0, 0, 0]), draft_probs, target_probs)
    assert ratios[0].item() == 0.0 and bool(torch.isneginf(ratios[1:]).all())
    assert mjsd_verify(torch.tensor([0, 0, 0]), draft_probs, target_probs, tau=0.1).num_accepted == 1


def test_accepted_length_is_non_increasing_in_tau():
    rng = np.random.default_rng(2)
    taus = np.linspace(-0.1, 1.1, 61)
    varied = 0
    for case in range(60):
        draft_tokens, draft_probs, target_probs = random_case(rng, gamma=4)
        lengths = [mjsd_verify(draft_tokens, draft_probs, target_probs, tau=float(t)).num_accepted for t in taus]
        assert all(a >= b for a, b in zip(lengths, lengths[1:])), lengths
        varied += len(set(lengths)) > 2
    assert varied > 10   # the sweep really moves through several lengths


def test_draft_equal_to_target_accepts_all_below_one():
    rng = np.random.default_rng(3)
    for case in range(50):
        draft_tokens, _, target_probs = random_case(rng, gamma=4)
        for tau in (0.01, 0.5, 0.999):
            result = mjsd_verify(draft_tokens, target_probs[:4].clone(), target_probs, tau=tau)
            assert result.num_accepted == 4


def test_next_token_is_a_plain_sample_of_target_at_num_accepted():
    """Exact: same seed -> the same draw as `sample(target_probs[num_accepted])`."""
    rng = np.random.default_rng(4)
    for case in range(200):
        draft_tokens, draft_probs, target_probs = random_case(rng, gamma=3)
        result = mjsd_verify(draft_tokens, draft_probs, target_probs, torch.Generator().manual_seed(case), tau=0.3)
        replay = sample(target_probs[result.num_accepted], torch.Generator().manual_seed(case))
        assert result.next_token == int(replay)


def test_next_token_distribution_is_target_not_residual():
    """Chi-square over 20,000 steps of a fixed case where exactly 1 token is accepted: the next token
    follows target_probs[1] (p > 1e-3; fails a correct rule for 0.1% of seeds) and is clearly not the
    lossless rule's residual (p < 1e-3): MJSD is lossy by design."""
    draft_probs = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.6, 0.2, 0.1, 0.1]])
    target_probs = torch.tensor([[0.6, 0.2, 0.1, 0.1], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    tokens = torch.tensor([0, 0])   # joint ratios 6/7 (passes tau = 0.5) and 1/7 (fails)
    gen = torch.Generator().manual_seed(0)
    draws = [mjsd_verify(tokens, draft_probs, target_probs, gen, tau=0.5) for _ in range(20_000)]
    assert {d.num_accepted for d in draws} == {1}
    counts = np.bincount([d.next_token for d in draws], minlength=4)
    expected = target_probs[1].double().numpy()
    assert chisquare(counts, expected / expected.sum() * len(draws)).pvalue > 1e-3
    residual = recovery_probs(draft_probs[1], target_probs[1]).double().numpy()
    assert residual[0] == 0 and counts[0] > 0   # the residual could never emit token 0


@pytest.mark.parametrize("tau", [float("nan"), "0.1", True])
def test_bad_tau_raises(tau):
    with pytest.raises(ValueError, match="tau"):
        mjsd_verify(torch.tensor([0]), torch.ones(1, 2) / 2, torch.ones(2, 2) / 2, tau=tau)


def test_shape_errors():
    with pytest.raises(ValueError, match="target_probs"):
        mjsd_verify(torch.tensor([0, 1]), torch.ones(2, 3) / 3, torch.ones(2, 3) / 3)


# ------------------------------------------------------------------------------------- beam sampler

def test_beam_step_returns_distinct_supported_pairs_with_joint_scores():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=gen) * 2
    logits[1, :5] = NEG_INF
    step_logprobs = warp_logprobs(logits, 1.0, 6, 1.0)          # 6 finite tokens per row
    beam_logq = torch.tensor([-0.5, -1.0, NEG_INF])              # beam 2 is dead: none of its pairs may appear
    for num_beams in (1, 4, 12, 50):
        parent, token, new_logq = beam_sample_step(beam_logq, step_logprobs, num_beams, gen)
        assert parent.dtype == token.dtype == torch.long and new_logq.dtype == torch.float32
        assert len(parent) == min(num_beams, 12)
        pairs = list(zip(parent.tolist(), token.tolist()))
        assert len(set(pairs)) == len(pairs)
        assert bool(torch.isfinite(step_logprobs[parent, token]).all()) and 2 not in parent.tolist()
        torch.testing.assert_close(new_logq, beam_logq[parent] + step_logprobs[parent, token])


def test_beam_step_from_a_single_beam_has_no_duplicates():
    """Starting from one live beam (score 0), step 1 draws distinct tokens - the published code's
    num_beams identical copies could draw the same token twice (serving/decoding/mjsd.py)."""
    step_logprobs = warp_logprobs(torch.tensor([[3.0, 2.9, 2.8, -5.0, -6.0]]), 1.0, 0, 1.0)
    for seed in range(50):
        parent, token, _ = beam_sample_step(torch.zeros(1), step_logprobs, 4, torch.Generator().manual_seed(seed))
        assert parent.tolist() == [0, 0, 0, 0] and len(set(token.tolist())) == 4


def test_beam_step_matches_exact_sequential_without_replacement():
    """V=3, B=2 live beams, draw 2: the ordered pair (a, b) has probability w_a/W * w_b/(W - w_a), with
    w = exp(beam_logq[b] + step_logprobs[b, t]). Chi-square over 30 ordered cells, 20,000 draws
    (every expected count > 100), p > 1e-3; a sampler *with* replacement or proportional to the
    per-row probability alone fails it (negative control below)."""
    beam_logq = torch.tensor([-0.3, -1.2])
    step_logprobs = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.25, 0.35, 0.4]]))
    weights = (beam_logq[:, None] + step_logprobs).exp().reshape(-1).double().numpy()
    total = weights.sum()
    cells = list(itertools.permutations(range(6), 2))
    exact = np.array([weights[a] / total * weights[b] / (total - weights[a]) for a, b in cells])
    assert abs(exact.sum() - 1) < 1e-12 and exact.min() * 20_000 > 100
    gen = torch.Generator().manual_seed(0)
    index = {cell: i for i, cell in enumerate(cells)}
    counts = np.zeros(len(cells))
    for _ in range(20_000):
        parent, token, _ = beam_sample_step(beam_logq, step_logprobs, 2, gen)
        flat = (parent * 3 + token).tolist()
        counts[index[tuple(flat)]] += 1
    assert chisquare(counts, exact * counts.sum()).pvalue > 1e-3
    # negative control: ignoring the parent's joint score (row probabilities only) is a different law
    wrong = step_logprobs.exp().reshape(-1).double().numpy()
    wrong_exact = np.array([wrong[a] / wrong.sum() * wrong[b] / (wrong.sum() - wrong[a]) for a, b in cells])
    assert chisquare(counts, wrong_exact * counts.sum()).pvalue < 1e-3


def test_finalize_orders_by_joint_logq_descending_and_stably():
    order = beam_sample_finalize(torch.tensor([-2.0, -0.5, -3.0, -0.5, -1.0]))
    assert order.tolist() == [1, 3, 4, 0, 2]


@pytest.mark.parametrize("beam_logq,step,num_beams,match", [
    (torch.zeros(2), torch.zeros(3, 4), 2, "step_logprobs"),
    (torch.zeros(2, 1), torch.zeros(2, 4), 2, "beam_logq"),
    (torch.zeros(1), torch.zeros(1, 4), 0, "num_beams"),
    (torch.zeros(1), torch.full((1, 4), NEG_INF), 2, "no finite"),
    (torch.zeros(1), torch.tensor([[0.0, float("nan")]]), 2, "NaN"),
])
def test_beam_step_errors(beam_logq, step, num_beams, match):
    with pytest.raises(ValueError, match=match):
        beam_sample_step(beam_logq, step, num_beams, None)


# ------------------------------------------------------------------------------- engine-style loop

def beam_propose(draft_table: torch.Tensor, first: int, gamma: int, num_beams: int, gen, warp):
    """What the engine does: gamma beam steps from one beam, pick beam 0 of finalize, gather its rows.
    Returns (tokens [gamma], draft_probs [gamma, V], joint log q of the chosen beam)."""
    seqs = [[first]]
    rows: list[list[torch.Tensor]] = [[]]
    beam_logq = torch.zeros(1)
    for _ in range(gamma):
        step = warp_logprobs(torch.stack([draft_table[s[-1]].log() for s in seqs]), *warp)   # [B, V]
        parent, token, beam_logq = beam_sample_step(beam_logq, step, num_beams, gen)
        assert len({tuple(seqs[p] + [t]) for p, t in zip(parent.tolist(), token.tolist())}) == len(parent)
        seqs = [seqs[p] + [t] for p, t in zip(parent.tolist(), token.tolist())]
        rows = [rows[p] + [step[p].exp()] for p in parent.tolist()]
    best = int(beam_sample_finalize(beam_logq)[0])
    assert float(beam_logq[best]) == float(beam_logq.max())
    return torch.tensor(seqs[best][1:]), torch.stack(rows[best]), float(beam_logq[best])


def test_engine_style_beam_then_verify():
    rng = np.random.default_rng(6)
    vocab, gamma, warp = 6, 4, (0.8, 3, 1.0)
    draft_table = torch.tensor(rng.dirichlet(np.ones(vocab), size=vocab), dtype=torch.float32)
    other_table = torch.tensor(rng.dirichlet(np.ones(vocab), size=vocab), dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        tokens, draft_probs, logq = beam_propose(draft_table, 0, gamma, 8, gen, warp)
        # the chosen beam's score is the draft joint built from the gathered rows
        gathered = torch.log(draft_probs[torch.arange(gamma), tokens]).sum()
        assert abs(float(gathered) - logq) < 1e-5
        contexts = torch.cat([torch.tensor([0]), tokens])
        same = warp_probs(draft_table[contexts].log(), *warp)                   # draft == target
        assert mjsd_verify(tokens, draft_probs, same, gen, tau=0.1).num_accepted == gamma
        other = warp_probs(other_table[contexts].log(), *warp)
        result = mjsd_verify(tokens, draft_probs, other, gen, tau=0.1)
        assert 1 <= result.emitted <= gamma + 1 and other[result.num_accepted, result.next_token] > 0
