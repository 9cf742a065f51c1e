"""Mentored decoding (Tran-Thien 2023, "An optimal lossy variant of speculative decoding"). LOSSY, bounded.

Convention: target = p, draft = q in this docstring; the blog uses the OPPOSITE letters (p = draft,
q = target), so its r_i = min(1, q_i / (alpha p_i)) reads min(1, target_i / (alpha draft_i)) here. In
code: `draft_*` / `target_*`. Vocabulary as in `types.py`.

Problem at one position. Any accept-then-resample scheme (accept the draft token i w.p. r_i, else
sample s) emits pi_i = q_i r_i + (1 - A) s_i with acceptance A = sum_i q_i r_i; for a given pi the best
is r_i = min(1, pi_i / q_i), s = norm(max(0, pi - q)), A(pi) = sum_i min(q_i, pi_i). Mentored decoding
emits the pi that maximises A subject to KL(p || pi) = sum_i p_i log(p_i / pi_i) <= D (kl_budget):

    max_pi  sum_i min(q_i, pi_i)   s.t.  KL(p || pi) <= D,  pi in the simplex.

Solution (KKT conditions of the problem above; tests/serving/test_rule_mentored.py checks it against SLSQP), with
ratios rho_i = p_i / q_i:

    pi_i = p_i / alpha   if rho_i < alpha          (draft over-proposes i: accepted w.p. p_i / (alpha q_i))
    pi_i = q_i           if alpha <= rho_i <= beta (always accepted, never resampled)
    pi_i = p_i / beta    if rho_i > beta           (always accepted, and the residual tops it up)

with 0 < alpha <= 1 <= beta, beta = beta(alpha) from sum_i pi_i = 1, and KL(p || pi(alpha)) decreasing
from its largest value at alpha -> 0+ to 0 at alpha = beta = 1. We bisect log(alpha) so that KL = D,
keeping the feasible end (KL <= D). D = 0 gives pi = p (plain speculative sampling); if
KL(p || q) <= D then pi = q and everything is accepted (the blog's quick path).

One case the blog's form misses (it assumes p > 0 everywhere): tokens with p_i = 0 but q_i > 0, which
the top-k / top-p warps create all the time. The form above gives them pi_i = 0 for every alpha > 0,
but their KL cost is 0, so once D exceeds the KL at alpha -> 0+ the optimum (KKT multiplier of the
simplex constraint = 1) fills them: pi_i = s q_i for p_i = 0 (s in [0, 1], accepted w.p. s) and
pi_i = max(q_i, p_i / beta) elsewhere, with beta >= beta(0+) from normalisation; KL then grows with
beta and we bisect log(beta). As s -> 1 this reaches pi = q. (Any split of the mass s sum_{p=0} q
among those tokens is optimal; proportional to q is the one that needs no residual there.)

Numerical reach: when the draft gives probability 0 to a token the target can emit, KL(p || q) = inf
and a large budget is only spent by pi_i = p_i / beta with beta astronomically large (e.g. e^2000 for
p_i = 0.002 and D = 5). We stop at log(beta) = MAX_LOG_BETA = 700 and at fp64 resolution in alpha, so
there the returned pi has KL slightly BELOW D (still feasible; the acceptance lost is ~ p_i / beta).
When the draft covers the target's support, KL = D to ~1e-12 (tests).

Computation, O(V log V) per solved row (the blog's precomputed cumulative sums): restrict to p > 0,
sort by rho, take prefix/suffix sums of p, q and p log(p / q); then each bisection step costs two
binary searches and a few scalar operations, `iters` steps in all (measured, one CPU core: ~8 ms for a
full-support 49,152-token row, where the sort dominates; ~1.5 ms for a top-k 20 / top-p 0.9 row).
Only rows that need pi are solved:
since pi_i / q_i >= min(1, p_i / q_i), a uniform below the plain speculative ratio accepts without
solving (the blog's first shortcut), and the bonus position never needs pi (below).

Verification (`mentored_verify`), position by position: speculative sampling against pi instead of the
target. Accept draft token x_i iff u_i < min(1, pi_i(x_i) / q_i(x_i)); at the first rejection emit a
sample of norm(max(0, pi_i - q_i)); so each emitted token is distributed as pi_i exactly. If all gamma
are accepted, the bonus token is sampled from the TARGET row gamma: there is no draft distribution at
that position (draft_probs has gamma rows), nothing to accept, and with q undefined the
acceptance-maximising pi under the KL bound is the target itself (KL = 0).

Randomness, exactly as speculative.speculative_verify: one vectorised draw of gamma fp32 uniforms,
then one categorical draw (`warp.sample`). With kl_budget = 0 pi is the target row itself (no solve,
no rounding), so the result equals speculative_verify's for the same generator state.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from serving.decoding.speculative import acceptance_probs, check_verify_inputs, recovery_probs
from serving.decoding.types import VerifyResult
from serving.decoding.warp import sample


def _check_budget(kl_budget: float) -> float:
    if isinstance(kl_budget, bool) or not isinstance(kl_budget, (int, float)) or math.isnan(kl_budget) \
            or kl_budget < 0:
        raise ValueError(f"kl_budget must be a number >= 0 (nats; inf allowed), got {kl_budget!r}")
    return float(kl_budget)


def _normalised_rows(draft_row: torch.Tensor, target_row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate two [vocab] probability rows; return them in fp64, each summing to 1."""
    for name, row in (("draft_row", draft_row), ("target_row", target_row)):
        if not isinstance(row, torch.Tensor) or row.dim() != 1 or row.numel() < 1:
            raise ValueError(f"{name} must be a tensor [vocab], got {getattr(row, 'shape', row)!r}")
        if not row.is_floating_point():
            raise ValueError(f"{name} must be a float tensor, got dtype {row.dtype}")
    if draft_row.shape != target_row.shape:
        raise ValueError(f"draft_row {tuple(draft_row.shape)} and target_row {tuple(target_row.shape)} differ")
    out = []
    for name, row in (("draft_row", draft_row), ("target_row", target_row)):
        row = row.double()
        total = float(row.sum())
        if not (float(row.min()) >= 0.0 and math.isfinite(total) and total > 0):
            raise ValueError(f"{name} must be finite, non-negative and have positive mass")
        out.append(row / total)
    return out[0], out[1]


