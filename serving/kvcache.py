"""KV-cache bookkeeping for a batch of sequences of different lengths (serving/scheduler.py).

One `BatchKV` holds the cache of one model for every running request: a Hugging Face `DynamicCache`
whose rows all have the same number of *slots* L, plus a boolean `valid` mask [rows, L] and each row's
next position id. Requests accept different numbers of tokens, so a row's cache has holes: slots of
rejected draft tokens and of padding are marked invalid and never attended to again. Rotary positions
are given explicitly (`position_ids`), so a token's position is its index in its own sequence, not its
slot. The attention mask passed to the model is `valid` (plus the new block), and the model's causal
mask is built on slot order, which is time order for every row, so causality holds.

Feeding a block: every row gets the same number n of new slots; a row with m < n tokens is padded on
the LEFT of its block (its real tokens are the block's last m slots), so a row's newest logits are
always the block's last positions and `logits_to_keep` works for the whole batch.

Holes cost attention width, not correctness: `compact()` squeezes them out (one gather per layer) when
the slots exceed the longest row by a margin. Rows join (a batch-1 cache prefilled alone, padded on
the left to the common width) and leave (row selection) between steps. Slots that no row holds at the end
of the cache (every row rejected its newest tokens; always so for a lone request) are given back at once
(`drop_last`), so a request stepping alone never has holes.
"""
from __future__ import annotations

import copy

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

PAD_ID = 0   # token fed in padding slots; masked out, so any id works
GROW_SLOTS = 64   # head-room a batch cache layer allocates when it must grow


def _layers(cache) -> list:
    return cache.layers


