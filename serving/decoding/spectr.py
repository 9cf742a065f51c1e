"""SpecTr K-SEQ (Sun et al. 2023, "SpecTr: Fast Speculative Decoding via Optimal Transport"). LOSSLESS.

Convention: target = p, draft = q in this docstring. SpecTr's paper uses the OPPOSITE letters
(p = draft, q = target): its beta_pq(rho) = sum_x min(p(x), q(x) / rho) is sum_x min(q(x), p(x) / rho)
here. In code: `draft_*` / `target_*`. Vocabulary as in `types.py`. Source: the paper's K-SEQ algorithm;
tests/serving/test_rule_spectr.py checks the emitted distribution exactly.

One position, k candidates X_1..X_k drawn iid from the draft q:

    beta(rho)  = sum_x min(q(x), p(x) / rho)
    rho*       = the root in [1, k] of  1 - (1 - beta(rho))^k = rho * beta(rho)   (rho* = 1 for k = 1)
    for i = 1..k:  accept X_i  iff  U_i < min(1, p(X_i) / (rho* q(X_i)))          (first accepted wins)
    none accepted: sample the residual
        p_res(x) = [p(x) - min(q(x), p(x) / rho*) (1 - (1 - beta)^k) / beta] / (1 - beta)^k

The emitted token is distributed exactly as p, P(accept) = 1 - (1 - beta(rho*))^k is at least the
single-draft beta = sum_x min(p, q) and grows with k, and p_res >= 0 exactly when
1 - (1 - beta)^k <= rho beta, which holds at rho* (we keep the end of the root bracket on that side).
The left side of the equation decreases in rho and the right side increases, so the root is unique.
For k = 1 every piece is the speculative-sampling one (rho* = 1, the residual is
speculative.recovery_probs), so `kseq_select` with one candidate makes the same decision and the same
draw as `speculative_verify` with gamma = 1 for the same generator state.

Sequence level (`spectr_verify`, the paper's draft-tree extension of K-SEQ): k iid draft CHAINS of length
gamma from the same prefix form a tree. At depth i the live chains (those equal to the accepted prefix so
far) have next tokens that are iid draft samples given that prefix, so K-SEQ over them emits a token distributed as
the target given the prefix: if it accepts a candidate, keep only the chains whose next token equals
it and go one deeper; if not, its residual sample is the recovered token and the step ends. If every
depth accepts, the bonus token comes from the target at the end of a surviving chain. By induction
the emitted tokens follow the target exactly. (The "longest of independently verified drafts" rule -
speculative sampling on each chain, keep the longest - is NOT this and is biased; the tests show it.)

Numerics: rho* by bisection in fp64 (to the last bit, |equation| ~ 1e-15); acceptance ratios in fp32
as speculative.acceptance_probs; the residual in fp64, falling back to the target row when rounding
leaves it mass <= speculative.RESIDUAL_MIN_MASS (total-variation cost at most that mass).

Randomness per K-SEQ position, in this order: one vectorised draw of k fp32 uniforms, then, only if
no candidate is accepted, one categorical draw (`warp.sample`); `spectr_verify` adds one draw for the
bonus token when every depth accepted.
"""
from __future__ import annotations

import math

import torch

from serving.decoding.speculative import RESIDUAL_MIN_MASS, recovery_probs
from serving.decoding.types import VerifyResult
from serving.decoding.warp import sample


def _check_row_pair(draft_row: torch.Tensor, target_row: torch.Tensor) -> None:
    for name, row in (("draft_row", draft_row), ("target_row", target_row)):
        if not isinstance(row, torch.Tensor) or row.dim() != 1 or row.numel() < 1:
            raise ValueError(f"{name} must be a tensor [vocab], got {getattr(row, 'shape', row)!r}")
        if not row.is_floating_point():
            raise ValueError(f"{name} must be a float tensor, got dtype {row.dtype}")
    if draft_row.shape != target_row.shape:
        raise ValueError(f"draft_row {tuple(draft_row.shape)} and target_row {tuple(target_row.shape)} differ")


