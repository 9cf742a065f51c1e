"""Distillation losses between a draft and a target known only through its top-k (pure torch, fp32, masked).

Notation: P = target distribution, Q = draft distribution (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding"; the divergences as in Agarwal et al. 2024, "On-Policy Distillation
of Language Models"). Every loss takes

    draft_logits      [N, V]  draft logits (or log-probabilities: log_softmax is applied, which leaves
                              log-probabilities unchanged) over the draft's vocabulary: the full
                              vocabulary or the draft's restricted output vocabulary (draftsmith.json)
    target_ids        [N, k]  long: column index into that vocabulary of each target top-k entry;
                              -1 = a target token the draft cannot emit (outside its output vocabulary)
    target_logprobs   [N, k]  RAW (temperature-1, unwarped) target log-softmax values of those entries,
                              as the replay buffer stores them
    mask              [N]     bool: rows that count
    weight            [N]     optional, float >= 0: each row's weight (training/distill.py, "Acceptance
                              weighting"); None = every row counts once

and returns the (weighted) mean of the per-row divergence over the unmasked rows (0 when every row is
masked or weighs nothing, still attached to the graph so `backward()` works and gives zero gradients).

**Mass outside the top-k: one "tail" cell.** The target is known on its top-k tokens only, so both
distributions are compared on the partition {each target top-k token the draft can emit} ∪ {tail =
every other token}:

    P_j = exp(target_logprobs_j)           for the valid top-k entries j (exact raw target mass)
    P_tail = max(1 - sum_j P_j, 1e-6)      the target's mass outside them; floored because fp16
                                           storage can make the top-k sum reach 1, and renormalised
                                           with the P_j so the k+1 cells sum to 1
    Q_j = softmax(draft_logits)[id_j]      from the draft's FULL (output-vocabulary) softmax
    Q_tail = 1 - sum_j Q_j                 (= logsumexp of the non-top-k logits - logsumexp of all)

Each loss is the exact divergence between these (k+1)-cell distributions, which by the data
processing inequality is a lower bound on the divergence over the full vocabulary; it is exact
when neither model spreads its tail differently. Draft mass outside the target's top-k is therefore
penalised (it must match the target's tail mass, which is small), the target is *not* renormalised
over its top-k (no bias from dropping its tail), and every divergence stays finite: the reverse KL
over a renormalised top-k would be +inf as soon as the draft puts any mass outside it. Target
entries the draft cannot emit (id -1) fall into the tail cell. If the draft vocabulary has no
token outside the top-k (only in toy set-ups), the tail cell is dropped and P renormalised over the
top-k.

**No warp.** Losses use the raw temperature-1 distributions. The records store raw target
log-probs; serving warps both models with the *same* temperature/top-k/top-p, so a draft that
matches the raw target matches every warp of it, and training on one warp would weight the
sampling settings of whatever traffic happened to be logged. The offline acceptance estimate
(training/distill.py) does apply each record's warp.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

TAIL_FLOOR = 1e-6


def _check(draft_logits: torch.Tensor, target_ids: torch.Tensor, target_logprobs: torch.Tensor,
           mask: torch.Tensor) -> None:
    if draft_logits.dim() != 2 or not draft_logits.is_floating_point():
        raise ValueError(f"draft_logits must be a float tensor [N, V], got {tuple(draft_logits.shape)} "
                         f"{draft_logits.dtype}")
    n, v = draft_logits.shape
    if target_ids.dim() != 2 or target_ids.shape[0] != n or target_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"target_ids must be an integer tensor [N={n}, k], got {tuple(target_ids.shape)} "
                         f"{target_ids.dtype}")
    if target_logprobs.shape != target_ids.shape:
        raise ValueError(f"target_logprobs must have target_ids' shape {tuple(target_ids.shape)}, "
                         f"got {tuple(target_logprobs.shape)}")
    if mask.shape != (n,) or mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor [N={n}], got {tuple(mask.shape)} {mask.dtype}")
    if n and (int(target_ids.min()) < -1 or int(target_ids.max()) >= v):
        raise ValueError(f"target_ids must be in [-1, {v}) (-1 = outside the draft vocabulary)")


def coarse_logprobs(draft_logits: torch.Tensor, target_ids: torch.Tensor,
                    target_logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log P, log Q), each [N, k+1] fp32: the top-k cells then the tail cell (module docstring).

    Cells of target entries outside the draft vocabulary (id -1) are -inf in both (their mass is in
    the tail). Only log Q carries gradients.
    """
    logits = draft_logits.float()
    n, v = logits.shape
    valid = target_ids >= 0                                               # [N, k]
    idx = torch.where(valid, target_ids.long(), torch.full_like(target_ids.long(), v))
    neg_inf = torch.tensor(float("-inf"), device=logits.device)

    log_q_all = torch.log_softmax(logits, dim=-1)                         # [N, V]
    padded = torch.cat([log_q_all, log_q_all.new_full((n, 1), float("-inf"))], dim=1)   # column V: dummy
    log_q_top = torch.where(valid, padded.gather(1, idx), neg_inf)       # [N, k]
    tail_logits = padded.scatter(1, idx, float("-inf"))                   # top-k (and dummy) removed
    has_tail = torch.isfinite(tail_logits).any(dim=-1)                    # [N]
    safe = torch.where(has_tail[:, None], tail_logits, torch.zeros_like(tail_logits))   # no NaN gradients
    log_q_tail = torch.where(has_tail, torch.logsumexp(safe, dim=-1), neg_inf)

    with torch.no_grad():
        lp = torch.where(valid, target_logprobs.float(), neg_inf)
        p_top = lp.exp()
        p_tail = torch.clamp(1.0 - p_top.sum(-1), min=TAIL_FLOOR)
        p_tail = torch.where(has_tail, p_tail, torch.zeros_like(p_tail))
        log_z = torch.log(p_top.sum(-1) + p_tail)                         # renormalise the k+1 cells
        log_p = torch.cat([lp, torch.log(p_tail)[:, None]], dim=1) - log_z[:, None]
    log_q = torch.cat([log_q_top, log_q_tail[:, None]], dim=1)
    return log_p, log_q