def _kl(target: torch.Tensor, other: torch.Tensor) -> float:
    """KL(target || other) = sum_{target > 0} target log(target / other), in nats (inf if other = 0 there)."""
    support = target > 0
    t, o = target[support], other[support]
    if bool((o <= 0).any()):
        return math.inf
    return float((t * (t.log() - o.log())).sum())


class _SortedRow:
    """Prefix/suffix sums over the target's support sorted by rho = target / draft (module docstring).

    Index j of the sums means "the first j sorted tokens"; cum_* are prefix sums, tail_* suffix sums.
    """

    def __init__(self, draft: torch.Tensor, target: torch.Tensor):
        support = target > 0
        t, d = target[support].cpu(), draft[support].cpu()
        rho = torch.where(d > 0, t / d.clamp_min(torch.finfo(torch.float64).tiny), torch.full_like(t, math.inf))
        rho, order = torch.sort(rho)
        t, d = t[order], d[order]
        zero = torch.zeros(1, dtype=torch.float64)
        log_term = torch.where(d > 0, t * (t.log() - d.clamp_min(torch.finfo(torch.float64).tiny).log()),
                               torch.full_like(t, math.inf))
        self.rho = rho.numpy()
        self.cum_target = torch.cat([zero, t.cumsum(0)]).numpy()
        self.cum_draft = torch.cat([zero, d.cumsum(0)]).numpy()
        self.cum_log = torch.cat([zero, log_term.cumsum(0)]).numpy()
        self.tail_target = torch.cat([t.flip(0).cumsum(0).flip(0), zero]).numpy()
        self.tail_draft = torch.cat([d.flip(0).cumsum(0).flip(0), zero]).numpy()
        self.draft_off_support = float(draft[~support].sum())      # D_Z: draft mass where target == 0
        # gap[j] = tail_target[j+1] / rho[j] - tail_draft[j+1], non-increasing in j; normalisation holds
        # with the first j tokens at ratio <= beta iff gap[j] <= (slack of the alpha region) + D_Z.
        with np.errstate(divide="ignore", invalid="ignore"):
            gap = np.where(np.isinf(self.rho), 0.0, self.tail_target[1:] / self.rho) - self.tail_draft[1:]
        self.neg_gap = -gap
        self.size = len(self.rho)

    def beta_for_alpha(self, alpha: float) -> tuple[int, int, float]:
        """(a, j, beta): tokens [0, a) have rho < alpha, tokens [j, size) have rho > beta, sum pi = 1."""
        a = int(np.searchsorted(self.rho, alpha, side="left"))
        slack = (self.cum_draft[a] - self.cum_target[a] / alpha) + self.draft_off_support   # >= 0
        j = max(a, int(np.searchsorted(self.neg_gap, -slack, side="left")))
        if j >= self.size:                    # nothing above beta (only reachable through rounding)
            return a, self.size, math.inf
        denominator = slack + self.tail_draft[j]
        beta = self.tail_target[j] / denominator if denominator > 0 else math.inf
        low = max(1.0, float(self.rho[j - 1])) if j > 0 else 1.0
        return a, j, min(max(beta, low), float(self.rho[j]))

    def kl_for_alpha(self, alpha: float) -> tuple[float, float]:
        """(KL(target || pi), beta) for the alpha-form of pi."""
        a, j, beta = self.beta_for_alpha(alpha)
        kl = self.cum_target[a] * math.log(alpha) + (self.cum_log[j] - self.cum_log[a])
        if self.tail_target[j] > 0:
            kl += self.tail_target[j] * math.log(beta)
        return kl, beta

    def kl_for_log_beta(self, log_beta: float) -> tuple[float, float]:
        """(KL(target || pi), s) for the alpha = 0 form: pi = max(draft, target / beta) where target > 0,
        s * draft where target == 0."""
        beta = math.exp(log_beta)
        j = int(np.searchsorted(self.rho, beta, side="right"))
        kl = self.cum_log[j] + (self.tail_target[j] * log_beta if self.tail_target[j] > 0 else 0.0)
        fill = 1.0 + (self.tail_draft[j] - self.tail_target[j] / beta) / self.draft_off_support
        return kl, min(max(fill, 0.0), 1.0)


