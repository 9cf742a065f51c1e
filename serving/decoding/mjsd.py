"""MJSD / MTAD verification and the draft's beam sampler (Qin et al. 2024, "Multi-Token Joint Speculative
Decoding for Accelerating Large Language Model Inference", arXiv 2407.09722).

Convention: target = p, draft = q. Algorithm 1 (paper, Appendix A), one iteration:

    1. The draft proposes gamma tokens x_1..x_gamma by *beam sampling* (`beam_sample_step` run gamma
       times, then the best beam by joint draft log-probability, `beam_sample_finalize`).
    2. One target forward gives target_probs rows 0..gamma.
    3. For every prefix length i = 1..gamma, with the joint probabilities along the chosen beam
           draft joint   q(x_1:i) = prod_{k<=i} draft_probs[k-1, x_k]
           target joint  p(x_1:i) = prod_{k<=i} target_probs[k-1, x_k]
       the prefix *passes* iff min(1, p(x_1:i) / q(x_1:i)) > tau. Accept the LONGEST passing prefix
       (a shorter prefix may fail while a longer one passes; there is no break).
    4. Sample one token from target_probs[num_accepted] (the recovered token, or the bonus token when
       num_accepted == gamma) - a plain target sample with NO residual correction.

This rule is LOSSY by design: the output is not distributed as the target (it approximates the
target's multi-token joint *mode*, the paper's MJGD). Do not use it where exactness is required.

Choices, where the paper and the published code (ZongyueQin/LLMSpeculativeSampling, branch
`multipath`, `mjsd_speculative_sampling`) differ; we follow the paper:

* Threshold: strict `>` as Algorithm 1 line 10 (the code uses `tau <= min(1, ratio)`). tau <= 0
  accepts all gamma tokens unconditionally (the code's `tau < 0` special case, extended to tau = 0,
  as the paper's tau = 0 discussion describes: "generating gamma tokens using beam decoding with the
  small model, then generating an additional token with the large model"). tau >= 1 accepts none.
* Algorithm 1 line 11 writes `eta <- j` (j is the token id); the intended `eta <- i` (prefix
  length) is what we implement.
* q(x_1:i) is the true draft joint of the chosen beam, built from the draft's *warped* probabilities
  (same temperature/top-k/top-p as the target), in log space. The code instead uses a
  candidate-set-normalised beam probability that is not re-indexed by parent beam and carries a
  1/num_beams factor at step 1, and its draft ignores temperature.
  With draft == target our ratio is exactly 1, so every prefix passes for any tau < 1.
* A draft probability of 0 on the beam makes that prefix (and, since the joint stays 0, every longer
  one) fail, instead of dividing by zero. A beam sampled from the draft never contains such a token.
* Beam sampling starts from ONE live beam (score 0) rather than num_beams identical copies, which
  avoids the code's duplicate-beam quirk at step 1 (tests/serving/test_mjsd_rule.py).

Randomness: `mjsd_verify` makes exactly one categorical draw from `generator`; `beam_sample_step`
draws one float64 uniform per finite candidate.
"""
from __future__ import annotations

import math

import torch

from serving.decoding.speculative import check_verify_inputs
from serving.decoding.types import VerifyResult
from serving.decoding.warp import sample


def joint_log_ratios(
    draft_tokens: torch.Tensor,   # [gamma] long
    draft_probs: torch.Tensor,    # [gamma, vocab] float
    target_probs: torch.Tensor,   # [gamma + 1, vocab] float
) -> torch.Tensor:
    """log p(x_1:i) - log q(x_1:i) for i = 1..gamma, fp64 [gamma] (-inf where the draft joint is 0)."""
    gamma = check_verify_inputs(draft_tokens, draft_probs, target_probs)
    rows = torch.arange(gamma, device=draft_probs.device)
    tokens = draft_tokens.long().to(draft_probs.device)
    log_draft = torch.cumsum(draft_probs.double()[rows, tokens].log(), dim=0)
    log_target = torch.cumsum(target_probs.double()[rows, tokens].log(), dim=0)
    diff = log_target - log_draft
    # draft joint 0 -> the prefix fails (diff would be +inf or NaN); see module docstring.
    return torch.where(torch.isneginf(log_draft), torch.full_like(diff, float("-inf")), diff)