class GrowableLayer(DynamicLayer):
    """A DynamicLayer that appends in place into a buffer with head-room, instead of concatenating (which
    copies the whole cache of every layer at every forward: for 8 rows of 300 slots on the default target,
    about 110 MB per target pass). The buffers have spare rows too, so a request leaving or joining the
    batch moves one row (`remove_row`, `append_row`), not the whole cache (and a fresh buffer's first
    touch costs page faults on top of the copy: measured 47 ms per leave + join on the default target, 8
    rows). `keys` / `values` are views of the buffers' filled part; assigning them (row selection,
    compaction, forks) replaces the buffers with exactly that tensor, and the next append grows them."""

    def __init__(self, **kwargs) -> None:
        self._kbuf = self._vbuf = None
        self._len = self._vlen = 0    # filled slots of each buffer (equal between updates)
        self._rows = self._vrows = 0  # live rows of each buffer (the buffers may hold more; equal between updates)
        super().__init__(**kwargs)

    @property
    def keys(self):
        return None if self._kbuf is None else self._kbuf[: self._rows, :, : self._len]

    @keys.setter
    def keys(self, value) -> None:
        self._kbuf = value
        self._len = 0 if value is None else value.shape[2]
        self._rows = 0 if value is None else value.shape[0]

    @property
    def values(self):
        return None if self._vbuf is None else self._vbuf[: self._vrows, :, : self._vlen]

    @values.setter
    def values(self, value) -> None:
        self._vbuf = value
        self._vlen = 0 if value is None else value.shape[2]
        self._vrows = 0 if value is None else value.shape[0]

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        self.keys = key_states.new_zeros(b, h, 0, d)
        self.values = value_states.new_zeros(b, value_states.shape[1], 0, value_states.shape[3])
        self.is_initialized = True

    def _regrow(self, rows: int, slots: int) -> None:
        """New buffers of at least `rows` rows and `slots` slots (with head-room), the live part copied."""
        kb, vb = self._kbuf, self._vbuf
        cap_r = max(rows, kb.shape[0])
        cap_s = max(slots, kb.shape[2])
        if rows > kb.shape[0]:
            cap_r = max(rows, 2 * kb.shape[0])
        if slots > kb.shape[2]:
            cap_s = slots + max(GROW_SLOTS, slots // 4)
        nk = kb.new_empty(cap_r, kb.shape[1], cap_s, kb.shape[3])
        nv = vb.new_empty(cap_r, vb.shape[1], cap_s, vb.shape[3])
        if self._len and self._rows:
            nk[: self._rows, :, : self._len] = kb[: self._rows, :, : self._len]
            nv[: self._rows, :, : self._len] = vb[: self._rows, :, : self._len]
        self._kbuf, self._vbuf = nk, nv

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[2]
        need = self._len + n
        if self._vlen != self._len or self._vrows != self._rows:
            raise RuntimeError(f"keys hold {self._rows}x{self._len} slots but values {self._vrows}x{self._vlen}")
        if key_states.shape[0] != self._rows:
            if self._len:
                raise RuntimeError(f"{key_states.shape[0]} new rows for a cache of {self._rows}")
            self._rows = self._vrows = key_states.shape[0]     # nothing cached yet: the first forward sets the rows
        kb, vb = self._kbuf, self._vbuf
        if need > min(kb.shape[2], vb.shape[2]) or self._rows > min(kb.shape[0], vb.shape[0]):
            self._regrow(self._rows, need)
        self._kbuf[: self._rows, :, self._len: need] = key_states
        self._vbuf[: self._rows, :, self._len: need] = value_states
        self._len = self._vlen = need
        return self.keys, self.values

    def remove_row(self, row: int) -> None:
        """Drop live row `row`: the last live row moves into its place (one row copied, no reallocation)."""
        last = self._rows - 1
        if not 0 <= row <= last:
            raise IndexError(f"row {row} of {self._rows}")
        if row != last and self._len:
            self._kbuf[row, :, : self._len] = self._kbuf[last, :, : self._len]
            self._vbuf[row, :, : self._len] = self._vbuf[last, :, : self._len]
        self._rows = self._vrows = last

    def append_row(self, keys, values) -> None:
        """A new last row holding `keys` / `values` ([1, heads, L, dim], L <= the filled slots), right-aligned
        with zeros on its left (masked padding: zeros, so a masked slot never feeds NaN into attention)."""
        m = keys.shape[2]
        if m > self._len:
            raise ValueError(f"a row of {m} slots does not fit a cache of {self._len}")
        if self._rows + 1 > self._kbuf.shape[0]:
            self._regrow(self._rows + 1, self._len)
        r = self._rows
        self._kbuf[r, :, : self._len - m] = 0
        self._vbuf[r, :, : self._len - m] = 0
        if m:
            self._kbuf[r, :, self._len - m: self._len] = keys[0]
            self._vbuf[r, :, self._len - m: self._len] = values[0]
        self._rows = self._vrows = r + 1

    def gathered(self, rows, extra_slots: int, into: "GrowableLayer | None" = None) -> "GrowableLayer":
        """A new layer holding copies of live rows `rows` (repeats allowed), with head-room for
        `extra_slots` appends, filled by one index_select straight into its buffers. `into`: a layer
        whose buffers to fill instead of new ones where they are large enough (a reused fork: no
        allocation, no page faults; it must be done with them); new buffers then get GROW_SLOTS more
        head-room, so the next forks fit too."""
        other = GrowableLayer()
        other.dtype, other.device, other.is_initialized = self.dtype, self.device, True
        n, need = len(rows), self._len + extra_slots
        kb, vb = (into._kbuf, into._vbuf) if into is not None else (None, None)
        fits = kb is not None and all(
            b.shape[0] >= n and b.shape[2] >= need and b.shape[1] == src.shape[1] and b.shape[3] == src.shape[3]
            and b.dtype == src.dtype and b.device == src.device for b, src in ((kb, self._kbuf), (vb, self._vbuf)))
        if not fits:
            cap = need + (GROW_SLOTS if into is not None else 0)
            kb = self._kbuf.new_empty(n, self._kbuf.shape[1], cap, self._kbuf.shape[3])
            vb = self._vbuf.new_empty(n, self._vbuf.shape[1], cap, self._vbuf.shape[3])
        torch.index_select(self.keys, 0, rows, out=kb[:n, :, : self._len])
        torch.index_select(self.values, 0, rows, out=vb[:n, :, : self._len])
        other._kbuf, other._vbuf = kb, vb
        other._len = other._vlen = self._len
        other._rows = other._vrows = n
        return other

    def keep_tail(self, start: int, slots: list[int]) -> None:
        """Keep slots [0, start) and then `slots` (each >= start, increasing), dropping every other slot:
        only the kept tail moves, in place (a tree step's accepted path, serving/decoding/tree.py keep_path)."""
        if self._kbuf is None:
            return
        k = len(slots)
        if k and slots != list(range(start, start + k)):
            idx = torch.as_tensor(slots, dtype=torch.long, device=self._kbuf.device)
            self._kbuf[: self._rows, :, start: start + k] = self.keys.index_select(2, idx)
            self._vbuf[: self._rows, :, start: start + k] = self.values.index_select(2, idx)
        self._len = self._vlen = start + k


def growable_cache(source=None):
    """A DynamicCache whose layers are GrowableLayers, holding `source`'s tensors if given."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowableLayer
    if source is not None:
        cache.layers = []
        for layer in _layers(source):
            g = GrowableLayer()
            g.lazy_initialization(layer.keys, layer.values)
            g.keys, g.values = layer.keys, layer.values
            cache.layers.append(g)
    return cache


class BatchKV:
    """One model's KV cache for a batch of rows with holes; see the module docstring."""

    def __init__(self, model, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.cache = None                                        # DynamicCache or None when empty
        self.valid = torch.zeros(0, 0, dtype=torch.bool, device=device)
        self.lengths: list[int] = []                             # valid slots per row = next position id
        self._fork_pool: list = []                               # layers of the last reused fork (fork(reuse=True))

    # ------------------------------------------------------------------ shape
    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def slots(self) -> int:
        return self.valid.shape[1]

    # ------------------------------------------------------------------ forward
    def _block_inputs(self, blocks: list[list[int]], offsets: list[torch.Tensor] | None = None):
        """Token ids, position ids and validity [rows, n] of one block per row, each left-padded to the longest
        (n >= 1). A row's token i sits at position `lengths[r] + offsets[r][i]` (default i: a chain); padding
        slots get the row's next position, harmless (masked as keys, ignored as queries)."""
        if len(blocks) != self.rows or (offsets is not None and len(offsets) != self.rows):
            raise ValueError(f"{len(blocks)} blocks for {self.rows} rows")
        n = max(1, max(len(b) for b in blocks))
        ids = torch.full((self.rows, n), PAD_ID, dtype=torch.long)
        block_valid = torch.zeros(self.rows, n, dtype=torch.bool)
        pos = torch.tensor(self.lengths, dtype=torch.long)[:, None].repeat(1, n)
        for r, b in enumerate(blocks):
            m = len(b)
            if m:
                ids[r, n - m:] = torch.as_tensor(b, dtype=torch.long)
                block_valid[r, n - m:] = True
                pos[r, n - m:] += torch.arange(m) if offsets is None else torch.as_tensor(offsets[r], dtype=torch.long)
        return ids, pos, block_valid

    def feed(self, blocks: list[list[int]], keep: int) -> torch.Tensor:
        """Append one block per row (rows in order; a row may get []) and return fp32 logits of the
        last `keep` block positions: [rows, keep, vocab]. Rows with fewer tokens are left-padded."""
        ids, pos, block_valid = self._block_inputs(blocks)
        block_valid = block_valid.to(self.device)
        mask = torch.cat([self.valid, block_valid], dim=1)
        if self.cache is None:
            self.cache = growable_cache()
        with torch.no_grad():
            out = self.model(input_ids=ids.to(self.device), attention_mask=mask.long(),
                             position_ids=pos.to(self.device), past_key_values=self.cache, use_cache=True,
                             logits_to_keep=keep)
        self.cache = out.past_key_values
        self.valid = mask
        for r, b in enumerate(blocks):
            self.lengths[r] += len(b)
        return out.logits[:, -keep:].float()

    def feed_tree(self, blocks: list[list[int]], block_masks: list[torch.Tensor], block_pos: list[torch.Tensor],
                  keep: int, logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
        """`feed` for blocks that are trees (serving/scheduler.py, the heads' trees of several requests in one
        target pass): row r's block of m tokens attends over itself by `block_masks[r]` (bool [m, m]: a chain
        of context tokens is causal, a tree node sees its ancestors) and its tokens sit at positions
        `lengths[r] + block_pos[r]` (a node's position is its depth, not its slot). Returns fp32 logits and
        the last hidden states (after the final norm, what the heads read) of the last `keep` block
        positions: [rows, keep, vocab], [rows, keep, d]. logits=False: the output layer does not run (None
        for the logits; the rows' rules run it on the rows they read, serving/decoding/tree.py
        `verdict_on_demand`). Every new slot is valid until `keep_new` keeps each row's accepted slots only."""
        if len(block_masks) != self.rows:
            raise ValueError(f"{len(block_masks)} masks for {self.rows} rows")
        for r, (b, bm, bp) in enumerate(zip(blocks, block_masks, block_pos)):
            if bm.shape != (len(b), len(b)) or len(bp) != len(b):
                raise ValueError(f"row {r}: a block of {len(b)} tokens needs a [{len(b)}, {len(b)}] mask and "
                                 f"{len(b)} positions")
        ids, pos, block_valid = self._block_inputs(blocks, block_pos)
        n = ids.shape[1]
        inner = torch.eye(n, dtype=torch.bool).repeat(self.rows, 1, 1)   # padding queries see only themselves
        for r, (b, bm) in enumerate(zip(blocks, block_masks)):
            if b:
                inner[r, n - len(b):, n - len(b):] = bm
        past = self.valid.cpu()[:, None, :].expand(-1, n, -1) & block_valid[:, :, None]
        allowed = torch.cat([past, inner], dim=2)                        # [rows, n, slots + n]
        dtype = next(self.model.parameters()).dtype
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]
        if self.cache is None:
            self.cache = growable_cache()
        with torch.no_grad():
            out = self.model.get_decoder()(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                           position_ids=pos.to(self.device), past_key_values=self.cache,
                                           use_cache=True)
            hidden = out.last_hidden_state[:, -keep:]
            rows = self.model.get_output_embeddings()(hidden).float() if logits else None
        self.cache = out.past_key_values
        self.valid = torch.cat([self.valid, block_valid.to(self.device)], dim=1)
        for r, b in enumerate(blocks):
            self.lengths[r] += len(b)
        return rows, hidden

    def keep_new(self, width: int, keeps: list[list[int]]) -> None:
        """After a feed of `width` new slots (the cache's last `width`), row r keeps only its new slots
        `keeps[r]` (indices into those `width`, increasing): they move, in order, to the first of the new
        slots, every other new slot becomes a hole, and slots that no row holds any more are given back.
        A tree step keeps the context it fed, the root and the accepted path."""
        if len(keeps) != self.rows:
            raise ValueError(f"{len(keeps)} keeps for {self.rows} rows")
        start = self.slots - width
        for r, keep in enumerate(keeps):
            fed = int(self.valid[r, start:].sum())
            if len(keep) > fed or any(not 0 <= k < width for k in keep):
                raise ValueError(f"row {r}: cannot keep new slots {keep} of {fed}")
            self.lengths[r] += len(keep) - fed
            self.valid[r, start:] = False
            self.valid[r, start: start + len(keep)] = True
            if keep == list(range(len(keep))):
                continue                                # already in place
            src = torch.as_tensor(keep, dtype=torch.long, device=self.device) + start
            for layer in _layers(self.cache):
                layer.keys[r, :, start: start + len(keep)] = layer.keys[r, :, src]
                layer.values[r, :, start: start + len(keep)] = layer.values[r, :, src]
        self._trim_tail()

    # ------------------------------------------------------------------ rollback
    def drop_last(self, row: int, count: int) -> None:
        """Invalidate the row's `count` newest valid slots (rejected draft tokens)."""
        if count <= 0:
            return
        idx = self.valid[row].nonzero().flatten()
        if count > len(idx):
            raise ValueError(f"row {row} has {len(idx)} valid slots, cannot drop {count}")
        self.valid[row, idx[len(idx) - count:]] = False
        self.lengths[row] -= count
        self._trim_tail()

    def _trim_tail(self) -> None:
        """Give back the trailing slots that no row holds (a lone request's rejected draft tokens are always
        the newest slots): the next block is written over them, so they never become holes that widen
        every later attention and force a masked attention over the whole cache."""
        if self.cache is None or not self.slots:
            return
        held = self.valid.any(dim=0).nonzero()
        keep = int(held[-1]) + 1 if len(held) else 0
        if keep == self.slots:
            return
        for layer in _layers(self.cache):
            if isinstance(layer, GrowableLayer) and layer._len == self.slots:
                layer._len = layer._vlen = keep
            else:
                layer.keys, layer.values = layer.keys[:, :, :keep], layer.values[:, :, :keep]
        self.valid = self.valid[:, :keep]

    def truncate(self, row: int, length: int) -> None:
        """Keep the row's first `length` tokens."""
        self.drop_last(row, self.lengths[row] - length)

    # ------------------------------------------------------------------ membership
    def add_row(self, cache, length: int) -> int:
        """Append a row holding a batch-1 `cache` of `length` tokens (a prompt prefilled alone), padded on
        the left to the common width; `cache=None` (length 0) adds a row with nothing cached yet.
        Returns its row index."""
        if cache is None or length == 0:     # a row with nothing cached yet (a one-token prompt, a reset)
            if self.cache is not None:
                for layer in _layers(self.cache):
                    layer.append_row(layer.keys[:1, :, :0], layer.values[:1, :, :0])
            self.valid = torch.cat([self.valid, self.valid.new_zeros(1, self.slots)])
            self.lengths.append(0)
            return self.rows - 1
        if self.cache is None:     # nothing cached yet (empty batch, or every row was reset)
            self.cache = growable_cache(cache)
            old = self.rows
            if old:
                for layer in _layers(self.cache):
                    layer.keys = torch.cat([layer.keys.new_zeros(old, *layer.keys.shape[1:]), layer.keys])
                    layer.values = torch.cat([layer.values.new_zeros(old, *layer.values.shape[1:]), layer.values])
            self.valid = torch.zeros(old + 1, length, dtype=torch.bool, device=self.device)
            self.valid[old] = True
            self.lengths.append(length)
            return old
        width = max(self.slots, length)
        self._pad_left(width - self.slots)
        for layer, new in zip(_layers(self.cache), _layers(cache)):
            layer.append_row(new.keys, new.values)
        row_valid = torch.zeros(1, width, dtype=torch.bool, device=self.device)
        row_valid[0, width - length:] = True
        self.valid = torch.cat([self.valid, row_valid], dim=0)
        self.lengths.append(length)
        return self.rows - 1

    def _pad_left(self, extra: int) -> None:
        if extra <= 0:
            return
        if self.cache is not None:
            for layer in _layers(self.cache):
                layer.keys = _left_pad(layer.keys, layer.keys.shape[2] + extra)
                layer.values = _left_pad(layer.values, layer.values.shape[2] + extra)
        self.valid = torch.cat([self.valid.new_zeros(self.rows, extra), self.valid], dim=1)

    def select(self, rows: list[int] | torch.Tensor) -> None:
        """Keep these rows, in this order (a row may repeat: beam forks)."""
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        if self.cache is not None:
            for layer in _layers(self.cache):
                layer.keys = layer.keys.index_select(0, idx)
                layer.values = layer.values.index_select(0, idx)
        self.valid = self.valid.index_select(0, idx)
        self.lengths = [self.lengths[int(i)] for i in idx]

    def remove(self, row: int) -> None:
        """Drop `row`; the last row takes its index (one row of each layer moves, nothing is reallocated).
        The caller reorders its own list the same way: `rows[row] = rows[-1]; rows.pop()`."""
        last = self.rows - 1
        if not 0 <= row <= last:
            raise IndexError(f"row {row} of {self.rows}")
        if self.cache is not None:
            for layer in _layers(self.cache):
                layer.remove_row(row)
        if row != last:
            self.valid[row] = self.valid[last]
            self.lengths[row] = self.lengths[last]
        self.valid = self.valid[:last]
        self.lengths.pop()

    def reorder_tail(self, rows: list[int], tail: int) -> None:
        """`select(rows)` for rows that differ only in their last `tail` slots (the beams of one group:
        identical prefixes, copied from one row): only those slots move, in place."""
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        if tail <= 0:
            return
        if self.cache is not None:
            for layer in _layers(self.cache):
                layer.keys[:, :, -tail:] = layer.keys[:, :, -tail:].index_select(0, idx)
                layer.values[:, :, -tail:] = layer.values[:, :, -tail:].index_select(0, idx)
        self.valid[:, -tail:] = self.valid[:, -tail:].index_select(0, idx)
        self.lengths = [self.lengths[int(i)] for i in idx]

    def fork(self, rows: list[int], extra_slots: int = GROW_SLOTS, reuse: bool = False) -> "BatchKV":
        """A new BatchKV over copies of `rows` (repeats allowed), with room for `extra_slots` appended
        slots before its buffers must grow; self is unchanged (the fork has buffers of its own).
        `reuse`: fill the buffers of the previous reused fork where they are large enough (the draft's
        fork at every step: 64 rows of MJSD beams are tens of MB, and fresh memory costs page faults each
        time); that earlier fork must no longer be in use."""
        other = BatchKV(self.model, self.device)
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        if self.cache is not None:
            layers = _layers(self.cache)
            pool = self._fork_pool if reuse and len(self._fork_pool) == len(layers) else [None] * len(layers)
            other.cache = copy.copy(self.cache)
            other.cache.layers = [layer.gathered(idx, extra_slots, into) for layer, into in zip(layers, pool)]
            if reuse:    # the fork's layers: their buffers as they are at the next fork (grown, if they grew)
                self._fork_pool = list(other.cache.layers)
        other.valid = self.valid.index_select(0, idx)
        other.lengths = [self.lengths[int(i)] for i in idx]
        return other

    def reset(self) -> None:
        """Forget every row's tokens (a new model): rows stay, caches empty."""
        self.cache = None
        self.valid = torch.zeros(self.rows, 0, dtype=torch.bool, device=self.device)
        self.lengths = [0] * self.rows

    # ------------------------------------------------------------------ holes
    def holes(self) -> int:
        return self.rows * self.slots - sum(self.lengths)

    def compact(self, slack: int = 32) -> bool:
        """Squeeze out holes when the slots exceed the longest row by more than `slack`; each row's
        valid slots keep their order and end up right-aligned. Returns whether it compacted."""
        if self.rows == 0 or self.cache is None:
            return False
        width = max(self.lengths)
        if self.slots - width <= slack:
            return False
        gather = torch.zeros(self.rows, width, dtype=torch.long, device=self.device)
        valid = torch.zeros(self.rows, width, dtype=torch.bool, device=self.device)
        for r in range(self.rows):
            idx = self.valid[r].nonzero().flatten()
            gather[r, width - len(idx):] = idx
            valid[r, width - len(idx):] = True
        for layer in _layers(self.cache):
            g = gather[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            keys, values = layer.keys.gather(2, g), layer.values.gather(2, g)
            layer._kbuf[: self.rows, :, :width] = keys     # back into the same buffers: nothing to regrow
            layer._vbuf[: self.rows, :, :width] = values
            layer._len = layer._vlen = width
        self.valid = valid
        return True


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """[b, h, l, d] -> [b, h, width, d] with zeros on the left."""
    extra = width - t.shape[2]
    if extra <= 0:
        return t
    return torch.cat([t.new_zeros(t.shape[0], t.shape[1], extra, t.shape[3]), t], dim=2)


class PrefixCache:
    """Target KV of recent prompts, so a new prompt that starts like one of them (the chat template's system
    prompt, earlier turns of a conversation) prefills only the rest (as vLLM's automatic prefix caching,
    with whole prompts as entries). Least recently used entries go once more than `max_tokens` are held.
    Entries are private copies: nothing the batch does changes them."""

    def __init__(self, max_tokens: int = 2048, min_match: int = 8) -> None:
        self.max_tokens = max_tokens
        self.min_match = min_match
        self._entries: list[tuple[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]]] = []
        self.hits = self.lookups = self.tokens_saved = 0

    def clear(self) -> None:
        """Forget every entry (benchmarks: each timed row prefills its prompt as a first request would)."""
        self._entries = []

    def put(self, tokens: list[int], cache) -> None:
        if not tokens or len(tokens) > self.max_tokens or cache is None:
            return
        key = tuple(tokens)
        self._entries = [e for e in self._entries if e[0] != key]
        n = len(tokens)
        layers = [(layer.keys[:, :, :n].clone(), layer.values[:, :, :n].clone()) for layer in _layers(cache)]
        self._entries.append((key, layers))
        while sum(len(k) for k, _ in self._entries) > self.max_tokens:
            self._entries.pop(0)

    def get(self, tokens: list[int]):
        """(matched length, a batch-1 DynamicCache of that prefix) for the longest cached prefix of `tokens`
        (at least `min_match`), else (0, None)."""
        self.lookups += 1
        best, best_i = 0, -1
        for i, (key, _) in enumerate(self._entries):
            n = 0
            for a, b in zip(key, tokens):
                if a != b:
                    break
                n += 1
            if n > best:
                best, best_i = n, i
        if best < self.min_match:
            return 0, None
        key, layers = self._entries.pop(best_i)
        self._entries.append((key, layers))           # most recently used
        cache = DynamicCache()
        for i, (k, v) in enumerate(layers):
            cache.update(k[:, :, :best].clone(), v[:, :, :best].clone(), i)
        self.hits += 1
        self.tokens_saved += best
        return best, cache
