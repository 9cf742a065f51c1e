"""training/losses.py: each loss against a slow, obviously correct per-row loop (value and gradient),
and the divergence properties (symmetry, zero iff equal, bounds, masking, KL limits of the JSD)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from training.losses import (LOSSES, TAIL_FLOOR, coarse_logprobs, forward_kl, generalized_jsd, get_loss, reverse_kl,
                             tvd)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine two spinning
    OpenMP threads per process make a tiny forward pass up to 30x slower (measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------- slow reference
def _cells(logits_row: torch.Tensor, ids_row: list[int], lp_row: list[float]):
    """The (k+1)-cell target and draft distributions of one row, built with plain loops (float64)."""
    q = torch.softmax(logits_row.double(), dim=-1)
    V = len(q)
    valid = [i for i in ids_row if i >= 0]
    p_cells, q_cells = [], []
    for i, lp in zip(ids_row, lp_row):
        if i >= 0:
            p_cells.append(math.exp(lp))
            q_cells.append(q[i])
    outside = [v for v in range(V) if v not in valid]
    if outside:
        p_cells.append(max(1.0 - sum(p_cells), TAIL_FLOOR))
        q_tail = q[outside[0]] * 0
        for v in outside:
            q_tail = q_tail + q[v]
        q_cells.append(q_tail)
    z = sum(p_cells)
    return [c / z for c in p_cells], q_cells


def _log(x):
    return torch.log(x) if torch.is_tensor(x) else math.log(x)


def _kl(a, b):
    """sum_c a_c (log a_c - log b_c) over the cells with a_c > 0."""
    total = 0.0
    for x, y in zip(a, b):
        if float(x.detach() if torch.is_tensor(x) else x) > 0:
            total = total + x * (_log(x) - _log(y))
    return total


def slow_loss(name: str, logits, ids, lps, mask, beta: float = 0.5):
    total, count = logits.new_zeros((), dtype=torch.float64), 0
    for n in range(logits.shape[0]):
        if not bool(mask[n]):
            continue
        P, Q = _cells(logits[n], ids[n].tolist(), lps[n].tolist())
        if name == "forward_kl":
            row = _kl(P, Q)
        elif name == "reverse_kl":
            row = _kl(Q, P)
        elif name == "jsd":
            M = [beta * p + (1 - beta) * q for p, q in zip(P, Q)]
            row = beta * _kl(P, M) + (1 - beta) * _kl(Q, M)
        else:
            row = 0.5 * sum(abs(p - q) for p, q in zip(P, Q))
        total = total + row
        count += 1
    return total / max(count, 1)


def random_case(seed: int, N: int = 5, V: int = 12, k: int = 4, scale: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(N, V, generator=g) * scale).requires_grad_(True)
    target_full = torch.log_softmax(torch.randn(N, V, generator=g) * scale, dim=-1)
    lps, ids = torch.topk(target_full, k, dim=-1)
    ids = ids.clone()
    ids[0, 1] = -1          # a target token the draft cannot emit
    ids[2, :] = -1          # a row with no usable top-k at all
    mask = torch.ones(N, dtype=torch.bool)
    mask[3] = False
    return logits, ids, lps, mask


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_matches_slow_reference_value_and_gradient(name, seed):
    logits, ids, lps, mask = random_case(seed)
    fast = get_loss(name)(logits, ids, lps, mask)
    (g_fast,) = torch.autograd.grad(fast, logits)
    slow = slow_loss(name, logits, ids, lps, mask)
    (g_slow,) = torch.autograd.grad(slow, logits)
    assert float(fast.detach()) == pytest.approx(float(slow.detach()), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(g_fast.double(), g_slow.double(), rtol=1e-4, atol=1e-6)
    assert float(fast.detach()) > 0
    assert torch.count_nonzero(g_fast[3]) == 0          # the masked row gets no gradient


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_generalized_jsd_matches_slow_reference_for_any_beta(beta):
    logits, ids, lps, mask = random_case(7)
    fast = generalized_jsd(logits, ids, lps, mask, beta=beta)
    slow = slow_loss("jsd", logits, ids, lps, mask, beta=beta)
    (g_fast,) = torch.autograd.grad(fast, logits)
    (g_slow,) = torch.autograd.grad(slow, logits)
    assert float(fast.detach()) == pytest.approx(float(slow.detach()), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(g_fast.double(), g_slow.double(), rtol=1e-4, atol=1e-7)


# ----------------------------------------------------------------------------- full-vocabulary helpers
def full(target_logits: torch.Tensor):
    """The target known on its whole vocabulary (k = V): no tail cell, the divergences are the exact ones."""
    lp = torch.log_softmax(target_logits, dim=-1)
    ids = torch.arange(lp.shape[-1]).expand_as(lp).clone()
    return ids, lp, torch.ones(lp.shape[0], dtype=torch.bool)


def test_jsd_is_symmetric_at_half_and_swaps_beta_otherwise():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(4, 9, generator=g) * 3, torch.randn(4, 9, generator=g) * 3
    ids, lp_a, m = full(a)
    _, lp_b, _ = full(b)
    assert float(generalized_jsd(b, ids, lp_a, m)) == pytest.approx(float(generalized_jsd(a, ids, lp_b, m)), rel=1e-5)
    # JSD_beta(P, Q) = JSD_{1-beta}(Q, P)
    assert float(generalized_jsd(b, ids, lp_a, m, beta=0.2)) == pytest.approx(
        float(generalized_jsd(a, ids, lp_b, m, beta=0.8)), rel=1e-5)
    assert float(generalized_jsd(b, ids, lp_a, m, beta=0.2)) != pytest.approx(
        float(generalized_jsd(a, ids, lp_b, m, beta=0.2)), rel=1e-3)


def test_a_forward_reverse_mix_is_not_called_jsd():
    """OSD's "jsd" (0.9 forward + 0.1 reverse KL) is asymmetric at any weight; the real JSD is not."""
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(4, 9, generator=g) * 3, torch.randn(4, 9, generator=g) * 3
    ids, lp_a, m = full(a)
    _, lp_b, _ = full(b)

    def mix(d, lp):
        return 0.9 * forward_kl(d, ids, lp, m) + 0.1 * reverse_kl(d, ids, lp, m)

    assert float(mix(b, lp_a)) != pytest.approx(float(mix(a, lp_b)), rel=1e-2)
    assert float(generalized_jsd(b, ids, lp_a, m)) != pytest.approx(float(mix(b, lp_a)), rel=1e-2)
    assert float(generalized_jsd(b, ids, lp_a, m)) <= math.log(2)
    assert float(mix(b, lp_a)) > math.log(2)     # unbounded, unlike a JSD


