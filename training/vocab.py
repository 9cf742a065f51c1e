"""The draft's output vocabulary: which rows of the (tied, frozen) output layer the draft computes.

A small draft spends most of its time in the output projection (49,152 x 576 for the default target),
so it computes logits only over a kept set of token ids (`draftsmith.json` `output_token_ids`, read by
`serving.models.read_output_token_ids` for the engine, the trainer and the gate alike). Every other
token gets draft probability 0: speculative sampling stays exact (such tokens are never proposed), the
draft just cannot propose them.

The kept set is chosen from the *target's* own token statistics, never from a fixed list:
- `token_mass(ids, logprobs, vocab)` sums the target's probability of each token over scored positions
  (its stored top-k per position: what the target would emit, weighted by how sure it is);
- `choose_vocabulary(mass, size, ...)` keeps the `size` tokens of largest mass, the special tokens
  always, and optionally leans towards a parent vocabulary (`prior`), so a distillation job that re-chooses
  the rows from its buffer window adds the tokens its traffic uses and drops only tokens that neither
  the window nor (much) the parent needed.
The rows are the target's tied embedding rows, so a newly kept token costs nothing to train.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

DEFAULT_VOCAB_SIZE = 8192   # chosen by measured tokens/s, docs/benchmarks.md ("Draft output vocabulary")


def token_mass(topk_ids: np.ndarray, topk_logprobs: np.ndarray, vocab_size: int) -> np.ndarray:
    """Sum over positions of the target's probability of each token id.

    topk_ids [N, k] int (entries < 0 or >= vocab_size are ignored), topk_logprobs [N, k] (raw log-probs).
    Returns mass [vocab_size] float64."""
    ids = np.asarray(topk_ids).reshape(-1).astype(np.int64)
    p = np.exp(np.asarray(topk_logprobs, dtype=np.float64).reshape(-1))
    ok = (ids >= 0) & (ids < vocab_size) & np.isfinite(p)
    return np.bincount(ids[ok], weights=p[ok], minlength=vocab_size)[:vocab_size]


def choose_vocabulary(mass: np.ndarray, size: int, *, always: Iterable[int] = (),
                      prior: Iterable[int] | None = None, prior_weight: float = 0.5) -> list[int]:
    """The `size` token ids with the largest score, sorted ascending; `always` ids are kept first.

    score = mass / sum(mass) + prior_weight / len(prior) on the prior's ids: a blend of the observed
    token distribution with the uniform distribution over the parent's vocabulary. A token of the new
    window with a share above prior_weight / len(prior) displaces a parent token the window never used.
    Ties are broken by the lower id (deterministic)."""
    mass = np.asarray(mass, dtype=np.float64)
    vocab = len(mass)
    if size < 1:
        raise ValueError(f"vocabulary size must be >= 1, got {size}")
    total = mass.sum()
    score = mass / total if total > 0 else np.zeros(vocab)
    prior_ids = np.asarray(sorted({int(i) for i in prior if 0 <= int(i) < vocab}) if prior is not None else [],
                           dtype=np.int64)
    if len(prior_ids) and prior_weight > 0:
        score = score.copy()
        score[prior_ids] += prior_weight / len(prior_ids)
    keep = [int(i) for i in dict.fromkeys(int(i) for i in always) if 0 <= int(i) < vocab]
    chosen = set(keep)
    if len(chosen) < size:
        order = np.lexsort((np.arange(vocab), -score))          # score descending, then id ascending
        for i in order:
            if len(chosen) >= size:
                break
            if score[i] <= 0:
                break
            chosen.add(int(i))
    return sorted(chosen)


def coverage(vocab_ids: Iterable[int], tokens: Iterable[int]) -> float:
    """Share of `tokens` (e.g. the target's greedy tokens on held-out text) inside `vocab_ids`."""
    s = set(int(i) for i in vocab_ids)
    toks = [int(t) for t in tokens]
    return sum(t in s for t in toks) / len(toks) if toks else 0.0
