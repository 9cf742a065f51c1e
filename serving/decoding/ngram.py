"""Prompt-lookup (n-gram) drafting and staged speculation.

Convention: target = p, draft = q. Vocabulary as in `types.py`.

`ngram_propose` is HF transformers' `PromptLookupCandidateGenerator` (transformers/generation/
candidate_generator.py): for n = min(max_ngram, len(context) - 1) down to min_ngram, look for the last
n tokens of the context among all earlier n-token windows of the context (prompt + generated text), take
the LEFTMOST window whose continuation is non-empty and return up to num_tokens tokens of that continuation. A longer
n-gram is tried first, so it wins over a shorter one. No match -> [] (decode normally). Cropping at
EOS or at tokens a logits processor forbids is left to the caller.

Why verifying an n-gram draft is exact. The proposal is a deterministic function of the context, so
its "draft distribution" is the one-hot q = delta_x. Speculative sampling (speculative.py) with that q
accepts x with probability min(1, p(x) / 1) = p(x), and on rejection samples the residual
norm(max(0, p - delta_x)) = p restricted to tokens != x, renormalised. Together: token x with
probability p(x), any other y with probability (1 - p(x)) * p(y) / (1 - p(x)) = p(y). So
`speculative_verify(tokens, one_hot(tokens), target_probs)` reproduces the target exactly; in the
greedy case (one-hot p) it accepts exactly the tokens equal to the target argmax.

Staged speculation (Spector & Re 2023): the n-gram drafts for the DRAFT model, which then drafts for
the target. `staged_accept` is the inner verification: the proposed tokens are checked against the
draft model's warped distributions from one draft forward, with the same one-hot argument, so the
accepted tokens followed by the returned draft-sampled token are distributed exactly as
autoregressive samples from the draft. The outer step (draft vs target, speculative_verify with the
draft's distributions at those positions as draft_probs) therefore stays lossless.
"""
from __future__ import annotations

import torch

from serving.decoding.speculative import speculative_verify


def _check_positive_int(name: str, value: int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def ngram_propose(context: list[int], max_ngram: int = 3, num_tokens: int = 4, min_ngram: int = 1) -> list[int]:
    """Prompt-lookup proposal (module docstring): up to `num_tokens` tokens that followed the leftmost
    earlier occurrence of the longest matching suffix n-gram (max_ngram >= n >= min_ngram), or []."""
    _check_positive_int("min_ngram", min_ngram, 1)
    _check_positive_int("max_ngram", max_ngram, min_ngram)
    _check_positive_int("num_tokens", num_tokens, 1)
    if not isinstance(context, (list, tuple)) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0
                                                      for t in context):
        raise ValueError("context must be a list of non-negative integer token ids")
    length = len(context)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = list(context[length - n:])
        # A window starting at `start` has continuation context[start + n:], non-empty iff start < length - n.
        start = 0
        while True:
            try:   # list.index scans in C; candidates are the positions holding the suffix's first token
                start = context.index(suffix[0], start, length - n)
            except ValueError:
                break
            if list(context[start:start + n]) == suffix:
                return list(context[start + n:start + n + num_tokens])
            start += 1
    return []


def staged_accept(
    proposed,                          # [m] ints (list or long tensor): the n-gram proposal
    draft_probs: torch.Tensor,         # [m + 1, vocab] float: the DRAFT model's warped distribution at each position
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Inner step of staged speculation: (number of proposed tokens accepted, next draft-sampled token).

    speculative_verify(proposed, one_hot(proposed), draft_probs): the draft model plays the target, the
    deterministic proposal plays the draft (module docstring), so proposed[:n] + [token] is an exact
    autoregressive draft sample. m == 0 is a plain sample from draft_probs[0]. Randomness as in
    speculative_verify (m uniforms, then one categorical draw).
    """
    if not isinstance(draft_probs, torch.Tensor) or draft_probs.dim() != 2 or draft_probs.shape[1] < 1:
        raise ValueError(f"draft_probs must be a tensor [m + 1, vocab], got "
                         f"{getattr(draft_probs, 'shape', draft_probs)!r}")
    if isinstance(proposed, torch.Tensor):
        if proposed.is_floating_point() or proposed.is_complex() or proposed.dtype == torch.bool:
            raise ValueError(f"proposed must hold integer token ids, got dtype {proposed.dtype}")
        tokens = proposed.to(device=draft_probs.device, dtype=torch.long)
    elif isinstance(proposed, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in proposed):
        tokens = torch.tensor(list(proposed), dtype=torch.long, device=draft_probs.device)
    else:
        raise ValueError("proposed must be a list of integer token ids or an integer tensor [m]")
    if tokens.dim() != 1 or tokens.shape[0] + 1 != draft_probs.shape[0]:
        raise ValueError(f"need draft_probs rows = len(proposed) + 1, got {tuple(draft_probs.shape)} for "
                         f"{tuple(tokens.shape)} proposed tokens")
    vocab = draft_probs.shape[1]
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise ValueError(f"proposed tokens must lie in [0, {vocab}), got {tokens.tolist()}")
    one_hot = torch.nn.functional.one_hot(tokens, vocab).to(draft_probs.dtype)   # [m, vocab]
    result = speculative_verify(tokens, one_hot, draft_probs, generator)
    return result.num_accepted, result.next_token
