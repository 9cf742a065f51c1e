"""serving/decoding/speculative.py: the lossless Leviathan/Chen rule.

Three layers of evidence:
1. exact: the distribution of the first N emitted tokens, computed by enumeration from the rule's own
   pieces (`acceptance_probs`, `recovery_probs`), equals the target's (the losslessness theorem of
   Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding");
2. wiring: `speculative_verify` is exactly those pieces plus the documented use of the generator
   (same seed -> same uniforms -> same token), so (1) is a statement about the function itself;
3. Monte Carlo: seeded chi-square of 1e5 vectorised generations against the (warped) target, with a
   negative control (sample the target instead of the residual) that the same test rejects.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from serving.decoding.speculative import acceptance_probs, recovery_probs, speculative_verify
from serving.decoding.warp import sample, warp_probs

V = 4


def bigram_tables(seed: int, vocab: int = V, warp: tuple[float, int, float] | None = None):
    """Target and draft bigram tables [vocab, vocab] (row = last token), fp64, from Dirichlet(1) draws.
    With `warp`, the tables are warped identically (temperature, top_k, top_p) - the reference is then
    the warped target."""
    rng = np.random.default_rng(seed)
    target = torch.tensor(rng.dirichlet(np.ones(vocab), size=vocab))
    draft = torch.tensor(rng.dirichlet(np.ones(vocab), size=vocab))
    if warp is not None:
        target = warp_probs(target.log(), *warp).double()
        draft = warp_probs(draft.log(), *warp).double()
    return target, draft


def target_only(draft_row, target_row):
    """Negative control: on rejection sample the target instead of the residual (lossy)."""
    return target_row.float() / target_row.float().sum(-1, keepdim=True)


# ---------------------------------------------------------------------------------------------- exact

def step_blocks(target, draft, last: int, gamma: int, recover=recovery_probs) -> dict[tuple, float]:
    """Exact distribution of the token block emitted by one step from context `last`."""
    vocab = target.shape[0]
    out: dict[tuple, float] = {}
    for drafted in itertools.product(range(vocab), repeat=gamma):
        prevs = (last,) + drafted
        draft_probs = draft[list(prevs[:gamma])]      # [gamma, vocab]
        target_probs = target[list(prevs)]            # [gamma + 1, vocab]
        prob_drafted = float(torch.prod(draft_probs[torch.arange(gamma), list(drafted)]))
        if prob_drafted == 0:
            continue
        accept = acceptance_probs(torch.tensor(drafted, dtype=torch.long), draft_probs, target_probs).double()
        reach = 1.0
        for k in range(gamma + 1):
            if k < gamma:
                stop, emit = reach * (1 - float(accept[k])), recover(draft_probs[k], target_probs[k])
            else:
                stop, emit = reach, target_probs[gamma]
            for t in range(vocab):
                key = drafted[:k] + (t,)
                out[key] = out.get(key, 0.0) + prob_drafted * stop * float(emit[t])
            if k < gamma:
                reach *= float(accept[k])
    return out


def prefix_dist(target, draft, first: int, gamma: int, length: int, recover=recovery_probs) -> dict[tuple, float]:
    """Exact P(first `length` output tokens) under repeated steps (bigram: the context is the last token)."""
    dist: dict[tuple, float] = {}

    def rec(last, prob, emitted):
        if len(emitted) >= length:
            key = emitted[:length]
            dist[key] = dist.get(key, 0.0) + prob
            return
        for block, prob_block in step_blocks(target, draft, last, gamma, recover).items():
            if prob_block > 0:
                rec(block[-1], prob * prob_block, emitted + block)

    rec(first, 1.0, ())
    return dist


def target_dist(target, first: int, length: int) -> dict[tuple, float]:
    out = {}
    for seq in itertools.product(range(target.shape[0]), repeat=length):
        prob, last = 1.0, first
        for t in seq:
            prob *= float(target[last, t])
            last = t
        out[seq] = prob
    return out


def max_abs_diff(a: dict, b: dict) -> float:
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


@pytest.mark.parametrize("gamma", [1, 2, 3])
@pytest.mark.parametrize("warp", [None, (0.7, 3, 0.8)])
def test_exact_output_distribution_equals_target(gamma, warp):
    """Error is fp32 rounding in the rule's pieces (~1e-7); a lossy rule is off by >1e-2 (next test)."""
    target, draft = bigram_tables(seed=gamma, warp=warp)
    if warp is not None:
        assert bool((target == 0).any()), "warping should create zero-probability tokens in this fixture"
    assert max_abs_diff(prefix_dist(target, draft, 0, gamma, 3), target_dist(target, 0, 3)) < 1e-5


