"""Model runners: one model and its KV cache for ONE sequence (the modes that run alone: staged, bild,
spectr, and the trainer's checks), and the draft's output-row mapping shared with the batched path
(serving/kvcache.py holds the batch's caches).
"""
from __future__ import annotations

import copy

import torch

from serving.models import LoadedModel


def full_vocab_logits(logits: torch.Tensor, loaded: LoadedModel, vocab_size: int) -> torch.Tensor:
    """fp32 logits over the FULL vocabulary: a draft with a reduced output layer (`output_token_ids`)
    scatters its rows back (every other token impossible); padded embedding tables are cut."""
    logits = logits.float()
    out_ids = loaded.output_token_ids
    if out_ids is not None:
        full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
        full[..., out_ids] = logits
        return full
    if logits.shape[-1] != vocab_size:  # padded embedding tables (e.g. vocab rounded up)
        return logits[..., :vocab_size]
    return logits


class SequenceRunner:
    """One model + one KV cache for one sequence. `feed` appends tokens and returns logits."""

    def __init__(self, loaded: LoadedModel, vocab_size: int) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.vocab_size = vocab_size
        self.cache = None
        self.length = 0
        self.batch = 1
        self.device = next(self.model.parameters()).device

    def feed(self, tokens: list[int] | torch.Tensor, keep: int) -> torch.Tensor:
        """Append `tokens` ([n] or [batch, n]) to the cache; return fp32 logits of the last `keep`
        positions over the FULL vocabulary: [keep, vocab] (or [batch, keep, vocab])."""
        from transformers import DynamicCache

        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        batched = ids.dim() == 2
        if not batched:
            ids = ids[None]
        if self.cache is None:
            self.cache = DynamicCache()
        with torch.no_grad():
            out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=keep)
        self.cache = out.past_key_values
        self.length += ids.shape[1]
        if self.device.type == "cuda":   # kernels run asynchronously: finish them so the caller's timer is honest
            torch.cuda.synchronize(self.device)
        logits = full_vocab_logits(out.logits[:, -keep:], self.loaded, self.vocab_size)
        return logits if batched else logits[0]

    def feed_hidden(self, tokens: list[int]) -> torch.Tensor:
        """Append `tokens` (one sequence) to the cache and return the last position's hidden state [d] (after the
        final norm: what Medusa heads read), without the output layer: a tree row's prompt prefill."""
        from transformers import DynamicCache

        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device)[None]
        if self.cache is None:
            self.cache = DynamicCache()
        with torch.no_grad():
            out = self.model.get_decoder()(input_ids=ids, past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        self.length += ids.shape[1]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return out.last_hidden_state[0, -1]

    def truncate(self, length: int) -> None:
        if self.cache is not None and self.length > length:
            self.cache.crop(-(self.length - length))
            self.length = length

    def fork(self, batch: int) -> "SequenceRunner":
        """A copy whose cache is repeated `batch` times (for beam sampling); self is unchanged."""
        other = copy.copy(self)
        other.cache = copy.deepcopy(self.cache)
        other.repeat(batch)
        return other

    def repeat(self, batch: int) -> None:
        """In place: a batch-1 cache becomes `batch` identical rows (no copy of self is kept)."""
        if self.batch != 1:
            raise RuntimeError(f"repeat needs a batch-1 cache, this one has {self.batch} rows")
        if self.cache is not None and batch > 1:
            self.cache.batch_repeat_interleave(batch)
        self.batch = batch

    def select(self, rows: torch.Tensor) -> None:
        """Keep the cache rows `rows` ([n] long), in that order."""
        if self.cache is not None:
            self.cache.batch_select_indices(rows.to(self.device))
        self.batch = len(rows)