# log(beta) cap in the alpha = 0 regime when the draft misses target tokens (pi there ~ target * e^-700).
MAX_LOG_BETA = 700.0


def mentored_distribution(
    draft_row: torch.Tensor,    # [vocab] float: draft distribution at one position
    target_row: torch.Tensor,   # [vocab] float: target distribution at the same position
    kl_budget: float,
    iters: int = 60,
) -> torch.Tensor:
    """The acceptance-maximising output distribution pi with KL(target || pi) <= kl_budget (module
    docstring), fp64 [vocab] summing to 1, on the input's device. `iters` bisection steps (60 reach
    fp64 resolution). Rows need not be normalised; they are normalised first."""
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be an integer >= 1, got {iters!r}")
    kl_budget = _check_budget(kl_budget)
    draft, target = _normalised_rows(draft_row, target_row)
    if kl_budget == 0.0:
        return target
    if _kl(target, draft) <= kl_budget:
        return draft
    row = _SortedRow(draft, target)
    # Any alpha below every rho leaves the alpha region empty: that is the alpha -> 0+ end.
    alpha_edge = 0.5 * min(1.0, float(row.rho[0]))
    kl_edge, beta_edge = row.kl_for_alpha(alpha_edge)
    if kl_edge > kl_budget or row.draft_off_support == 0.0:
        # KL(alpha) decreases in alpha: > budget at alpha_edge, 0 at alpha = 1. Bisect log(alpha).
        low, high = math.log(alpha_edge), 0.0
        for _ in range(iters):
            mid = 0.5 * (low + high)
            if row.kl_for_alpha(math.exp(mid))[0] > kl_budget:
                low = mid
            else:
                high = mid
        alpha = math.exp(high)
        beta = row.kl_for_alpha(alpha)[1]
        ratio = torch.where(draft > 0, target / draft.clamp_min(torch.finfo(torch.float64).tiny),
                            torch.where(target > 0, math.inf, 0.0))
        pi = torch.where(ratio < alpha, target / alpha, torch.where(ratio > beta, target / beta, draft))
    else:
        # KL(beta) increases in beta: <= budget at beta_edge; beyond every finite rho it is KL(target || draft)
        # > budget, or grows without bound if the draft misses target tokens (then capped). Bisect log(beta).
        finite = row.rho[np.isfinite(row.rho)]
        low = math.log(beta_edge)
        high = math.log(float(finite[-1])) + 1.0 if len(finite) == row.size else max(MAX_LOG_BETA, low)
        if row.kl_for_log_beta(high)[0] <= kl_budget:
            low = high
        for _ in range(iters):
            mid = 0.5 * (low + high)
            if row.kl_for_log_beta(mid)[0] > kl_budget:
                high = mid
            else:
                low = mid
        fill = row.kl_for_log_beta(low)[1]
        pi = torch.where(target > 0, torch.maximum(draft, target * math.exp(-low)), fill * draft)
    return pi / pi.sum()


