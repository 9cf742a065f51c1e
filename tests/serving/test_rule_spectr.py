"""serving/decoding/spectr.py: SpecTr K-SEQ (lossless multi-draft).

1. One position, exact: the output distribution, enumerated over all k-tuples of candidates with the
   rule's own pieces (`kseq_acceptance`, `kseq_residual`), equals the target for k in {1, 2, 4}; the
   same enumeration rejects K-SEQ with rho = 1 (a broken variant). rho* solves its equation to 1e-10
   and agrees with scipy's brentq. P(accept) is non-decreasing in k.
2. Wiring: `kseq_select` is those pieces plus the documented use of the generator; with k = 1 it makes
   speculative_verify's decision and draw.
3. Monte Carlo: chi-square of `kseq_select` (k = 4) against the target, and of `spectr_verify`'s first
   two output tokens (bigram tables, gamma = 2, k = 2) against the target, with the biased "longest of
   independently verified drafts" rule as a negative control that the same test rejects.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.optimize import brentq
from scipy.stats import chisquare

from serving.decoding.speculative import speculative_verify
from serving.decoding.spectr import (kseq_acceptance, kseq_beta, kseq_residual, kseq_rho, kseq_select,
                                     spectr_verify)
from serving.decoding.types import VerifyResult
from serving.decoding.warp import sample

V = 4


def random_rows(rng: np.random.Generator, vocab: int = V, zeros: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(draft_row, target_row), fp64 Dirichlet(0.8); with `zeros` one token of each row is zeroed (warp-like)."""
    draft, target = (torch.tensor(rng.dirichlet(np.full(vocab, 0.8))) for _ in range(2))
    if zeros:
        for row in (draft, target):
            row[int(rng.integers(vocab))] = 0.0
            row /= row.sum()
    return draft, target


def equation(draft: torch.Tensor, target: torch.Tensor, rho: float, k: int) -> float:
    """1 - (1 - beta)^k - rho beta, beta = sum min(draft, target / rho), in numpy (independent of the module)."""
    beta = float(np.minimum(draft.numpy(), target.numpy() / rho).sum())
    return 1 - (1 - beta) ** k - rho * beta


def exact_output(draft, target, k, rho=None) -> torch.Tensor:
    """P(emitted token) for K-SEQ at one position, enumerating every k-tuple of iid draft candidates."""
    rho = kseq_rho(draft, target, k) if rho is None else rho
    residual = kseq_residual(draft, target, rho, k).double()
    out = torch.zeros(draft.shape[0], dtype=torch.float64)
    for candidates in itertools.product(range(draft.shape[0]), repeat=k):
        prob = float(torch.prod(draft[list(candidates)]))
        if prob == 0:
            continue
        accept = kseq_acceptance(torch.tensor(candidates), draft, target, rho).double()
        reach = 1.0
        for index, token in enumerate(candidates):
            out[token] += prob * reach * float(accept[index])
            reach *= 1 - float(accept[index])
        out += prob * reach * residual
    return out


# ------------------------------------------------------------------------------------------- exact


@pytest.mark.parametrize("zeros", [False, True])
def test_rho_solves_its_equation(zeros):
    rng = np.random.default_rng(int(zeros))
    for _ in range(100):
        draft, target = random_rows(rng, vocab=6, zeros=zeros)
        assert kseq_rho(draft, target, 1) == 1.0
        for k in (2, 3, 4, 8):
            rho = kseq_rho(draft, target, k)
            assert 1.0 <= rho <= k
            if rho == 1.0:
                assert equation(draft, target, 1.0, k) <= 1e-12
                continue
            assert abs(equation(draft, target, rho, k)) < 1e-10
            assert equation(draft, target, rho, k) <= 1e-15        # the residual-non-negative side
            oracle = brentq(lambda r: equation(draft, target, r, k), 1.0, float(k), xtol=1e-14)
            assert rho == pytest.approx(oracle, abs=1e-9)