@pytest.mark.parametrize("name", LOSSES)
def test_zero_iff_equal(name):
    g = torch.Generator().manual_seed(5)
    a = torch.randn(3, 10, generator=g) * 2
    ids, lp, m = full(a)
    assert float(get_loss(name)(a, ids, lp, m)) == pytest.approx(0.0, abs=1e-6)
    assert float(get_loss(name)(a + 0.3 * torch.randn(3, 10, generator=g), ids, lp, m)) > 1e-4


def test_jsd_limits_are_the_scaled_kls_and_endpoints_are_refused():
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(3, 8, generator=g) * 2, torch.randn(3, 8, generator=g) * 2
    ids, lp, m = full(a)
    fkl, rkl = float(forward_kl(b, ids, lp, m)), float(reverse_kl(b, ids, lp, m))
    eps = 1e-4
    assert float(generalized_jsd(b, ids, lp, m, beta=eps)) / eps == pytest.approx(fkl, rel=2e-3)
    assert float(generalized_jsd(b, ids, lp, m, beta=1 - eps)) / eps == pytest.approx(rkl, rel=2e-3)
    for beta in (0.0, 1.0, -0.1, True):
        with pytest.raises(ValueError, match="beta"):
            generalized_jsd(b, ids, lp, m, beta=beta)


def test_one_minus_tvd_is_the_speculative_acceptance():
    g = torch.Generator().manual_seed(8)
    a, b = torch.randn(6, 11, generator=g) * 2, torch.randn(6, 11, generator=g) * 2
    ids, lp, m = full(a)
    p, q = torch.softmax(a, -1), torch.softmax(b, -1)
    alpha = torch.minimum(p, q).sum(-1).mean()
    assert 1 - float(tvd(b, ids, lp, m)) == pytest.approx(float(alpha), rel=1e-5)
    # (almost) disjoint supports: TVD -> 1
    ids1, lp1, m1 = full(torch.tensor([[30.0, 0.0, 0.0, 0.0]]))
    assert float(tvd(torch.tensor([[0.0, 0.0, 0.0, 30.0]]), ids1, lp1, m1)) == pytest.approx(1.0, abs=1e-6)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), scale=st.floats(0.1, 20.0), k=st.integers(1, 8), beta=st.floats(0.01, 0.99))
def test_bounds_hold_for_random_inputs(seed, scale, k, beta):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 8, generator=g) * scale
    lps, ids = torch.topk(torch.log_softmax(torch.randn(4, 8, generator=g) * scale, -1), k, dim=-1)
    m = torch.ones(4, dtype=torch.bool)
    h = -(beta * math.log(beta) + (1 - beta) * math.log(1 - beta))
    jsd = float(generalized_jsd(logits, ids, lps, m, beta=beta))
    assert -1e-6 <= jsd <= h + 1e-5 <= math.log(2) + 1e-5
    assert -1e-6 <= float(tvd(logits, ids, lps, m)) <= 1 + 1e-6
    assert float(forward_kl(logits, ids, lps, m)) >= -1e-6
    assert float(reverse_kl(logits, ids, lps, m)) >= -1e-6


@pytest.mark.parametrize("name", LOSSES)
def test_all_masked_gives_zero_with_a_gradient_path(name):
    logits, ids, lps, _ = random_case(9)
    lps = lps.clone()
    lps[1] = float("nan")                      # garbage in masked rows must not leak
    loss = get_loss(name)(logits, ids, lps, torch.zeros(logits.shape[0], dtype=torch.bool))
    assert float(loss.detach()) == 0.0
    loss.backward()
    assert torch.count_nonzero(logits.grad) == 0 and torch.isfinite(logits.grad).all()


