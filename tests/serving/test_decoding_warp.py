"""serving/decoding/warp.py: temperature / top-k / top-p warping and exact categorical sampling.

The fast path is checked against `reference_warp`, a per-row loop that follows the definition
literally (sort, keep k, renormalise, keep while the mass before a token is < top_p).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from serving.decoding import warp
from serving.decoding.warp import sample, warp_logprobs, warp_probs

NEG_INF = float("-inf")


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value of observed counts against probabilities (cells with prob 0 dropped)."""
    probs = np.asarray(probs, dtype=np.float64)
    keep = probs > 0
    expected = probs[keep] / probs[keep].sum() * counts[keep].sum()
    return float(chisquare(counts[keep], expected).pvalue)


def reference_warp(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Slow, obviously correct fp64 reference for one or more rows [..., vocab]."""
    rows = logits.double().reshape(-1, logits.shape[-1])
    out = torch.full_like(rows, NEG_INF)
    for r, row in enumerate(rows):
        finite = [i for i in range(len(row)) if math.isfinite(row[i].item())]
        if temperature == 0 or top_k == 1:
            best = max(finite, key=lambda i: (row[i].item(), -i))   # largest value, lowest id on ties
            out[r, best] = 0.0
            continue
        order = sorted(finite, key=lambda i: -row[i].item())
        if top_k:
            order = order[:top_k]
        z = {i: row[i].item() / temperature for i in order}
        norm = math.log(sum(math.exp(v) for v in z.values()))
        kept, before = [], 0.0
        for i in order:
            if top_p < 1.0 and before >= top_p:
                break
            kept.append(i)
            before += math.exp(z[i] - norm)
        norm_kept = math.log(sum(math.exp(z[i]) for i in kept))
        for i in kept:
            out[r, i] = z[i] - norm_kept
    return out.reshape(logits.shape)


def assert_same_warp(fast: torch.Tensor, slow: torch.Tensor) -> None:
    assert fast.dtype == torch.float32
    assert torch.equal(torch.isinf(fast), torch.isinf(slow.float())), "different supports"
    finite = torch.isfinite(fast)
    torch.testing.assert_close(fast[finite].double(), slow[finite], atol=2e-5, rtol=0)


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8), (0.6, 7, 0.9), (1.0, 3, 0.5),
    (2.0, 30, 0.95), (0.0, 0, 1.0), (0.5, 1, 1.0), (1.0, 40, 1.0),
])
def test_matches_reference_on_random_logits(temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(1234 + top_k)
    logits = torch.randn(3, 4, 32, generator=gen) * 2.5
    assert_same_warp(warp_logprobs(logits, temperature, top_k, top_p), reference_warp(logits, temperature, top_k, top_p))


@pytest.mark.parametrize("peaked", [True, False])
def test_top_p_without_top_k_on_a_large_vocab(peaked):
    """Both branches of the TOP_P_PROBE shortcut: a peaked row (kept set inside the probe) and a flat
    row (probe holds < top_p of the mass, so the full sort runs)."""
    vocab = warp.TOP_P_PROBE * 3
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(2, vocab, generator=gen) * (6.0 if peaked else 0.3)
    probe_mass = torch.softmax(logits, -1).topk(warp.TOP_P_PROBE, dim=-1).values.sum(-1)
    assert bool((probe_mass >= 0.9).all()) == peaked   # the case really exercises the intended branch
    assert_same_warp(warp_logprobs(logits, 1.0, 0, 0.9), reference_warp(logits, 1.0, 0, 0.9))


def test_temperature_only_is_scaled_log_softmax():
    logits = torch.tensor([[2.0, 0.5, -1.0, 3.0]])
    for temperature in (0.25, 1.0, 4.0):
        expected = torch.log_softmax(logits / temperature, dim=-1)
        torch.testing.assert_close(warp_logprobs(logits, temperature, 0, 1.0), expected)
    # lower temperature = sharper distribution
    assert warp_probs(logits, 0.25, 0, 1.0)[0, 3] > warp_probs(logits, 4.0, 0, 1.0)[0, 3]


def test_top_k_keeps_the_k_largest_and_renormalises():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.5, 0.7])
    probs = warp_probs(logits, 1.0, 2, 1.0)
    assert torch.nonzero(probs).flatten().tolist() == [1, 3]
    expected = torch.softmax(torch.tensor([2.0, 1.5]), dim=0)
    torch.testing.assert_close(probs[[1, 3]], expected)


def test_top_p_keeps_the_crossing_token():
    probs_in = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs_in.log()
    # mass before each sorted token: 0, 0.5, 0.8, 0.95
    cases = {0.45: [0], 0.6: [0, 1], 0.79: [0, 1], 0.81: [0, 1, 2], 0.99: [0, 1, 2, 3]}
    for top_p, kept in cases.items():
        out = warp_probs(logits, 1.0, 0, top_p)
        assert torch.nonzero(out).flatten().tolist() == kept, top_p
        torch.testing.assert_close(out[kept], probs_in[kept] / probs_in[kept].sum())


def test_top_p_is_applied_after_top_k_on_the_renormalised_top_k_set():
    probs_in = torch.tensor([0.4, 0.3, 0.2, 0.1])
    # top-2 renormalised: [4/7, 3/7]. With top_p = 0.5 the mass before token 1 is 4/7 >= 0.5, so token 1
    # is dropped; measured against the un-renormalised distribution (0.4 < 0.5) it would be kept.
    out = warp_probs(probs_in.log(), 1.0, 2, 0.5)
    assert torch.nonzero(out).flatten().tolist() == [0]


def test_tiny_top_p_keeps_at_least_one_token():
    logits = torch.randn(5, 10, generator=torch.Generator().manual_seed(3))
    out = warp_probs(logits, 1.0, 0, 1e-9)
    assert torch.equal((out > 0).sum(-1), torch.ones(5, dtype=torch.long))
    assert torch.equal(out.argmax(-1), logits.argmax(-1))


def test_greedy_is_one_hot_on_argmax_with_lowest_id_on_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, -2.0, 4.0, 4.9]])
    for temperature, top_k in ((0.0, 0), (0.0, 5), (0.8, 1)):
        out = warp_logprobs(logits, temperature, top_k, 0.9)
        assert out[0].tolist() == [NEG_INF, 0.0, NEG_INF, NEG_INF]
        assert out[1].tolist() == [0.0, NEG_INF, NEG_INF, NEG_INF]


def test_overflowing_temperature_falls_back_to_greedy():
    logits = torch.tensor([1.0, 30.0, 2.0])
    out = warp_probs(logits, 1e-40, 0, 1.0)
    assert out.tolist() == [0.0, 1.0, 0.0]


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.0, 0, 0.9),
                                                     (1.0, 10, 0.9), (0.0, 0, 1.0)])
def test_minus_inf_inputs_stay_minus_inf(temperature, top_k, top_p):
    logits = torch.tensor([[0.5, NEG_INF, 2.0, NEG_INF, -1.0, 0.0],
                           [NEG_INF, NEG_INF, NEG_INF, NEG_INF, 1.0, NEG_INF]])
    out = warp_logprobs(logits, temperature, top_k, top_p)
    assert bool(torch.isneginf(out[torch.isneginf(logits)]).all())
    torch.testing.assert_close(out.exp().sum(-1), torch.ones(2))
    assert out[1, 4].item() == 0.0   # the only emittable token takes all the mass


def test_output_is_fp32_distribution_for_low_precision_input():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out = warp_probs(logits, 0.9, 10, 0.9)
    assert out.dtype == torch.float32 and out.shape == (3, 50)
    torch.testing.assert_close(out.sum(-1), torch.ones(3))


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-1), "top_k"), (dict(top_k=2.0), "top_k"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
])
def test_bad_arguments_raise(kwargs, match):
    args = dict(temperature=1.0, top_k=0, top_p=1.0) | kwargs
    with pytest.raises(ValueError, match=match):
        warp_logprobs(torch.zeros(4), **args)


@pytest.mark.parametrize("row", [[NEG_INF, NEG_INF], [0.0, float("nan")], [float("inf"), 0.0]])
def test_rows_without_a_finite_maximum_raise(row):
    with pytest.raises(ValueError, match="finite maximum"):
        warp_logprobs(torch.tensor([[0.0, 1.0], row]), 1.0, 0, 1.0)
    with pytest.raises(ValueError, match="floating"):
        warp_logprobs(torch.zeros(3, dtype=torch.long), 1.0, 0, 1.0)


def test_sample_matches_the_distribution_chi_square():
    """1e5 draws of a 5-way categorical with one zero entry. Seeded, so deterministic; the threshold
    p > 1e-3 would fail a correct sampler for only 0.1% of seeds."""
    probs = torch.tensor([0.1, 0.0, 0.45, 0.3, 0.15])
    gen = torch.Generator().manual_seed(11)
    draws = sample(probs.expand(100_000, 5), gen)
    counts = np.bincount(draws.numpy(), minlength=5)
    assert counts[1] == 0
    assert chi_square_pvalue(counts, probs.numpy()) > 1e-3


def test_sample_negative_control_detects_a_wrong_distribution():
    """The chi-square above has power: draws from a slightly different distribution are rejected."""
    gen = torch.Generator().manual_seed(11)
    draws = sample(torch.tensor([0.12, 0.0, 0.43, 0.3, 0.15]).expand(100_000, 5), gen)
    counts = np.bincount(draws.numpy(), minlength=5)
    assert chi_square_pvalue(counts, np.array([0.1, 0.0, 0.45, 0.3, 0.15])) < 1e-3


def test_sample_one_hot_rows_shapes_and_seeding():
    one_hot = torch.zeros(2, 3, 7)
    one_hot[..., 4] = 1.0
    one_hot[1, 2] = 0.0
    one_hot[1, 2, 6] = 0.25   # unnormalised weights are fine
    draws = sample(one_hot, torch.Generator().manual_seed(0))
    assert draws.shape == (2, 3) and draws.dtype == torch.long
    assert draws.tolist() == [[4, 4, 4], [4, 4, 6]]
    probs = torch.softmax(torch.randn(50, 9), -1)
    first = sample(probs, torch.Generator().manual_seed(5))
    assert torch.equal(first, sample(probs, torch.Generator().manual_seed(5)))


@pytest.mark.parametrize("row,match", [([0.0, 0.0, 0.0], "positive mass"), ([0.5, -0.1, 0.6], "non-negative"),
                                       ([0.5, float("nan"), 0.5], "non-negative"),
                                       ([float("inf"), 0.0, 1.0], "finite")])
def test_sample_rejects_rows_without_valid_mass(row, match):
    with pytest.raises(ValueError, match=match):
        sample(torch.tensor([[0.2, 0.3, 0.5], row]))