def test_rho_degenerate_cases():
    row = torch.tensor([0.1, 0.2, 0.7], dtype=torch.float64)
    assert kseq_rho(row, row, 4) == 1.0                                      # identical: beta(1) = 1
    disjoint = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64), torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    assert kseq_rho(*disjoint, 3) == 1.0                                     # beta = 0: nothing to accept
    torch.testing.assert_close(exact_output(*disjoint, 3), disjoint[1])


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("zeros", [False, True])
def test_exact_output_distribution_is_the_target(k, zeros):
    """Error is the fp32 acceptance ratios (~1e-7); the broken variant below is off by > 1e-2."""
    rng = np.random.default_rng(10 * k + zeros)
    for _ in range(10):
        draft, target = random_rows(rng, zeros=zeros)
        torch.testing.assert_close(exact_output(draft, target, k), target, atol=1e-6, rtol=0)


def test_exact_enumeration_detects_a_wrong_rho():
    rng = np.random.default_rng(3)
    errors = []
    for _ in range(10):
        draft, target = random_rows(rng)
        errors.append(float((exact_output(draft, target, 2, rho=1.0) - target).abs().max()))
    assert max(errors) > 1e-2, errors


def test_acceptance_probability_grows_with_k():
    """P(accept) = 1 - (1 - sum_x draft(x) a(x))^k = 1 - (1 - beta(rho*))^k, non-decreasing, from beta_1 = sum min."""
    rng = np.random.default_rng(4)
    for trial in range(50):
        draft, target = random_rows(rng, vocab=6, zeros=trial % 2 == 1)
        accepted = []
        for k in range(1, 9):
            rho = kseq_rho(draft, target, k)
            per_candidate = float((draft * kseq_acceptance(torch.arange(6), draft, target, rho).double()).sum())
            accepted.append(1 - (1 - per_candidate) ** k)
            assert accepted[-1] == pytest.approx(1 - (1 - kseq_beta(draft, target, rho)) ** k, abs=1e-6)
        assert accepted[0] == pytest.approx(float(torch.minimum(draft, target).sum()), abs=1e-6)
        assert all(b >= a - 1e-7 for a, b in zip(accepted, accepted[1:])), accepted


# ------------------------------------------------------------------------------------------ wiring


def test_select_is_the_pieces_plus_documented_randomness():
    rng = np.random.default_rng(5)
    outcomes = set()
    for seed in range(300):
        k = seed % 4 + 1
        draft, target = random_rows(rng, zeros=seed % 3 == 0)
        candidates = sample(draft.expand(k, V), torch.Generator().manual_seed(10_000 + seed))
        got = kseq_select(candidates, draft.float(), target.float(), torch.Generator().manual_seed(seed))
        replay = torch.Generator().manual_seed(seed)
        rho = kseq_rho(draft.float(), target.float(), k)
        accepted = (torch.rand(k, generator=replay) < kseq_acceptance(candidates, draft.float(), target.float(),
                                                                      rho)).nonzero()
        if accepted.numel():
            index = int(accepted[0, 0])
            assert got == (index, int(candidates[index]))
        else:
            assert got == (None, int(sample(kseq_residual(draft.float(), target.float(), rho, k), replay)))
        outcomes.add(got[0])
    assert {None, 0, 1, 2, 3} <= outcomes


def test_one_candidate_is_speculative_sampling():
    rng = np.random.default_rng(6)
    rejected = 0
    for seed in range(300):
        draft, target = (row.float() for row in random_rows(rng, zeros=seed % 2 == 0))
        token = sample(draft, torch.Generator().manual_seed(20_000 + seed))
        index, emitted = kseq_select(token[None], draft, target, torch.Generator().manual_seed(seed))
        reference = speculative_verify(token[None], draft[None], torch.stack([target, target]),
                                       torch.Generator().manual_seed(seed))
        assert (index == 0) == (reference.num_accepted == 1)
        if index is None:
            assert emitted == reference.next_token
            rejected += 1
        else:
            assert emitted == int(token)
    assert 30 < rejected < 270