def test_exact_enumeration_detects_the_target_instead_of_residual_bug():
    target, draft = bigram_tables(seed=2)
    assert max_abs_diff(prefix_dist(target, draft, 0, 2, 3, target_only), target_dist(target, 0, 3)) > 1e-2


def test_accept_and_residual_decompose_the_target_exactly():
    """q(x) min(1, p(x)/q(x)) + (1 - beta) residual(x) = p(x), beta = sum_x min(p, q) = 1 - TVD."""
    rng = np.random.default_rng(5)
    for _ in range(20):
        target_row = torch.tensor(rng.dirichlet(np.ones(6)))
        draft_row = torch.tensor(rng.dirichlet(np.ones(6)))
        target_row[rng.integers(6)] = 0.0
        target_row /= target_row.sum()
        tokens = torch.arange(6)
        accept = acceptance_probs(tokens[:, None], draft_row.expand(6, 1, 6), target_row.expand(6, 2, 6))[:, 0]
        beta = float(torch.minimum(target_row, draft_row).sum())
        torch.testing.assert_close(float((draft_row * accept).sum()), beta, atol=1e-6, rtol=0)
        recombined = draft_row * accept + (1 - beta) * recovery_probs(draft_row, target_row)
        torch.testing.assert_close(recombined.double(), target_row, atol=1e-6, rtol=0)


def test_residual_falls_back_to_target_when_it_has_no_mass():
    row = torch.tensor([0.25, 0.25, 0.5])
    torch.testing.assert_close(recovery_probs(row, row), row)
    torch.testing.assert_close(recovery_probs(torch.tensor([0.5, 0.25, 0.25]), row), torch.tensor([0.0, 0.0, 1.0]))


# --------------------------------------------------------------------------------------------- wiring

def random_case(rng: np.random.Generator, gamma: int, vocab: int = 6):
    target_probs = torch.tensor(rng.dirichlet(np.full(vocab, 0.7), size=gamma + 1), dtype=torch.float32)
    draft_probs = torch.tensor(rng.dirichlet(np.full(vocab, 0.7), size=gamma), dtype=torch.float32)
    draft_tokens = torch.tensor([rng.choice(vocab, p=row.double().numpy() / row.double().sum().item())
                                 for row in draft_probs], dtype=torch.long)
    return draft_tokens, draft_probs, target_probs


def test_verify_is_the_pieces_plus_documented_randomness():
    """Same seed: gamma uniforms first, then one `sample` from the recovered/bonus distribution."""
    rng = np.random.default_rng(0)
    seen = set()
    for case in range(300):
        gamma = case % 5
        draft_tokens, draft_probs, target_probs = random_case(rng, gamma)
        result = speculative_verify(draft_tokens, draft_probs, target_probs, torch.Generator().manual_seed(case))
        replay = torch.Generator().manual_seed(case)
        accepted = (torch.rand(gamma, generator=replay) < acceptance_probs(draft_tokens, draft_probs, target_probs))
        n = int(accepted.long().cumprod(0).sum()) if gamma else 0
        emit = recovery_probs(draft_probs[n], target_probs[n]) if n < gamma else target_probs[gamma]
        assert result.num_accepted == n
        assert result.next_token == int(sample(emit, replay))
        assert 1 <= result.emitted <= gamma + 1
        seen.add((gamma, n))
    assert {(g, n) for g in range(5) for n in range(g + 1)} <= seen   # every outcome was exercised


