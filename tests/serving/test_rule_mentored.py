"""serving/decoding/mentored.py: mentored decoding (lossy, KL-bounded).

Evidence, all exact or against an independent optimiser:
1. kl_budget = 0 is speculative sampling: same result as speculative_verify for the same seed.
2. The realised output distribution q min(1, pi/q) + (1 - A) norm(max(0, pi - q)), computed with the
   speculative pieces the verifier uses, equals pi; KL(target || pi) <= D and is tight when the budget
   binds; the acceptance A = sum min(q, pi) is >= speculative's and non-decreasing in D.
3. pi is the optimum: it matches SLSQP over the simplex, also in the
   target-has-zeros regime where the blog's alpha-form is not optimal.
4. Wiring: mentored_verify is those pieces plus the documented use of the generator.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from serving.decoding.mentored import mentored_distribution, mentored_verify
from serving.decoding.speculative import acceptance_probs, recovery_probs, speculative_verify
from serving.decoding.warp import sample, warp_probs

BUDGETS = [0.001, 0.01, 0.05, 0.2, 1.0, 5.0]


def random_rows(rng: np.random.Generator, vocab: int = 6, zeros: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(draft_row, target_row), fp64, Dirichlet(0.7). With `zeros`, each row loses ~a third of its tokens
    (as top-k / top-p warps do), independently, so both target-only and draft-only tokens occur."""
    draft, target = (torch.tensor(rng.dirichlet(np.full(vocab, 0.7))) for _ in range(2))
    if zeros:
        for row in (draft, target):
            row[torch.tensor(rng.random(vocab) < 0.35)] = 0.0
            if row.sum() == 0:
                row[int(rng.integers(vocab))] = 1.0
            row /= row.sum()
    return draft, target


def kl(target: torch.Tensor, pi: torch.Tensor) -> float:
    support = target > 0
    if bool((pi[support] <= 0).any()):
        return math.inf
    return float((target[support] * (target[support] / pi[support]).log()).sum())


def acceptance(draft: torch.Tensor, pi: torch.Tensor) -> float:
    return float(torch.minimum(draft, pi).sum())


def realised(draft: torch.Tensor, pi: torch.Tensor) -> torch.Tensor:
    """Exact output distribution of 'accept w.p. min(1, pi/q), else sample norm(max(0, pi - q))'."""
    vocab = draft.shape[0]
    accept = acceptance_probs(torch.arange(vocab)[:, None], draft.expand(vocab, 1, vocab),
                              pi.expand(vocab, 2, vocab))[:, 0].double()
    accepted_mass = float((draft * accept).sum())
    return draft * accept + (1 - accepted_mass) * recovery_probs(draft, pi).double()


# --------------------------------------------------------------------------- D = 0 is speculative


def random_case(rng: np.random.Generator, gamma: int, vocab: int = 6):
    target_probs = torch.tensor(rng.dirichlet(np.full(vocab, 0.7), size=gamma + 1), dtype=torch.float32)
    draft_probs = torch.tensor(rng.dirichlet(np.full(vocab, 0.7), size=gamma), dtype=torch.float32)
    draft_tokens = torch.tensor([rng.choice(vocab, p=row.double().numpy() / row.double().sum().item())
                                 for row in draft_probs], dtype=torch.long)
    return draft_tokens, draft_probs, target_probs


def test_zero_budget_is_speculative_verify():
    rng = np.random.default_rng(0)
    seen = set()
    for seed in range(500):
        gamma = seed % 5
        case = random_case(rng, gamma)
        got = mentored_verify(*case, torch.Generator().manual_seed(seed), kl_budget=0.0)
        assert got == speculative_verify(*case, torch.Generator().manual_seed(seed))
        seen.add((gamma, got.num_accepted))
    assert {(g, n) for g in range(5) for n in range(g + 1)} <= seen


def test_zero_budget_distribution_is_the_target():
    rng = np.random.default_rng(1)
    for _ in range(50):
        draft, target = random_rows(rng, zeros=True)
        assert torch.equal(mentored_distribution(draft, target * 3.0, 0.0), target * 3.0 / (target * 3.0).sum())


# ----------------------------------------------------------------------- realised distribution, KL