def test_spectr_verify_shapes_and_gamma_zero():
    target_probs = torch.tensor([[[0.0, 1.0, 0.0]], [[0.0, 1.0, 0.0]]])
    assert spectr_verify(torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, 3), target_probs) \
        == (0, VerifyResult(0, 1))
    with pytest.raises(ValueError, match="target_probs"):
        spectr_verify(torch.zeros(2, 1, dtype=torch.long), torch.full((2, 1, 3), 1 / 3), torch.full((2, 1, 3), 1 / 3))
    with pytest.raises(ValueError, match="draft_probs"):
        spectr_verify(torch.zeros(2, 1, dtype=torch.long), torch.full((1, 1, 3), 1 / 3), torch.full((2, 2, 3), 1 / 3))
    with pytest.raises(ValueError, match=r"\[k, gamma\]"):
        spectr_verify(torch.zeros(2, dtype=torch.long), torch.full((2, 3), 1 / 3), torch.full((3, 3), 1 / 3))
    with pytest.raises(ValueError, match="lie in"):
        spectr_verify(torch.full((1, 1), 3), torch.full((1, 1, 3), 1 / 3), torch.full((1, 2, 3), 1 / 3))
    with pytest.raises(ValueError, match="candidate_tokens"):
        kseq_select(torch.tensor([0.0]), torch.full((3,), 1 / 3), torch.full((3,), 1 / 3))
    with pytest.raises(ValueError, match="k \\(number of candidates\\)"):
        kseq_rho(torch.full((3,), 1 / 3), torch.full((3,), 1 / 3), 0)


def test_spectr_verify_is_kseq_over_the_live_chains():
    """Replay with the same seed: at each depth K-SEQ over the next tokens of the chains that still agree
    with the accepted prefix (rows of the first of them), keep the chains matching the emitted token; the
    returned row is the first chain consistent with the accepted prefix."""
    gen = torch.Generator().manual_seed(7)
    outcomes = set()
    for seed in range(200):
        k, gamma = 3, 3
        draft_probs = torch.softmax(torch.randn(k, gamma, V, generator=gen), -1)
        draft_probs[:, 1:] = draft_probs[:1, 1:]            # few distinct prefixes so chains share tokens
        target_probs = torch.softmax(2 * torch.randn(k, gamma + 1, V, generator=gen), -1)
        tokens = sample(draft_probs, gen)
        row, result = spectr_verify(tokens, draft_probs, target_probs, torch.Generator().manual_seed(seed))

        replay, live = torch.Generator().manual_seed(seed), list(range(k))
        expected = None
        for depth in range(gamma):
            index, token = kseq_select(tokens[live, depth], draft_probs[live[0], depth], target_probs[live[0], depth],
                                       replay)
            if index is None:
                expected = (live[0], VerifyResult(depth, token))
                break
            live = [r for r in live if int(tokens[r, depth]) == token]
        if expected is None:
            expected = (live[0], VerifyResult(gamma, int(sample(target_probs[live[0], gamma], replay))))
        assert (row, result) == expected
        prefix = tokens[row, :result.num_accepted].tolist()
        assert row == min(r for r in range(k) if tokens[r, :result.num_accepted].tolist() == prefix)
        outcomes.add((result.num_accepted, row))
    assert {n for n, _ in outcomes} == set(range(gamma + 1)) and {r for _, r in outcomes} == {0, 1, 2}


def test_chains_agreeing_with_a_one_hot_target_are_accepted():
    one_hot = torch.nn.functional.one_hot(torch.tensor([[1, 2], [1, 2]]), V).float()        # [k=2, gamma=2, V]
    target = torch.cat([one_hot, torch.full((2, 1, V), 1 / V)], 1)
    for seed in range(20):
        row, result = spectr_verify(torch.tensor([[1, 2], [1, 2]]), one_hot, target,
                                    torch.Generator().manual_seed(seed))
        assert row == 0 and result.num_accepted == 2


