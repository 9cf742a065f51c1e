"""The replay-buffer record schema (pure data, no I/O).

One `StepRecord` per verification step of a served request; one `SequenceRecord` per request with
its full token sequence (prompt + output), so a trainer can rebuild every step's context as
`sequence.token_ids[:step.position]`. The sequence names the target whose opinions its steps hold
(`target`, deploy/artifacts.py `target_fingerprint`): a buffer outlives a change of target, and a job
for one target must not learn another's opinions (buffer/redis_store.py `ReplayBufferReader(target=...)`).

Target opinions are stored as the top-k of the target's *raw* (temperature 1, unwarped)
log-softmax at each verified position: `gamma + 1` positions for a step that proposed `gamma`
draft tokens (position i predicts draft token i; the last one is the bonus position). With the
default top-k 20 warp this is exactly the support of the warped target distribution.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class StepRecord:
    request_id: str
    position: int                    # index in the request's token sequence of the first draft token
    draft_tokens: np.ndarray         # [gamma] int32: what the draft proposed
    num_accepted: int                # how many of draft_tokens the rule accepted (0..gamma)
    target_topk_ids: np.ndarray      # [gamma + 1, k] int32: target top-k token ids per verified position
    target_topk_logprobs: np.ndarray  # [gamma + 1, k] float16/float32: raw target log-probs of those ids
    algorithm: str                   # decoding mode that produced the step ("mjsd", "speculative", ...)
    draft_version: str               # registry version of the draft that proposed the tokens
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    timestamp: float = 0.0           # unix seconds
    next_token: int = -1             # the token the target emitted after the accepted prefix

    def __post_init__(self) -> None:
        self.draft_tokens = np.asarray(self.draft_tokens, dtype=np.int32).reshape(-1)
        self.target_topk_ids = np.asarray(self.target_topk_ids, dtype=np.int32)
        self.target_topk_logprobs = np.asarray(self.target_topk_logprobs)
        if self.target_topk_logprobs.dtype not in (np.float16, np.float32):
            self.target_topk_logprobs = self.target_topk_logprobs.astype(np.float32)
        g = self.draft_tokens.shape[0]
        if self.target_topk_ids.ndim != 2 or self.target_topk_ids.shape != self.target_topk_logprobs.shape:
            raise ValueError("target_topk_ids and target_topk_logprobs must both be [gamma + 1, k]")
        if self.target_topk_ids.shape[0] != g + 1:
            raise ValueError(f"expected {g + 1} verified positions for {g} draft tokens, "
                             f"got {self.target_topk_ids.shape[0]}")
        if not (0 <= self.num_accepted <= g):
            raise ValueError(f"num_accepted {self.num_accepted} outside [0, {g}]")
        if self.position < 0:
            raise ValueError("position must be >= 0")


@dataclass
class SequenceRecord:
    request_id: str
    token_ids: np.ndarray            # [n] int32: prompt + output tokens
    prompt_len: int
    draft_version: str
    timestamp: float = 0.0
    source: str = ""                 # free-form traffic label (e.g. the prompt set), for evaluation windows
    meta: dict = field(default_factory=dict)
    target: str = ""                 # fingerprint of the target that scored the request's steps ("": unknown)

    def __post_init__(self) -> None:
        self.token_ids = np.asarray(self.token_ids, dtype=np.int32).reshape(-1)
        if not (0 <= self.prompt_len <= self.token_ids.shape[0]):
            raise ValueError("prompt_len must be within the sequence")


class RecordSink:
    """What the engine writes to. The Redis writer implements it; `None` sink means no logging.

    Implementations must never block the decode loop for long and never raise.
    """

    def push_step(self, record: StepRecord) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def push_sequence(self, record: SequenceRecord) -> None:  # pragma: no cover - interface
        raise NotImplementedError
