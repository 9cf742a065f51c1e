"""Medusa's typical acceptance (Cai et al. 2024; FasterDecoding/Medusa `evaluate_posterior`). LOSSY.

Convention: target = p, draft = q. Vocabulary as in `types.py`.

For each draft token x_i (i = 0 .. gamma-1), with P_i = target_probs[i] and its entropy
H_i = -sum_v P_i(v) log P_i(v) (natural log, 0 log 0 = 0):

    accept x_i   iff   P_i(x_i) > min(posterior_threshold, posterior_alpha * exp(-H_i))      (strict)

num_accepted is the longest accepted prefix (Medusa's cumulative product along depth), and the next
token is the target's ARGMAX at position num_accepted (the recovered position, or the bonus position
gamma when everything was accepted). That is Medusa's `fast=True` path, the one `medusa_generate`
uses by default: a greedy bonus, not a sample. Ties in the argmax go to the lowest token id.

The rule looks only at the target; `draft_probs` is validated for shape and otherwise unused, and no
randomness is consumed (`generator` is accepted for the uniform rule signature). It is not
distribution-preserving: it accepts any token the target finds "typical enough", and always emits
the target's mode after it.

Differences from Medusa, on purpose:

* Medusa computes H with log(P + 1e-5) to dodge log 0; we use the exact entropy (torch.special.entr),
  which only differs by O(1e-5 * V) nats and makes the edge cases below exact.
* Medusa applies only a temperature to the logits before this test; we use `target_probs` as given,
  i.e. the engine's warped target (temperature, top-k, top-p), like every other rule here.

Defaults are Medusa's: posterior_threshold (epsilon) = 0.09, posterior_alpha (delta) = 0.3 ~ sqrt(eps).
Edge cases: both knobs 0 -> accept every token with P > 0; posterior_threshold >= 1 and
posterior_alpha >= vocab -> the bound is >= 1 (H <= log vocab), so nothing is accepted and the rule
is greedy target decoding; a one-hot target accepts exactly the tokens equal to its argmax.
"""
from __future__ import annotations

import math

import torch

from serving.decoding.speculative import check_verify_inputs
from serving.decoding.types import VerifyResult


def _check_knob(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return float(value)


def typical_thresholds(
    target_probs: torch.Tensor,   # [n, vocab] float
    posterior_threshold: float,
    posterior_alpha: float,
) -> torch.Tensor:
    """min(posterior_threshold, posterior_alpha * exp(-H)) per row, fp32 [n]; H = exact entropy (nats)."""
    entropy = torch.special.entr(target_probs.float()).sum(dim=-1)   # [n]
    return torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold)


def typical_verify(
    draft_tokens: torch.Tensor,   # [gamma] long: the proposed tokens
    draft_probs: torch.Tensor,    # [gamma, vocab] float: unused beyond the shape check
    target_probs: torch.Tensor,   # [gamma + 1, vocab] float: warped target distribution at each position
    generator: torch.Generator | None = None,
    *,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
) -> VerifyResult:
    """Typical acceptance (module docstring): longest prefix with target_probs[i, x_i] > threshold_i,
    then next_token = argmax target_probs[num_accepted]. Deterministic; `generator` is not used."""
    gamma = check_verify_inputs(draft_tokens, draft_probs, target_probs)
    posterior_threshold = _check_knob("posterior_threshold", posterior_threshold)
    posterior_alpha = _check_knob("posterior_alpha", posterior_alpha)
    num_accepted = gamma
    if gamma:
        rows = target_probs[:gamma].float()                                                  # [gamma, vocab]
        target_at = rows.gather(-1, draft_tokens.long().to(rows.device).unsqueeze(-1)).squeeze(-1)   # [gamma]
        accepted = target_at > typical_thresholds(rows, posterior_threshold, posterior_alpha)
        num_accepted = int(accepted.long().cumprod(0).sum())
    return VerifyResult(num_accepted=num_accepted, next_token=int(target_probs[num_accepted].argmax()))