# ------------------------------------------------------------------------------------- Monte Carlo


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of counts against probs; zero-probability cells must be empty, cells expected < 5 are pooled."""
    assert counts[probs == 0].sum() == 0, "emitted an outcome the target cannot produce"
    expected = probs * counts.sum()
    big, small = expected >= 5, (expected < 5) & (probs > 0)
    obs, exp = np.append(counts[big], counts[small].sum()), np.append(expected[big], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def test_kseq_select_matches_the_target_for_k4():
    """10,000 draws, one fixed seed (deterministic; a correct rule fails for ~1e-3 of seeds)."""
    draft, target = (row.float() for row in random_rows(np.random.default_rng(8)))
    gen = torch.Generator().manual_seed(0)
    candidates = sample(draft.expand(10_000, 4, V), gen)
    tokens = [kseq_select(row, draft, target, gen)[1] for row in candidates]
    assert chi_square(np.bincount(tokens, minlength=V), target.double().numpy()) > 1e-3


def bigram_tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft bigram tables [V, V] (row = last token), Dirichlet(1), fp32."""
    rng = np.random.default_rng(seed)
    return (torch.tensor(rng.dirichlet(np.ones(V), size=V), dtype=torch.float32) for _ in range(2))


def longest_of_independent_drafts(draft_tokens, draft_probs, target_probs, generator):
    """Negative control (biased, as the SpecTr paper notes): speculative sampling on each chain separately, keep
    the first chain with the longest accepted prefix and its recovered / bonus token."""
    results = [speculative_verify(draft_tokens[r], draft_probs[r], target_probs[r], generator)
               for r in range(draft_tokens.shape[0])]
    row = max(range(len(results)), key=lambda r: (results[r].num_accepted, -r))
    return row, results[row]


def draft_chains(draft, context, k, gamma, gen):
    """k iid draft chains of length gamma after each context token: tokens [N, k, gamma], and the draft /
    target row index of every position [N, k, gamma + 1] (bigram: the previous token)."""
    prev = [context[:, None].expand(-1, k)]
    tokens = []
    for _ in range(gamma):
        tokens.append(sample(draft[prev[-1]], gen))
        prev.append(tokens[-1])
    return torch.stack(tokens, -1), torch.stack(prev, -1)


def first_two_tokens(target, draft, n, seed, rule=spectr_verify, k=2, gamma=2) -> np.ndarray:
    """First two output tokens (as a * V + b) of n generations from context token 0."""
    gen = torch.Generator().manual_seed(seed)

    def step(context):
        tokens, prev = draft_chains(draft, context, k, gamma, gen)
        emitted = []
        for i in range(context.shape[0]):
            row, result = rule(tokens[i], draft[prev[i, :, :gamma]], target[prev[i]], gen)
            emitted.append(tokens[i, row, :result.num_accepted].tolist() + [result.next_token])
        return emitted

    first = step(torch.zeros(n, dtype=torch.long))
    short = [i for i, e in enumerate(first) if len(e) < 2]
    follow = step(torch.tensor([first[i][0] for i in short], dtype=torch.long))
    for i, more in zip(short, follow):
        first[i] = first[i] + more[:1]
    return np.array([e[0] * V + e[1] for e in first])


def target_pairs(target) -> np.ndarray:
    return (target[0][:, None] * target).double().reshape(-1).numpy()


def test_spectr_verify_matches_the_target_over_two_tokens():
    """6,000 generations, one fixed seed (deterministic; a correct rule fails for ~1e-3 of seeds)."""
    target, draft = bigram_tables(seed=9)
    pairs = first_two_tokens(target, draft, 6_000, seed=0)
    assert chi_square(np.bincount(pairs, minlength=V * V), target_pairs(target)) > 1e-3


def test_longest_of_independent_drafts_is_rejected():
    target, draft = bigram_tables(seed=9)
    pairs = first_two_tokens(target, draft, 6_000, seed=0, rule=longest_of_independent_drafts)
    assert chi_square(np.bincount(pairs, minlength=V * V), target_pairs(target)) < 1e-3
