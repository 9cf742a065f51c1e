"""BiLD, Big Little Decoder (Kim et al. 2023), as in the LLMSpeculativeSampling fork's `BiLD_sampling`. LOSSY.

Convention: target = p (the "big" model), draft = q (the "little" model). Vocabulary as in `types.py`.

Two policies (Kim et al. 2023, "Speculative Decoding with Big Little Decoder"):

* Fallback (drafting side, the engine's job): the draft proposes one token at a time and hands over
  to the target as soon as its own confidence drops, max_v q(v) < fallback_threshold, or after gamma
  tokens. `bild_should_fallback` is that predicate, called by the engine after each draft token; the
  token that triggered it is KEPT and checked like the others (the fork's behaviour; the original
  discards it).
* Rollback (verification side, `bild_verify`): the target checks every draft token at once; the
  first position i with

      -log target_probs[i, x_i] > rollback_threshold

  is rolled back (num_accepted = i) and the next token is SAMPLED from the warped target at that
  position, target_probs[i] (the fork samples; the greedy original takes the argmax). If no token is
  rolled back, the bonus token is sampled from target_probs[gamma]. There is no residual
  correction, so the output is not distributed as the target.

Edge cases: rollback_threshold = inf keeps every draft token (even ones the target gives probability
0, whose -log is inf, not > inf); rollback_threshold = 0 rolls back every token the target gives
probability < 1, so the output is plain target sampling; fallback_threshold = 0 never falls back;
fallback_threshold > 1 always does (every draft token goes straight to the target). The fork's
published thresholds are (fallback, rollback) = (0.9, 3) for llama/cnndm, (0.9, 2) and (0.3, 2).

Randomness: exactly one categorical draw (`warp.sample`) from `generator`. `draft_probs` is
validated for shape and otherwise unused by the rollback test.
"""
from __future__ import annotations

import math

import torch

from serving.decoding.speculative import check_verify_inputs
from serving.decoding.types import VerifyResult
from serving.decoding.warp import sample


def _check_threshold(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise ValueError(f"{name} must be a number >= 0 (inf allowed), got {value!r}")
    return float(value)


def bild_should_fallback(
    draft_probs_row: torch.Tensor,   # [vocab] float: the draft distribution the last draft token came from
    fallback_threshold: float,
) -> bool:
    """True iff max_v draft_probs_row[v] < fallback_threshold: the draft is unsure, hand over to the target."""
    fallback_threshold = _check_threshold("fallback_threshold", fallback_threshold)
    if not isinstance(draft_probs_row, torch.Tensor) or draft_probs_row.dim() != 1 or draft_probs_row.numel() < 1:
        raise ValueError(f"draft_probs_row must be a tensor [vocab], got "
                         f"{getattr(draft_probs_row, 'shape', draft_probs_row)!r}")
    if not draft_probs_row.is_floating_point():
        raise ValueError(f"draft_probs_row must be a float tensor, got dtype {draft_probs_row.dtype}")
    return bool(float(draft_probs_row.max()) < fallback_threshold)


def bild_rollback_index(
    draft_tokens: torch.Tensor,   # [gamma] long
    target_probs: torch.Tensor,   # [gamma (+ 1), vocab] float
    rollback_threshold: float,
) -> int:
    """First i with -log target_probs[i, x_i] > rollback_threshold, or gamma if there is none."""
    gamma = draft_tokens.shape[0]
    if gamma == 0:
        return 0
    target_at = target_probs[:gamma].double().gather(-1, draft_tokens.long().to(target_probs.device).unsqueeze(-1))
    rolled_back = (-torch.log(target_at.squeeze(-1)) > rollback_threshold).nonzero()
    return int(rolled_back[0, 0]) if rolled_back.numel() else gamma


def bild_verify(
    draft_tokens: torch.Tensor,   # [gamma] long: the proposed tokens
    draft_probs: torch.Tensor,    # [gamma, vocab] float: unused beyond the shape check
    target_probs: torch.Tensor,   # [gamma + 1, vocab] float: warped target distribution at each position
    generator: torch.Generator | None = None,
    *,
    rollback_threshold: float = 3.0,
) -> VerifyResult:
    """Fork BiLD rollback (module docstring): num_accepted = `bild_rollback_index`,
    next_token ~ target_probs[num_accepted]."""
    gamma = check_verify_inputs(draft_tokens, draft_probs, target_probs)
    rollback_threshold = _check_threshold("rollback_threshold", rollback_threshold)
    num_accepted = bild_rollback_index(draft_tokens, target_probs, rollback_threshold) if gamma else 0
    return VerifyResult(num_accepted=num_accepted, next_token=int(sample(target_probs[num_accepted], generator)))