def mentored_verify(
    draft_tokens: torch.Tensor,   # [gamma] long: the proposed tokens
    draft_probs: torch.Tensor,    # [gamma, vocab] float: warped draft distribution each token was drawn from
    target_probs: torch.Tensor,   # [gamma + 1, vocab] float: warped target distribution at each position
    generator: torch.Generator | None = None,
    *,
    kl_budget: float = 0.1,
) -> VerifyResult:
    """Speculative sampling against the mentored pi_i (module docstring); bonus from target_probs[gamma].

    num_accepted = first i with u_i >= min(1, pi_i(x_i) / draft_probs[i, x_i]); next_token ~
    norm(max(0, pi_n - draft_n)) if n < gamma else target_probs[gamma]. kl_budget = 0 is speculative_verify.
    """
    gamma = check_verify_inputs(draft_tokens, draft_probs, target_probs)
    kl_budget = _check_budget(kl_budget)
    num_accepted, emit_from = gamma, target_probs[gamma]
    if gamma:
        tokens = draft_tokens.long().to(draft_probs.device)
        plain = acceptance_probs(tokens, draft_probs, target_probs).tolist()    # min(1, target / draft)
        uniforms = torch.rand(gamma, generator=generator, device=draft_probs.device).tolist()
        for i in range(gamma):
            if uniforms[i] < plain[i]:          # pi_i / draft_i >= min(1, target_i / draft_i): accepted anyway
                continue
            if kl_budget == 0.0:                # pi = target: the plain test was the test
                num_accepted, emit_from = i, recovery_probs(draft_probs[i], target_probs[i])
                break
            pi = mentored_distribution(draft_probs[i], target_probs[i], kl_budget)
            draft = draft_probs[i].double() / draft_probs[i].double().sum()
            token = int(tokens[i])
            ratio = float(pi[token] / draft[token]) if float(draft[token]) > 0 else 0.0
            if uniforms[i] < min(1.0, ratio):
                continue
            num_accepted, emit_from = i, recovery_probs(draft, pi)
            break
    return VerifyResult(num_accepted=num_accepted, next_token=int(sample(emit_from, generator)))