def _cells(draft_logits, target_ids, target_logprobs, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked inputs -> coarse_logprobs, with masked rows replaced by zeros first (so NaN/inf in
    rows that do not count cannot reach the value or the gradient)."""
    _check(draft_logits, target_ids, target_logprobs, mask)
    keep = mask[:, None]
    logits = torch.where(keep, draft_logits.float(), torch.zeros((), device=draft_logits.device))
    lps = torch.where(keep, target_logprobs.float(), torch.zeros((), device=target_logprobs.device))
    return coarse_logprobs(logits, target_ids, lps)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(A || B) = sum_c A_c (log A_c - log B_c) per row, with 0 log 0 = 0 (no NaN, no NaN gradients)."""
    a = log_a.exp()
    diff = torch.where(a > 0, log_a - log_b, torch.zeros_like(log_a))
    return (a * diff).sum(-1)


def _reduce(per_row: torch.Tensor, mask: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """(Weighted) mean over unmasked rows; 0 (with a gradient path) when all are masked or weigh nothing;
    masked rows may hold inf/NaN."""
    kept = torch.where(mask, per_row, torch.zeros_like(per_row))
    if weight is None:
        return kept.sum() / mask.sum().clamp(min=1)
    if weight.shape != mask.shape or not weight.is_floating_point():
        raise ValueError(f"weight must be a float tensor [N={mask.shape[0]}], got {tuple(weight.shape)} {weight.dtype}")
    w = torch.where(mask, weight.to(per_row.dtype), torch.zeros_like(per_row))
    if bool((w < 0).any()) or not bool(torch.isfinite(w).all()):
        raise ValueError("row weights must be finite and >= 0")
    return (kept * w).sum() / w.sum().clamp(min=1e-12)


def forward_kl(draft_logits: torch.Tensor, target_ids: torch.Tensor, target_logprobs: torch.Tensor,
               mask: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Forward KL(P || Q) = sum_c P_c (log P_c - log Q_c) (mode-covering; OSD's default)."""
    log_p, log_q = _cells(draft_logits, target_ids, target_logprobs, mask)
    return _reduce(_kl(log_p, log_q), mask, weight)


def reverse_kl(draft_logits: torch.Tensor, target_ids: torch.Tensor, target_logprobs: torch.Tensor,
               mask: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Reverse KL(Q || P) = sum_c Q_c (log Q_c - log P_c) (mode-seeking)."""
    log_p, log_q = _cells(draft_logits, target_ids, target_logprobs, mask)
    return _reduce(_kl(log_q, log_p), mask, weight)


def generalized_jsd(draft_logits: torch.Tensor, target_ids: torch.Tensor, target_logprobs: torch.Tensor,
                    mask: torch.Tensor, beta: float = 0.5, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Generalized Jensen-Shannon divergence of GKD (Agarwal et al., Eq. 1; TRL's current trainer):

        M = beta * P + (1 - beta) * Q
        JSD_beta = beta * KL(P || M) + (1 - beta) * KL(Q || M)

    beta = 0.5 is the symmetric JSD, bounded by ln 2 (by the binary entropy h(beta) in general);
    JSD_beta(P, Q) = JSD_{1-beta}(Q, P). Only 0 < beta < 1 is accepted: at the endpoints M equals one
    of the two distributions and the formula is identically 0. The limits are the KLs, scaled:
    JSD_beta / beta -> KL(P || Q) (forward_kl) as beta -> 0 and JSD_beta / (1 - beta) -> KL(Q || P)
    (reverse_kl) as beta -> 1. (OSD's "jsd", 0.9 * forward + 0.1 * reverse KL, is not a JSD.)
    """
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not (0.0 < beta < 1.0):
        raise ValueError(f"beta must be in (0, 1) (use forward_kl / reverse_kl for the KL limits), got {beta!r}")
    log_p, log_q = _cells(draft_logits, target_ids, target_logprobs, mask)
    log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log(1.0 - beta)]), dim=0)
    per_row = beta * _kl(log_p, log_m) + (1.0 - beta) * _kl(log_q, log_m)
    return _reduce(per_row, mask, weight)


def tvd(draft_logits: torch.Tensor, target_ids: torch.Tensor, target_logprobs: torch.Tensor,
        mask: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Total variation distance TVD = 0.5 * sum_c |P_c - Q_c| in [0, 1] (DistillSpec). Per row,
    1 - TVD = sum_c min(P_c, Q_c) is the acceptance rate of speculative sampling at temperature 1
    (over the k+1 cells: an upper bound on the full-vocabulary acceptance)."""
    log_p, log_q = _cells(draft_logits, target_ids, target_logprobs, mask)
    return _reduce(0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1), mask, weight)


LossFn = Callable[..., torch.Tensor]      # (draft_logits, target_ids, target_logprobs, mask, weight=None)
LOSSES = ("forward_kl", "reverse_kl", "jsd", "tvd")


def get_loss(name: str, beta: float = 0.5) -> LossFn:
    """A loss by name: forward_kl, reverse_kl, jsd (generalized_jsd with `beta`), tvd."""
    if name == "forward_kl":
        return forward_kl
    if name == "reverse_kl":
        return reverse_kl
    if name == "jsd":
        if not (0.0 < beta < 1.0):
            raise ValueError(f"jsd beta must be in (0, 1), got {beta!r}")
        return lambda d, i, lp, m, weight=None: generalized_jsd(d, i, lp, m, beta=beta, weight=weight)
    if name == "tvd":
        return tvd
    raise ValueError(f"unknown loss {name!r}; choose one of {', '.join(LOSSES)}")