def mjsd_verify(
    draft_tokens: torch.Tensor,   # [gamma] long: the chosen beam's tokens
    draft_probs: torch.Tensor,    # [gamma, vocab] float: warped draft distribution at each beam position
    target_probs: torch.Tensor,   # [gamma + 1, vocab] float: warped target distribution at each position
    generator: torch.Generator | None = None,
    *,
    tau: float = 0.1,
) -> VerifyResult:
    """Accept the longest prefix with min(1, p(x_1:i)/q(x_1:i)) > tau, then sample target_probs[num_accepted].

    See the module docstring for the formula and every convention. Lossy by design.
    """
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or math.isnan(tau):
        raise ValueError(f"tau must be a number, got {tau!r}")
    gamma = check_verify_inputs(draft_tokens, draft_probs, target_probs)
    if tau <= 0:
        num_accepted = gamma
    elif tau >= 1 or gamma == 0:
        num_accepted = 0
    else:
        # min(1, r) > tau  <=>  r > tau  (tau < 1)  <=>  log r > log tau
        passing = (joint_log_ratios(draft_tokens, draft_probs, target_probs) > math.log(tau)).nonzero()
        num_accepted = int(passing[-1, 0]) + 1 if passing.numel() else 0
    next_token = sample(target_probs[num_accepted].float(), generator)
    return VerifyResult(num_accepted=num_accepted, next_token=int(next_token))


def beam_sample_step(
    beam_logq: torch.Tensor,       # [B] joint warped draft log q of each live beam (step 1: tensor([0.]))
    step_logprobs: torch.Tensor,   # [B, vocab] warped draft log-probs of each beam's next token
    num_beams: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of beam *sampling*: draw distinct (beam, token) pairs without replacement.

    Candidates are all (b, t) with finite score s(b, t) = beam_logq[b] + step_logprobs[b, t].
    Draws B' = min(num_beams, #finite candidates) distinct pairs by sequential sampling without
    replacement with probability proportional to exp(s), implemented with the Gumbel-top-k trick
    (top B' of s + Gumbel noise, Kool et al. 2019), which has exactly that distribution.

    Returns (parent_beam [B'] long, token [B'] long, new_logq [B'] fp32 = s(parent, token)), in
    sampling order (not sorted; use `beam_sample_finalize`). ValueError if no candidate is finite.
    """
    if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1:
        raise ValueError(f"num_beams must be an integer >= 1, got {num_beams!r}")
    if not isinstance(beam_logq, torch.Tensor) or beam_logq.dim() != 1 or beam_logq.shape[0] < 1:
        raise ValueError(f"beam_logq must be [B] with B >= 1, got {getattr(beam_logq, 'shape', beam_logq)!r}")
    if not isinstance(step_logprobs, torch.Tensor) or step_logprobs.dim() != 2 \
            or step_logprobs.shape[0] != beam_logq.shape[0] or step_logprobs.shape[1] < 1:
        raise ValueError(f"step_logprobs must be [B, vocab] = [{beam_logq.shape[0]}, vocab], got shape "
                         f"{tuple(getattr(step_logprobs, 'shape', ()))}")
    if not (beam_logq.is_floating_point() and step_logprobs.is_floating_point()):
        raise ValueError("beam_logq and step_logprobs must be float tensors")
    vocab = step_logprobs.shape[1]
    scores = (beam_logq.float()[:, None] + step_logprobs.float()).reshape(-1)
    top = float(scores.max())   # NaN propagates through max
    if math.isnan(top) or top == float("inf"):
        raise ValueError("beam_logq and step_logprobs must not contain NaN or +inf (use -inf for excluded tokens)")
    finite = scores > float("-inf")
    num_finite = int(finite.sum())
    if num_finite == 0:
        raise ValueError("no finite (beam, token) candidate to sample from")
    # [C] flat indices b * vocab + t of the finite candidates (all of them when nothing is filtered)
    candidates = None if num_finite == scores.numel() else finite.nonzero().squeeze(1)
    k = min(num_beams, num_finite)
    uniforms = torch.rand(num_finite, dtype=torch.float64, generator=generator, device=scores.device)
    gumbel = -torch.log(-torch.log(uniforms.clamp_min(torch.finfo(torch.float64).tiny)))
    keys = (scores if candidates is None else scores[candidates]).double() + gumbel
    chosen = torch.topk(keys, k, sorted=True).indices
    if candidates is not None:
        chosen = candidates[chosen]
    return chosen // vocab, chosen % vocab, scores[chosen]


def beam_sample_finalize(
    beam_logq: torch.Tensor,   # [B] joint warped draft log q of each beam after the last step
) -> torch.Tensor:
    """Order of the beams by joint draft log q, descending (stable: ties keep sampling order). long [B]."""
    if not isinstance(beam_logq, torch.Tensor) or beam_logq.dim() != 1 or not beam_logq.is_floating_point():
        raise ValueError(f"beam_logq must be a float tensor [B], got {getattr(beam_logq, 'shape', beam_logq)!r}")
    return torch.argsort(beam_logq, descending=True, stable=True)
