"""Vocabulary shared by every verification rule.

A decoding step proposes `gamma` *draft tokens*; the rule *accepts* a prefix of them
(`num_accepted`, 0..gamma) and then emits one more token from the target: the *recovered* token
when it stopped early, or the *bonus* token when all gamma were accepted. So a step emits
`num_accepted + 1` tokens.

Every rule is a pure function with this signature (extra keyword parameters are the rule's knobs):

    rule(draft_tokens,   # [gamma] long: the proposed tokens
         draft_probs,    # [gamma, vocab] float: the (warped) draft distribution each token was drawn from
         target_probs,   # [gamma + 1, vocab] float: the (warped) target distribution at each position;
                         #   row i predicts draft token i, row gamma is the bonus position
         generator,      # torch.Generator | None: all randomness comes from here
         **params) -> VerifyResult
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: int   # accepted draft tokens, a prefix of draft_tokens
    next_token: int     # recovered (num_accepted < gamma) or bonus (num_accepted == gamma) token

    @property
    def emitted(self) -> int:
        return self.num_accepted + 1