def test_greedy_warp_emits_the_target_argmax():
    """T = 0 on both sides: accepted = common prefix of draft and target argmaxes, then the target argmax."""
    gen = torch.Generator().manual_seed(3)
    for agree in range(5):
        target_logits = torch.randn(5, 7, generator=gen)
        draft_logits = torch.randn(4, 7, generator=gen)
        draft_logits[:agree] = target_logits[:agree] * 2 + 0.1      # same argmax, different values
        if agree < 4:                                               # force a disagreement right after
            draft_logits[agree, target_logits[agree].argmax()] = -10.0
        target_probs, draft_probs = warp_probs(target_logits, 0.0, 0, 1.0), warp_probs(draft_logits, 0.0, 0, 1.0)
        draft_tokens = draft_probs.argmax(-1)
        for seed in range(20):
            result = speculative_verify(draft_tokens, draft_probs, target_probs, torch.Generator().manual_seed(seed))
            assert result.num_accepted == agree
            assert result.next_token == int(target_logits[agree].argmax())


def test_draft_equal_to_target_accepts_everything():
    rng = np.random.default_rng(1)
    for seed in range(200):
        _, _, target_probs = random_case(rng, 4)
        draft_tokens = sample(target_probs[:4], torch.Generator().manual_seed(10_000 + seed))
        result = speculative_verify(draft_tokens, target_probs[:4].clone(), target_probs,
                                    torch.Generator().manual_seed(seed))
        assert result.num_accepted == 4 and target_probs[4, result.next_token] > 0


def test_zero_probabilities_reject():
    """A token the target cannot emit is always rejected; a draft probability of 0 is guarded (ratio 0)."""
    draft_probs = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    target_probs = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]])
    for seed in range(50):
        # position 0 accepted (ratio 1); position 1 has target 0 -> rejected; residual [0, 0.2, 0] -> token 1
        result = speculative_verify(torch.tensor([1, 0]), draft_probs, target_probs, torch.Generator().manual_seed(seed))
        assert (result.num_accepted, result.next_token) == (1, 1)
        # draft probability 0 at position 0 -> rejected; residual of row 0 has no mass -> target row 0
        result = speculative_verify(torch.tensor([2, 1]), draft_probs, target_probs, torch.Generator().manual_seed(seed))
        assert result.num_accepted == 0 and result.next_token in (0, 1)


def test_gamma_zero_is_plain_target_sampling():
    target_probs = torch.tensor([[0.0, 1.0, 0.0]])
    result = speculative_verify(torch.zeros(0, dtype=torch.long), torch.zeros(0, 3), target_probs)
    assert result.num_accepted == 0 and result.next_token == 1


@pytest.mark.parametrize("tokens,draft_shape,target_shape,match", [
    ([0, 1], (2, 3), (2, 3), "target_probs"), ([0, 1], (2, 4), (3, 3), "draft_probs"),
    ([0, 3], (2, 3), (3, 3), r"lie in \[0, 3\)"), ([[0, 1]], (2, 3), (3, 3), r"\[gamma\]"),
])
def test_shape_errors(tokens, draft_shape, target_shape, match):
    with pytest.raises(ValueError, match=match):
        speculative_verify(torch.tensor(tokens), torch.full(draft_shape, 0.25), torch.full(target_shape, 0.25))
    with pytest.raises(ValueError, match="integer"):
        speculative_verify(torch.tensor([0.0]), torch.ones(1, 3) / 3, torch.ones(2, 3) / 3)


# ---------------------------------------------------------------------------------------- Monte Carlo