def test_draft_mass_outside_the_topk_is_penalised():
    """The tail cell: raising a non-top-k logit moves draft mass away from the target's top-k."""
    target = torch.tensor([[4.0, 3.0, 0.0, 0.0, 0.0, 0.0]])
    lps, ids = torch.topk(torch.log_softmax(target, -1), 2, dim=-1)
    m = torch.ones(1, dtype=torch.bool)
    draft = torch.tensor([[4.0, 3.0, 0.0, 0.0, 0.0, 0.0]])
    for name in LOSSES:
        base = float(get_loss(name)(draft, ids, lps, m))
        worse = draft.clone()
        worse[0, 4] = 6.0
        assert float(get_loss(name)(worse, ids, lps, m)) > base + 1e-3, name


def test_target_with_support_inside_the_topk_gives_the_exact_kl():
    """A target whose top-k holds all its mass: the tail cell only carries the 1e-6 floor."""
    p = torch.tensor([[0.6, 0.3, 0.1, 0.0, 0.0]])
    lps, ids = torch.topk(torch.log(p), 3, dim=-1)
    draft = torch.randn(1, 5, generator=torch.Generator().manual_seed(1))
    q = torch.softmax(draft, -1)
    exact = float((p[0, :3] * (p[0, :3].log() - q[0, :3].log())).sum())
    assert float(forward_kl(draft, ids, lps, torch.ones(1, dtype=torch.bool))) == pytest.approx(exact, abs=1e-4)


def test_coarse_cells_are_distributions_and_invalid_ids_fall_into_the_tail():
    logits, ids, lps, _ = random_case(11)
    log_p, log_q = coarse_logprobs(logits, ids, lps)
    torch.testing.assert_close(log_p.exp().sum(-1), torch.ones(5), rtol=0, atol=1e-5)
    torch.testing.assert_close(log_q.exp().sum(-1), torch.ones(5), rtol=0, atol=1e-5)
    assert torch.isinf(log_p[0, 1]) and torch.isinf(log_q[0, 1])
    assert bool(torch.isinf(log_p[2, :-1]).all()) and float(log_p[2, -1]) == pytest.approx(0.0, abs=1e-6)


def test_bad_inputs_are_refused_with_a_clear_error():
    logits, ids, lps, mask = random_case(0)
    with pytest.raises(ValueError, match="draft_logits"):
        forward_kl(logits[0], ids, lps, mask)
    with pytest.raises(ValueError, match="target_ids"):
        forward_kl(logits, ids.float(), lps, mask)
    with pytest.raises(ValueError, match="target_logprobs"):
        forward_kl(logits, ids, lps[:, :2], mask)
    with pytest.raises(ValueError, match="mask"):
        forward_kl(logits, ids, lps, mask.long())
    with pytest.raises(ValueError, match=r"\[-1, 12\)"):
        forward_kl(logits, ids + 20, lps, mask)
    with pytest.raises(ValueError, match="unknown loss"):
        get_loss("osd_jsd")


@pytest.mark.parametrize("name", LOSSES)
def test_row_weights_give_the_weighted_mean_of_the_per_row_losses(name):
    """weight w: sum_r w_r loss_r / sum_r w_r over unmasked rows; integer weights equal repeating rows;
    all-ones weights equal no weights; bad weights are refused."""
    logits, ids, lps, _ = random_case(11)
    n = logits.shape[0]
    m = torch.ones(n, dtype=torch.bool)
    fn = get_loss(name)
    per_row = torch.stack([fn(logits[r:r + 1], ids[r:r + 1], lps[r:r + 1], m[:1]) for r in range(n)])
    w = torch.tensor([0.0, 1.0, 2.0, 3.0, 0.5])[:n]
    got = fn(logits, ids, lps, m, weight=w)
    assert float(got) == pytest.approx(float((per_row * w).sum() / w.sum()), rel=1e-5)
    rep = torch.tensor([1, 2, 2, 3, 3, 3])                      # rows 1, 2, 2, 3, 3, 3: weights 0, 1, 2, 3
    assert float(fn(logits, ids, lps, m, weight=w.clone().index_fill_(0, torch.tensor([4]), 0.0))) == \
        pytest.approx(float(fn(logits[rep], ids[rep], lps[rep], torch.ones(len(rep), dtype=torch.bool))), rel=1e-5)
    assert float(fn(logits, ids, lps, m, weight=torch.ones(n))) == pytest.approx(float(fn(logits, ids, lps, m)), rel=1e-6)
    masked = m.clone()
    masked[2] = False                                           # a masked row weighs nothing whatever its weight
    assert float(fn(logits, ids, lps, masked, weight=w)) == pytest.approx(
        float((per_row * w * masked).sum() / (w * masked).sum()), rel=1e-5)
    for bad in (torch.full((n,), -1.0), torch.ones(n + 1), torch.ones(n, dtype=torch.long)):
        with pytest.raises(ValueError, match="weight"):
            fn(logits, ids, lps, m, weight=bad)