def _check_k(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k (number of candidates) must be an integer >= 1, got {k!r}")
    return k


def _normalised(row: torch.Tensor, name: str) -> torch.Tensor:
    row = row.double()
    total = float(row.sum())
    if not (float(row.min()) >= 0.0 and math.isfinite(total) and total > 0):
        raise ValueError(f"{name} must be finite, non-negative and have positive mass")
    return row / total


def kseq_beta(draft_row: torch.Tensor, target_row: torch.Tensor, rho: float) -> float:
    """beta(rho) = sum_x min(draft(x), target(x) / rho) over the normalised rows, fp64."""
    _check_row_pair(draft_row, target_row)
    draft, target = _normalised(draft_row, "draft_row"), _normalised(target_row, "target_row")
    return float(torch.minimum(draft, target / rho).sum())


def kseq_rho(draft_row: torch.Tensor, target_row: torch.Tensor, k: int) -> float:
    """rho* in [1, k] solving 1 - (1 - beta(rho))^k = rho beta(rho) (module docstring); 1.0 for k = 1.

    beta(rho) is piecewise of the form A / rho + B between the sorted ratios target / draft, so we
    evaluate the equation at every ratio inside (1, k) at once, find the piece holding the root and
    bisect there on scalars. O(V log V). Returns the end of the final bracket where
    1 - (1 - beta)^k <= rho beta (so the residual is non-negative).
    """
    _check_row_pair(draft_row, target_row)
    k = _check_k(k)
    draft, target = _normalised(draft_row, "draft_row"), _normalised(target_row, "target_row")
    if k == 1:
        return 1.0
    both = (draft > 0) & (target > 0)         # elsewhere min(draft, target / rho) = 0 for every rho
    ratio, order = torch.sort(target[both] / draft[both])
    t, d = target[both][order], draft[both][order]
    zero = torch.zeros(1, dtype=torch.float64, device=t.device)
    cum_target = torch.cat([zero, t.cumsum(0)])                  # [n + 1]: mass of the j smallest ratios
    tail_draft = torch.cat([d.flip(0).cumsum(0).flip(0), zero])  # [n + 1]: draft mass of the rest

    def excess(rho: float, a: float, b: float) -> float:          # 1 - (1 - beta)^k - rho beta, beta = a / rho + b
        beta = a / rho + b
        return 1.0 - (1.0 - beta) ** k - rho * beta

    def piece(j: int) -> tuple[float, float]:                     # beta = a / rho + b while j ratios are < rho
        return float(cum_target[j]), float(tail_draft[j])

    j1 = int(torch.searchsorted(ratio, torch.tensor(1.0, dtype=torch.float64, device=ratio.device), right=True))
    if excess(1.0, *piece(j1)) <= 0.0:
        return 1.0
    # Breakpoints strictly inside (1, k): the equation at each of them, vectorised.
    inside = ((ratio > 1.0) & (ratio < k)).nonzero().flatten()
    low, high = 1.0, float(k)
    if inside.numel():
        rho_b = ratio[inside]
        beta_b = cum_target[inside] / rho_b + tail_draft[inside]
        excess_b = 1.0 - (1.0 - beta_b) ** k - rho_b * beta_b
        crossed = (excess_b <= 0).nonzero().flatten()
        if crossed.numel():
            first = int(crossed[0])
            high = float(rho_b[first])
            low = float(rho_b[first - 1]) if first > 0 else 1.0
        else:
            low = float(rho_b[-1])
    low_t = torch.tensor(low, dtype=torch.float64, device=ratio.device)
    a, b = piece(int(torch.searchsorted(ratio, low_t, right=True)))
    for _ in range(200):
        mid = 0.5 * (low + high)
        if mid <= low or mid >= high:
            break
        if excess(mid, a, b) > 0.0:
            low = mid
        else:
            high = mid
    return high


def kseq_acceptance(
    candidate_tokens: torch.Tensor,   # [k] long
    draft_row: torch.Tensor,          # [vocab] float
    target_row: torch.Tensor,         # [vocab] float
    rho: float,
) -> torch.Tensor:
    """min(1, target(x) / (rho draft(x))) per candidate, fp32 [k]; 0 where draft(x) == 0 (as
    speculative.acceptance_probs, which this equals for rho = 1)."""
    index = candidate_tokens.long().to(draft_row.device)
    draft_at = draft_row.float()[index] * rho
    target_at = target_row.float()[index]
    safe = draft_at.clamp_min(torch.finfo(torch.float32).tiny)
    return torch.where(draft_at > 0, target_at / safe, torch.zeros_like(draft_at)).clamp(max=1.0)


def kseq_residual(draft_row: torch.Tensor, target_row: torch.Tensor, rho: float, k: int) -> torch.Tensor:
    """p_res = norm(max(0, target - min(draft, target / rho) (1 - (1 - beta)^k) / beta)) (module docstring),
    [vocab]; k = 1 is speculative.recovery_probs (fp32), otherwise fp64. Falls back to the target row
    when the residual mass is <= RESIDUAL_MIN_MASS."""
    _check_row_pair(draft_row, target_row)
    if _check_k(k) == 1:
        return recovery_probs(draft_row, target_row)
    draft, target = _normalised(draft_row, "draft_row"), _normalised(target_row, "target_row")
    overlap = torch.minimum(draft, target / rho)
    beta = float(overlap.sum())
    if beta <= 0.0:
        return target
    accepted_mass = 1.0 - (1.0 - beta) ** k
    residual = (target - overlap * (accepted_mass / beta)).clamp_min(0.0)
    mass = float(residual.sum())
    return residual / mass if mass > RESIDUAL_MIN_MASS else target


def kseq_select(
    candidate_tokens: torch.Tensor,   # [k] long: iid samples of draft_row
    draft_row: torch.Tensor,          # [vocab] float: the draft distribution they were drawn from
    target_row: torch.Tensor,         # [vocab] float: the target distribution to reproduce
    generator: torch.Generator | None = None,
) -> tuple[int | None, int]:
    """K-SEQ at one position: (index of the first accepted candidate or None, emitted token).

    The emitted token is the accepted candidate's, or a sample of `kseq_residual` when none is accepted;
    it is distributed exactly as target_row. Randomness: k fp32 uniforms, then one `sample` if needed.
    """
    _check_row_pair(draft_row, target_row)
    if not isinstance(candidate_tokens, torch.Tensor) or candidate_tokens.dim() != 1 or candidate_tokens.numel() < 1:
        raise ValueError(f"candidate_tokens must be a tensor [k] with k >= 1, got "
                         f"{getattr(candidate_tokens, 'shape', candidate_tokens)!r}")
    if candidate_tokens.is_floating_point() or candidate_tokens.is_complex() or candidate_tokens.dtype == torch.bool:
        raise ValueError(f"candidate_tokens must be an integer tensor, got dtype {candidate_tokens.dtype}")
    vocab = draft_row.shape[0]
    if int(candidate_tokens.min()) < 0 or int(candidate_tokens.max()) >= vocab:
        raise ValueError(f"candidate_tokens must lie in [0, {vocab}), got {candidate_tokens.tolist()}")
    k = candidate_tokens.shape[0]
    rho = kseq_rho(draft_row, target_row, k)
    accept = kseq_acceptance(candidate_tokens, draft_row, target_row, rho)
    uniforms = torch.rand(k, generator=generator, device=accept.device)
    accepted = (uniforms < accept).nonzero()
    if accepted.numel():
        index = int(accepted[0, 0])
        return index, int(candidate_tokens[index])
    return None, int(sample(kseq_residual(draft_row, target_row, rho, k), generator))


def check_tree_inputs(
    draft_tokens: torch.Tensor,   # [k, gamma] long
    draft_probs: torch.Tensor,    # [k, gamma, vocab] float
    target_probs: torch.Tensor,   # [k, gamma + 1, vocab] float
) -> tuple[int, int]:
    """Validate spectr_verify's inputs; return (k, gamma). ValueError on any mismatch."""
    for name, t in (("draft_tokens", draft_tokens), ("draft_probs", draft_probs), ("target_probs", target_probs)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if draft_tokens.dim() != 2 or draft_tokens.shape[0] < 1:
        raise ValueError(f"draft_tokens must be [k, gamma] with k >= 1, got shape {tuple(draft_tokens.shape)}")
    if draft_tokens.is_floating_point() or draft_tokens.is_complex() or draft_tokens.dtype == torch.bool:
        raise ValueError(f"draft_tokens must be an integer tensor, got dtype {draft_tokens.dtype}")
    k, gamma = draft_tokens.shape
    if target_probs.dim() != 3 or tuple(target_probs.shape[:2]) != (k, gamma + 1) or target_probs.shape[2] < 1:
        raise ValueError(f"target_probs must be [k, gamma + 1, vocab] = [{k}, {gamma + 1}, vocab], got shape "
                         f"{tuple(target_probs.shape)}")
    vocab = target_probs.shape[2]
    if tuple(draft_probs.shape) != (k, gamma, vocab):
        raise ValueError(f"draft_probs must be [k, gamma, vocab] = [{k}, {gamma}, {vocab}], got shape "
                         f"{tuple(draft_probs.shape)}")
    if not (draft_probs.is_floating_point() and target_probs.is_floating_point()):
        raise ValueError(f"draft_probs and target_probs must be float tensors, got {draft_probs.dtype} and "
                         f"{target_probs.dtype}")
    if gamma and (int(draft_tokens.min()) < 0 or int(draft_tokens.max()) >= vocab):
        raise ValueError(f"draft_tokens must lie in [0, {vocab})")
    return k, gamma


def spectr_verify(
    draft_tokens: torch.Tensor,   # [k, gamma] long: k iid draft chains from the same prefix
    draft_probs: torch.Tensor,    # [k, gamma, vocab] float: warped draft distribution along each chain
    target_probs: torch.Tensor,   # [k, gamma + 1, vocab] float: warped target distribution along each chain
    generator: torch.Generator | None = None,
) -> tuple[int, VerifyResult]:
    """Sequence-level K-SEQ over the draft tree (module docstring). Returns (row of a chain consistent
    with the emitted prefix - its first num_accepted tokens are the accepted ones -, result).

    At depth i the live chains share their prefix, so their distributions at depth i agree; the first
    live chain's rows are used.
    """
    k, gamma = check_tree_inputs(draft_tokens, draft_probs, target_probs)
    tokens = draft_tokens.tolist()
    live = list(range(k))
    for depth in range(gamma):
        row = live[0]
        candidates = torch.tensor([tokens[r][depth] for r in live], dtype=torch.long)
        index, token = kseq_select(candidates, draft_probs[row, depth], target_probs[row, depth], generator)
        if index is None:
            return row, VerifyResult(num_accepted=depth, next_token=token)
        live = [r for r in live if tokens[r][depth] == token]
    row = live[0]
    return row, VerifyResult(num_accepted=gamma, next_token=int(sample(target_probs[row, gamma], generator)))