def vectorised_step(target, draft, last, gamma, gen, recover=recovery_probs):
    """One speculative step for every row of `last` [N] at once, with the rule's own pieces.
    Returns (num_accepted [N], drafted [N, gamma], next_token [N])."""
    rows = torch.arange(last.shape[0])
    prevs, drafted = [last], []
    for _ in range(gamma):
        drafted.append(sample(draft[prevs[-1]], gen))
        prevs.append(drafted[-1])
    drafted = torch.stack(drafted, 1)                            # [N, gamma]
    draft_probs = draft[torch.stack(prevs[:gamma], 1)].float()   # [N, gamma, V]
    target_probs = target[torch.stack(prevs, 1)].float()         # [N, gamma + 1, V]
    rejected = ~(torch.rand(last.shape[0], gamma, generator=gen) < acceptance_probs(drafted, draft_probs, target_probs))
    num_accepted = torch.where(rejected.any(1), rejected.long().argmax(1), torch.full_like(last, gamma))
    stop = num_accepted.clamp(max=gamma - 1)
    emit = torch.where((num_accepted < gamma)[:, None], recover(draft_probs[rows, stop], target_probs[rows, stop]),
                       target_probs[:, gamma])
    return num_accepted, drafted, sample(emit, gen)


def first_two_tokens(target, draft, gamma, n, seed, recover=recovery_probs):
    """The first two output tokens of n independent generations from context token 0."""
    gen = torch.Generator().manual_seed(seed)
    accepted, drafted, nxt = vectorised_step(target, draft, torch.zeros(n, dtype=torch.long), gamma, gen, recover)
    first = torch.where(accepted >= 1, drafted[:, 0], nxt)
    accepted2, drafted2, nxt2 = vectorised_step(target, draft, first, gamma, gen, recover)   # used where accepted == 0
    second = torch.where(accepted == 1, nxt, torch.where(accepted2 >= 1, drafted2[:, 0], nxt2))
    if gamma >= 2:
        second = torch.where(accepted >= 2, drafted[:, 1], second)
    return first, second


def chi_square_vs_target(target, first, second) -> float:
    """p-value of the V*V joint counts against target[0, a] * target[a, b]. Cells of probability 0 must be
    empty; cells with expected count < 5 are pooled (chi-square validity)."""
    vocab = target.shape[0]
    counts = np.bincount((first * vocab + second).numpy(), minlength=vocab * vocab).astype(np.float64)
    probs = (target[0][:, None] * target).reshape(-1).numpy()
    assert counts[probs == 0].sum() == 0, "emitted a token pair the target cannot produce"
    expected = probs * counts.sum()
    small = (expected < 5) & (probs > 0)
    big = expected >= 5
    obs = np.append(counts[big], counts[small].sum())
    exp = np.append(expected[big], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


@pytest.mark.parametrize("gamma", [1, 3])
@pytest.mark.parametrize("warp", [None, (0.7, 3, 0.8)])
def test_monte_carlo_matches_target(gamma, warp):
    """1e5 generations, 3 seeds, median p-value > 1e-3: a correct rule fails this for well under 1e-3 of
    seed triples (each p-value is uniform under the null), and the seeds are fixed, so it is deterministic."""
    target, draft = bigram_tables(seed=10 + gamma, warp=warp)
    pvalues = [chi_square_vs_target(target, *first_two_tokens(target, draft, gamma, 100_000, seed)) for seed in range(3)]
    assert float(np.median(pvalues)) > 1e-3, pvalues


@pytest.mark.parametrize("warp", [None, (0.7, 3, 0.8)])
def test_monte_carlo_negative_control_is_rejected(warp):
    """Same harness, but the rejected position samples the target instead of the residual."""
    target, draft = bigram_tables(seed=11, warp=warp)
    pvalue = chi_square_vs_target(target, *first_two_tokens(target, draft, 1, 100_000, 0, recover=target_only))
    assert pvalue < 1e-3