@pytest.mark.parametrize("zeros", [False, True])
def test_realised_distribution_is_pi_within_budget(zeros):
    rng = np.random.default_rng(2 + zeros)
    binding = 0
    for _ in range(60):
        draft, target = random_rows(rng, zeros=zeros)
        for budget in BUDGETS:
            pi = mentored_distribution(draft, target, budget)
            assert pi.dtype == torch.float64 and bool((pi >= 0).all())
            assert abs(float(pi.sum()) - 1) < 1e-12
            torch.testing.assert_close(realised(draft, pi), pi, atol=1e-6, rtol=0)
            divergence = kl(target, pi)
            assert divergence <= budget + 1e-9, (divergence, budget)
            covered = bool((draft[target > 0] > 0).all())
            if kl(target, draft) <= budget:       # quick path: pi is the draft, everything is accepted
                torch.testing.assert_close(pi, draft)
            elif covered:                         # the budget binds: the optimum spends all of it
                assert divergence == pytest.approx(budget, abs=1e-9)
                binding += 1
            # Not covered (draft misses a target token, KL(target || draft) = inf): spending a large budget
            # needs pi ~ target / beta there with beta beyond fp64 (module docstring), so only <= is checked.
    assert binding > 60


def test_acceptance_beats_speculative_and_grows_with_budget():
    rng = np.random.default_rng(4)
    grid = [0.0] + list(np.geomspace(1e-4, 10.0, 30))
    for trial in range(40):
        draft, target = random_rows(rng, zeros=trial % 2 == 1)
        accepted = [acceptance(draft, mentored_distribution(draft, target, float(budget))) for budget in grid]
        assert accepted[0] == pytest.approx(acceptance(draft, target), abs=1e-12)   # speculative's beta
        assert all(b >= a - 1e-9 for a, b in zip(accepted, accepted[1:])), accepted
        if kl(target, draft) <= grid[-1]:
            assert accepted[-1] == pytest.approx(1.0, abs=1e-12)


# -------------------------------------------------------------------------------- optimality


def numerical_optimum(draft: np.ndarray, target: np.ndarray, budget: float, rng: np.random.Generator) -> float:
    """max sum min(q, x) s.t. KL(p || x) <= D on the simplex, SLSQP from 20 random starts."""
    support = target > 0

    def divergence(x):
        return float(np.sum(target[support] * np.log(target[support] / np.maximum(x[support], 1e-12))))

    constraints = [{"type": "eq", "fun": lambda x: x.sum() - 1},
                   {"type": "ineq", "fun": lambda x: budget - divergence(x)}]
    best = -1.0
    for _ in range(20):
        result = minimize(lambda x: -np.minimum(draft, x).sum(), rng.dirichlet(np.ones(len(draft))),
                          constraints=constraints, bounds=[(0.0, 1.0)] * len(draft), method="SLSQP")
        if result.success and divergence(result.x) <= budget + 1e-6:
            best = max(best, -result.fun)
    return best


@pytest.mark.parametrize("budget", [0.01, 0.05, 0.2])
def test_closed_form_matches_numerical_optimum(budget):
    rng = np.random.default_rng(5)
    for _ in range(3):
        draft, target = (rng.dirichlet(np.ones(6)) for _ in range(2))
        pi = mentored_distribution(torch.tensor(draft), torch.tensor(target), budget)
        assert acceptance(torch.tensor(draft), pi) == pytest.approx(numerical_optimum(draft, target, budget, rng),
                                                                    abs=1e-3)


def test_target_zeros_are_filled_when_the_budget_allows():
    """A token the target cannot emit costs no KL; once the alpha-form is exhausted the optimum gives it
    mass (the alpha-form never does), and that still matches the numerical optimum."""
    rng = np.random.default_rng(6)
    filled = 0
    for _ in range(4):
        draft, target = rng.dirichlet(np.ones(6)), rng.dirichlet(np.ones(6))
        zero = int(np.argmax(draft))
        target[zero] = 0.0
        target /= target.sum()
        full = kl(torch.tensor(target), torch.tensor(draft))
        for budget in (0.5 * full, 0.9 * full):
            pi = mentored_distribution(torch.tensor(draft), torch.tensor(target), budget)
            filled += float(pi[zero]) > 1e-3
            assert acceptance(torch.tensor(draft), pi) == pytest.approx(
                numerical_optimum(draft, target, budget, rng), abs=1e-3)
    assert filled >= 6


