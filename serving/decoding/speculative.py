"""Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

Convention: target = p, draft = q (Leviathan's letters; gpt-fast and Chen et al. swap them).
Vocabulary as in `types.py`: accepted draft tokens, then one recovered or bonus token.

For i = 0 .. gamma-1, in order, with r_i ~ U[0, 1):

    accept draft token d_i   iff   r_i < min(1, target_i(d_i) / draft_i(d_i))

(the strict `<` follows Leviathan and feifeibear; HF uses `<=`, which differs only on a
measure-zero event). A draft probability of 0 counts as ratio 0, i.e. rejection (the draft could
not have emitted that token, so there is nothing to accept). On the first rejection at position n
the *recovered* token is drawn from the residual

    norm(max(0, target_n - draft_n))

whose mass is 1 - beta_n, beta_n = sum_x min(target_n(x), draft_n(x)). If all gamma are accepted
the *bonus* token is drawn from target_probs[gamma]. The emitted tokens are then distributed
exactly as the (warped) target, provided draft_probs are exactly the distributions the draft tokens
were sampled from and target_probs are the warped target distributions to reproduce.

Numerics: ratios and residuals are computed in fp32 whatever the input dtype. In exact arithmetic a
rejection implies target_n != draft_n, so residual mass > 0; if rounding leaves a residual mass
<= RESIDUAL_MIN_MASS we fall back to target_n (as the ZongyueQin fork does). That changes the
output distribution by at most that mass in total variation.

Randomness, in this order from `generator`: one vectorised draw of gamma fp32 uniforms, then one
categorical draw (`warp.sample`) for the recovered/bonus token.
"""
from __future__ import annotations

import torch

from serving.decoding.types import VerifyResult
from serving.decoding.warp import sample

RESIDUAL_MIN_MASS = 1e-6


def check_verify_inputs(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor) -> int:
    """Validate the uniform rule inputs (types.py) and return gamma; ValueError on any mismatch.

    draft_tokens [gamma] integer, draft_probs [gamma, vocab] float, target_probs [gamma + 1, vocab] float.
    """
    for name, t in (("draft_tokens", draft_tokens), ("draft_probs", draft_probs), ("target_probs", target_probs)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if draft_tokens.dim() != 1:
        raise ValueError(f"draft_tokens must be [gamma], got shape {tuple(draft_tokens.shape)}")
    if draft_tokens.is_floating_point() or draft_tokens.is_complex() or draft_tokens.dtype == torch.bool:
        raise ValueError(f"draft_tokens must be an integer tensor, got dtype {draft_tokens.dtype}")
    gamma = draft_tokens.shape[0]
    if target_probs.dim() != 2 or target_probs.shape[0] != gamma + 1 or target_probs.shape[1] < 1:
        raise ValueError(f"target_probs must be [gamma + 1, vocab] = [{gamma + 1}, vocab], got shape "
                         f"{tuple(target_probs.shape)}")
    vocab = target_probs.shape[1]
    if draft_probs.dim() != 2 or tuple(draft_probs.shape) != (gamma, vocab):
        raise ValueError(f"draft_probs must be [gamma, vocab] = [{gamma}, {vocab}], got shape "
                         f"{tuple(draft_probs.shape)}")
    if not (draft_probs.is_floating_point() and target_probs.is_floating_point()):
        raise ValueError(f"draft_probs and target_probs must be float tensors, got {draft_probs.dtype} and "
                         f"{target_probs.dtype}")
    if gamma and (int(draft_tokens.min()) < 0 or int(draft_tokens.max()) >= vocab):
        raise ValueError(f"draft_tokens must lie in [0, {vocab}), got {draft_tokens.tolist()}")
    return gamma


def acceptance_probs(
    draft_tokens: torch.Tensor,   # [..., gamma] long
    draft_probs: torch.Tensor,    # [..., gamma, vocab] float
    target_probs: torch.Tensor,   # [..., gamma (+ 1), vocab] float; rows past gamma are ignored
) -> torch.Tensor:
    """min(1, target_i(d_i) / draft_i(d_i)) per draft token, fp32 [..., gamma]; 0 where draft_i(d_i) == 0.

    Batched over leading dimensions so tests can run many steps at once; `speculative_verify` calls it
    with none.
    """
    gamma = draft_tokens.shape[-1]
    if draft_probs.shape[:-1] != draft_tokens.shape or target_probs.shape[-2] < gamma \
            or target_probs.shape[-1] != draft_probs.shape[-1]:
        raise ValueError(f"shapes do not line up: draft_tokens {tuple(draft_tokens.shape)}, draft_probs "
                         f"{tuple(draft_probs.shape)}, target_probs {tuple(target_probs.shape)}")
    index = draft_tokens.long().unsqueeze(-1)
    draft_at = draft_probs.float().gather(-1, index).squeeze(-1)                        # [..., gamma]
    target_at = target_probs[..., :gamma, :].float().gather(-1, index).squeeze(-1)   # [..., gamma]
    safe = draft_at.clamp_min(torch.finfo(torch.float32).tiny)
    return torch.where(draft_at > 0, target_at / safe, torch.zeros_like(draft_at)).clamp(max=1.0)


def recovery_probs(
    draft_row: torch.Tensor,    # [..., vocab] float: draft distribution at the rejected position
    target_row: torch.Tensor,   # [..., vocab] float: target distribution at the same position
) -> torch.Tensor:
    """norm(max(0, target - draft)), fp32 [..., vocab]; rows whose residual mass is <= RESIDUAL_MIN_MASS
    fall back to norm(target) (module docstring)."""
    if draft_row.shape != target_row.shape:
        raise ValueError(f"draft_row {tuple(draft_row.shape)} and target_row {tuple(target_row.shape)} differ")
    target = target_row.float()
    residual = (target - draft_row.float()).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    chosen = torch.where(mass > RESIDUAL_MIN_MASS, residual, target)
    return chosen / chosen.sum(dim=-1, keepdim=True)


def speculative_verify(
    draft_tokens: torch.Tensor,   # [gamma] long: the proposed tokens
    draft_probs: torch.Tensor,    # [gamma, vocab] float: warped draft distribution each token was drawn from
    target_probs: torch.Tensor,   # [gamma + 1, vocab] float: warped target distribution at each position
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Leviathan/Chen rule (module docstring). gamma == 0 is plain target sampling from target_probs[0].

    num_accepted = first i with uniforms[i] >= acceptance_probs[i] (gamma if none); next_token ~
    recovery_probs(draft_probs[n], target_probs[n]) if n < gamma else target_probs[gamma].
    """
    gamma = check_verify_inputs(draft_tokens, draft_probs, target_probs)
    num_accepted = gamma
    if gamma:
        ratio = acceptance_probs(draft_tokens.to(draft_probs.device), draft_probs, target_probs)   # [gamma]
        uniforms = torch.rand(gamma, generator=generator, device=ratio.device)
        rejected = (~(uniforms < ratio)).nonzero()
        if rejected.numel():
            num_accepted = int(rejected[0, 0])
    if num_accepted < gamma:
        emit_from = recovery_probs(draft_probs[num_accepted], target_probs[num_accepted])
    else:
        emit_from = target_probs[gamma]
    return VerifyResult(num_accepted=num_accepted, next_token=int(sample(emit_from, generator)))