def test_large_vocabulary():
    """A 49,152-token row, full support and warped (top-k 20 / top-p 0.9, the engine's default)."""
    gen = torch.Generator().manual_seed(7)
    target_logits = torch.randn(49_152, generator=gen, dtype=torch.float64) * 3
    draft_logits = target_logits + torch.randn(49_152, generator=gen, dtype=torch.float64)
    for warp in [(1.0, 0, 1.0), (1.0, 20, 0.9)]:
        target = warp_probs(target_logits, *warp).double()
        draft = warp_probs(draft_logits, *warp).double()
        target, draft = target / target.sum(), draft / draft.sum()
        for budget in (0.01, 0.1):
            pi = mentored_distribution(draft, target, budget)
            assert abs(float(pi.sum()) - 1) < 1e-12
            assert kl(target, pi) == pytest.approx(budget, abs=1e-9)
            assert acceptance(draft, pi) > acceptance(draft, target) + 1e-3


# ------------------------------------------------------------------------------------------- wiring


def test_verify_is_the_pieces_plus_documented_randomness():
    """Same seed: gamma uniforms, accept iff u < min(1, pi(x)/q(x)), then one sample of the residual against
    pi (or of the target's bonus row)."""
    rng = np.random.default_rng(8)
    seen = set()
    for seed in range(300):
        gamma = seed % 4
        budget = float(rng.choice([0.02, 0.2, 1.0]))
        draft_tokens, draft_probs, target_probs = random_case(rng, gamma)
        got = mentored_verify(draft_tokens, draft_probs, target_probs, torch.Generator().manual_seed(seed),
                              kl_budget=budget)
        replay = torch.Generator().manual_seed(seed)
        uniforms = torch.rand(gamma, generator=replay)
        n, emit = gamma, target_probs[gamma]
        for i in range(gamma):
            pi = mentored_distribution(draft_probs[i], target_probs[i], budget)
            draft = draft_probs[i].double() / draft_probs[i].double().sum()
            x = int(draft_tokens[i])
            if not float(uniforms[i]) < min(1.0, float(pi[x] / draft[x])):
                n, emit = i, recovery_probs(draft, pi)
                break
        assert got.num_accepted == n
        assert got.next_token == int(sample(emit, replay))
        seen.add((gamma, n))
    assert {(g, n) for g in range(4) for n in range(g + 1)} <= seen


def test_generous_budget_accepts_everything():
    rng = np.random.default_rng(9)
    for seed in range(100):
        draft_tokens, draft_probs, target_probs = random_case(rng, 4)
        budget = max(kl(target_probs[i].double(), draft_probs[i].double()) for i in range(4)) + 1e-6
        assert mentored_verify(draft_tokens, draft_probs, target_probs, torch.Generator().manual_seed(seed),
                               kl_budget=budget).num_accepted == 4


@pytest.mark.parametrize("budget", [-0.1, float("nan"), True, "0.1"])
def test_bad_budget(budget):
    with pytest.raises(ValueError, match="kl_budget"):
        mentored_verify(torch.tensor([0]), torch.full((1, 3), 1 / 3), torch.full((2, 3), 1 / 3), kl_budget=budget)
    with pytest.raises(ValueError, match="kl_budget"):
        mentored_distribution(torch.full((3,), 1 / 3), torch.full((3,), 1 / 3), budget)


def test_bad_rows():
    with pytest.raises(ValueError, match="differ"):
        mentored_distribution(torch.full((3,), 1 / 3), torch.full((4,), 0.25), 0.1)
    with pytest.raises(ValueError, match="non-negative"):
        mentored_distribution(torch.tensor([0.5, -0.1, 0.6]), torch.full((3,), 1 / 3), 0.1)
    with pytest.raises(ValueError, match="positive mass"):
        mentored_distribution(torch.zeros(3), torch.full((3,), 1 / 3), 0.1)
    with pytest.raises(ValueError, match="iters"):
        mentored_distribution(torch.full((3,), 1 / 3), torch.full((3,), 1 / 3), 0.1, iters=0)
    with pytest.raises(ValueError, match="target_probs"):
        mentored_verify(torch.tensor([0]), torch.full((1, 3), 1 / 3), torch.full((1, 3), 1 / 3))
