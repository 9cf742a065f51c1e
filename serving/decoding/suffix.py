"""A store of the target's earlier answers that proposes continuations across requests.

Prompt lookup (ngram.py) finds a continuation only inside the request's own context. Served answers
repeat each other far more than they repeat their prompts: a small instruct model opens, structures and
closes its answers with the same phrases ("Here's a step-by-step ...", code boilerplate, list markup), and
a category of traffic repeats its own vocabulary. This is the idea of SuffixDecoding (Oliaro et al., 2024;
served by Snowflake's Arctic Inference) and REST (He et al., 2024): keep the text the model has produced,
match the request's suffix against it, and propose what followed. It learns from traffic the moment an
answer finishes, so it is the part of the service that gets faster without a training job.

Data structure (a suffix tree's cheap relative). `tokens` is the stored text, answers separated by SEP (-1),
each answer preceded by the last `max_match` tokens of its prompt (the chat template's assistant header
among them, so the store can propose an answer's opening). `index` maps every `key_len`-token window
(no SEP inside) to the positions that followed it, the newest `per_key` kept. `propose(context, depth)`
takes the candidates under the context's last `key_len` tokens, scores each by how many more tokens
of the context it matches going backwards (up to `max_match`), keeps the longest matches, and walks their
continuations forward by majority vote: the next token is the one most of the surviving candidates
continue with, and the walk stops when its share falls below `min_support` or the depth is reached.

Memory and time. Tokens and positions are int32 arrays, one index entry per distinct window (`key_of`), nothing
Python's cyclic garbage collector walks; `capacity` tokens at most once an add returns (the oldest answers are
dropped down to half the capacity when it fills, amortised O(1) per token). The index is rebuilt then off the
lock (0.15-0.3 s of Python for a full store), so proposals never wait for it. A proposal costs
O(per_key * max_match) Python steps, about 0.1 ms: nothing beside a target step of tens of milliseconds.

Exactness. A proposal depends on the context and the store, both fixed before the verification pass, so
the greedy and lossless rules on a tree that carries it stay exact (the prompt-lookup argument in
ngram.py). What it changes is speed, and under MJSD's joint test which paths pass. It never carries one
request's text into another's output: the target decides every token. What crosses requests is timing
(a request whose answer repeats an earlier one runs faster), as with any prefix or suffix cache; a
deployment for mutually distrustful tenants turns it off (`DRAFTSMITH_SUFFIX_STORE=0`).

Restarts and replicas (`BufferFollower`). A replica adds its own answers as they finish; the replay buffer holds
every replica's (the sequences stream, prompt and answer token ids). A follower thread reads that stream: at
start the newest answers up to half the store, so a restarted or added replica proposes what the service
already served, then every few seconds the answers written since, so each replica learns from all of the
service's traffic and not only its share. An answer is added once whichever way it arrives (`add`'s `key`, the
request id). Requests whose `log_mode` is "none" are in neither place.
"""
from __future__ import annotations

import logging
import os
import struct
import threading
from array import array
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Iterable, Sequence

SEP = -1
KEY_BITS = 24           # a window's key packs its token ids (each below 2**24) into one int
_POS = struct.Struct("i")   # a position in a bucket: native int32 (memoryview(bucket).cast("i") reads them)
log = logging.getLogger(__name__)


def suffix_store_enabled() -> bool:
    """Whether replicas keep a store (on unless DRAFTSMITH_SUFFIX_STORE is 0 / false / no / off)."""
    return os.environ.get("DRAFTSMITH_SUFFIX_STORE", "1").strip().lower() not in ("0", "false", "no", "off")


def resolve_seed(choice: str | None) -> str | None:
    """The teacher data a store is seeded from: `choice` where it names a file; None for "none", "off" or "0";
    by default (None or "") the bootstrap's <data>/bootstrap/teacher.safetensors where it exists (the served
    default, $DRAFTSMITH_SUFFIX_SEED; the benchmarks' --suffix-seed)."""
    chosen = (choice or "").strip()
    if chosen.lower() in ("none", "off", "0"):
        return None
    if chosen:
        return chosen
    from buffer.paths import data_dir

    seed = data_dir() / "bootstrap" / "teacher.safetensors"
    return str(seed) if seed.is_file() else None


def teacher_answers(path: str | Path) -> list[tuple[list[int], list[int]]]:
    """(prompt, answer) token lists of a teacher-data file (training/teacher.py `save_examples`: the target's
    own answers to the bootstrap's prompts), in file order."""
    from safetensors.numpy import load_file

    d = load_file(str(path))
    toks, pairs, s = d["tokens"], [], 0
    for L, P in zip(d["seq_lens"].tolist(), d["prompt_lens"].tolist()):
        seq = toks[s: s + L].tolist()
        pairs.append((seq[:P], seq[P:]))
        s += L
    return pairs


class SuffixStore:
    """Earlier answers, indexed for cross-request proposals (module docstring). Thread-safe."""

    def __init__(self, capacity: int = 262_144, key_len: int = 2, per_key: int = 64, max_match: int = 12,
                 min_support: float = 0.3) -> None:
        if key_len < 1 or per_key < 1 or max_match < key_len or capacity < 16 * max_match:
            raise ValueError(f"bad SuffixStore settings: key_len={key_len}, per_key={per_key}, "
                             f"max_match={max_match}, capacity={capacity}")
        if not 0.0 < min_support <= 1.0:
            raise ValueError(f"min_support must be in (0, 1], got {min_support}")
        self.capacity, self.key_len, self.per_key = int(capacity), int(key_len), int(per_key)
        self.max_match, self.min_support = int(max_match), float(min_support)
        self.tokens = array("i")                # int32: no Python object per token
        self.index: dict[int, bytearray] = {}   # packed window (`key_of`) -> int32 positions, the newest last
        self.answers = 0
        self._keys: OrderedDict[str, None] = OrderedDict()   # request ids already added, the newest MAX_KEYS
        self.compactions = 0                    # times the oldest half was dropped (`_compact`)
        self._compacting = False                # a thread is rebuilding the index (off the lock)
        self._lock = threading.Lock()

    MAX_KEYS = 65_536

    def __len__(self) -> int:
        return len(self.tokens)

    # ------------------------------------------------------------------ learning
    def add(self, prompt: Sequence[int], answer: Sequence[int], key: str | None = None) -> bool:
        """Store one finished answer (with its prompt's last `max_match` tokens as the lead-in). `key` (the
        request id) makes adding idempotent: an answer whose key was added before is not added again (the
        replica's own answers come back through the buffer). Returns whether it was added."""
        answer = [int(t) for t in answer]
        if not answer:
            return False
        text = [int(t) for t in prompt[-self.max_match:]] + answer
        if min(text) < 0 or max(text) >= 1 << KEY_BITS:
            return False                        # not token ids of any real vocabulary
        with self._lock:
            if key is not None:
                if key in self._keys:
                    return False
                self._keys[key] = None
                if len(self._keys) > self.MAX_KEYS:
                    self._keys.popitem(last=False)
            start = len(self.tokens)
            self.tokens.extend(text)
            self.tokens.append(SEP)
            self._index_into(self.index, self.tokens, start, len(self.tokens) - 1)
            self.answers += 1
            compact = len(self.tokens) > self.capacity and not self._compacting
            if compact:
                self._compacting = True
        if compact:
            self._compact()
        return True

    def add_many(self, pairs: Iterable[tuple[Sequence[int], Sequence[int]]]) -> int:
        n = 0
        for prompt, answer in pairs:
            self.add(prompt, answer)
            n += 1
        return n

    def seed(self, path: str | Path, vocab_size: int | None = None) -> int:
        """Add the answers of a teacher-data file (`teacher_answers`); returns how many. A missing or
        unreadable file, or one holding a token id >= `vocab_size` (data written for another tokenizer), adds
        nothing and is logged: the store then learns from traffic alone."""
        try:
            pairs = teacher_answers(path)
        except Exception as e:  # noqa: BLE001 - seeding is an optimisation, never a failure
            log.warning("suffix store not seeded from %s: %s", path, e)
            return 0
        top = max((max(p + a, default=-1) for p, a in pairs), default=-1)
        if vocab_size is not None and top >= vocab_size:
            log.warning("suffix store not seeded from %s: token id %d is outside the target's vocabulary (%d); "
                        "it was written for another tokenizer", path, top, vocab_size)
            return 0
        n = self.add_many(pairs)
        log.info("suffix store seeded with %d answers (%d tokens) from %s", n, len(self), path)
        return n

    def key_of(self, window: Sequence[int]) -> int:
        """The index key of a `key_len`-token window: its ids packed into one int. Keys are ints and buckets
        bytearrays of int32 positions, objects Python's cyclic garbage collector does not track, so the index
        dict is not tracked either: a full store adds nothing to a collection's walk. (Tuples and lists added a
        tracked object per window, and every full collection of a replica walks all of them.)"""
        key = 0
        for t in window:
            key = (key << KEY_BITS) | int(t)
        return key

    def positions(self, window: Sequence[int]) -> list[int]:
        """The stored positions that followed `window` (at most 2 * per_key, the newest last)."""
        with self._lock:
            bucket = self.index.get(self.key_of(window))
            return memoryview(bucket).cast("i").tolist() if bucket else []

    def _index_into(self, index: dict, toks, start: int, sep: int) -> None:
        """Index into `index` the continuation positions of the answer at toks[start:sep] (toks[sep] is its SEP:
        a window at the answer's end continues with SEP, a vote for stopping)."""
        k, cap = self.key_len, self.per_key
        for p in range(start + k, sep + 1):
            key = (toks[p - 2] << KEY_BITS) | toks[p - 1] if k == 2 else self.key_of(toks[p - k:p])
            bucket = index.get(key)
            if bucket is None:
                index[key] = bytearray(_POS.pack(p))
            else:
                bucket += _POS.pack(p)
                if len(bucket) > 2 * cap * _POS.size:   # amortised trim to the newest `per_key`
                    del bucket[: len(bucket) - cap * _POS.size]

    def _index_all(self, index: dict, toks, start: int = 0) -> None:
        """Index every whole answer of toks[start:] (each ends with its SEP)."""
        for i in range(start, len(toks)):
            if toks[i] == SEP:
                self._index_into(index, toks, start, i)
                start = i + 1

    def _compact(self) -> None:
        """Drop the oldest answers until the store holds about half its capacity, and rebuild the index. The
        rebuild (0.15-0.3 s of Python for a full store) runs off the lock: proposals and adds go on meanwhile,
        against the old index, and the answers added meanwhile are carried over and indexed at the swap. Only
        the thread that set `_compacting` runs it; it repeats while the store is still over its capacity."""
        finished = False
        try:
            while not finished:
                with self._lock:
                    n = len(self.tokens)
                    keep_from = max(n - self.capacity // 2, 0)
                    while 0 < keep_from < n and self.tokens[keep_from - 1] != SEP:
                        keep_from += 1              # start at an answer's boundary
                    kept = self.tokens[keep_from:n]
                index: dict[int, bytearray] = {}
                self._index_all(index, kept)
                with self._lock:
                    carried = len(kept)
                    kept.extend(self.tokens[n:])    # whole answers added during the rebuild
                    self._index_all(index, kept, carried)
                    old = (self.tokens, self.index)     # freed after the lock is let go
                    self.tokens, self.index = kept, index
                    self.compactions += 1
                    finished = len(self.tokens) <= self.capacity
                    if finished:
                        self._compacting = False    # under the lock: an add after this compacts itself
                del old
        finally:
            if not finished:                        # an error: let the next add try again
                with self._lock:
                    self._compacting = False

    # ------------------------------------------------------------------ proposing
    def propose(self, context: Sequence[int], depth: int) -> list[int]:
        """Up to `depth` tokens continuing `context`, from the earlier answers that match its suffix the
        longest; [] when no stored window matches or the continuations disagree from the first token."""
        k = self.key_len
        if depth <= 0 or len(context) < k:
            return []
        window = [int(t) for t in context[len(context) - k:]]
        if min(window) < 0 or max(window) >= 1 << KEY_BITS:
            return []
        key = self.key_of(window)
        with self._lock:
            toks = self.tokens
            bucket = self.index.get(key)
            if not bucket:
                return []
            cands = memoryview(bucket).cast("i")[-self.per_key:].tolist()
            limit = min(self.max_match, len(context))
            best, scored = 0, []
            for p in cands:
                m = k
                while m < limit and p - m - 1 >= 0 and toks[p - m - 1] == context[len(context) - m - 1]:
                    m += 1
                scored.append((m, p))
                best = max(best, m)
            alive = [p for m, p in scored if m == best]
            path: list[int] = []
            n_toks = len(toks)
            while len(path) < depth and alive:
                votes = Counter(toks[p] for p in alive if p < n_toks and toks[p] != SEP)
                if not votes:
                    break
                tok, count = votes.most_common(1)[0]
                if count < self.min_support * len(alive):
                    break
                path.append(tok)
                alive = [p + 1 for p in alive if p < n_toks and toks[p] == tok]
            return path


class BufferFollower:
    """Keeps a replica's store in step with the replay buffer's sequences stream (module docstring, "Restarts
    and replicas"). `reader` is a buffer.redis_store.ReplayBufferReader (any object with its `sequence_cursor`,
    `sequences_after` and `newest`). `warm` adds the newest answers the buffer holds, up to `warm_tokens`
    (default half the store), oldest first; `poll` adds those written since the last call. A sequence holding a
    token id outside `vocab_size` (the buffer of another target) is skipped. Both raise what the reader raises
    (buffer.redis_store.BufferUnavailable when Redis is down); `run` retries them until stopped."""

    def __init__(self, store: SuffixStore, reader, *, vocab_size: int | None = None,
                 warm_tokens: int | None = None, page: int = 500) -> None:
        self.store, self.reader, self.vocab_size, self.page = store, reader, vocab_size, int(page)
        self.warm_tokens = store.capacity // 2 if warm_tokens is None else int(warm_tokens)
        self.cursor: str | None = None          # the newest sequence already read (None: not warmed yet)
        self.added = 0                          # answers this follower put in the store
        self.skipped = 0                        # sequences refused (token ids outside the vocabulary)
        self.error: str | None = None           # why the last warm / poll failed (None: it worked)

    def _learn(self, rec) -> bool:
        toks, p = rec.token_ids, int(rec.prompt_len)
        if p >= len(toks):
            return False
        if int(toks.min()) < 0 or (self.vocab_size is not None and int(toks.max()) >= self.vocab_size):
            self.skipped += 1
            return False
        ok = self.store.add(toks[:p].tolist(), toks[p:].tolist(), key=rec.request_id)
        self.added += ok
        return ok

    def warm(self) -> int:
        """Add the newest stored answers (up to `warm_tokens`), oldest first; returns how many were added."""
        cursor = self.reader.sequence_cursor()      # taken first: whatever is written later, `poll` reads
        chosen, budget, before = [], self.warm_tokens, None
        while budget > 0:
            page = self.reader.newest(self.page, stream="sequences", before_id=before)
            if not page:
                break
            for e in page:
                cost = len(e.record.token_ids) - e.record.prompt_len + min(e.record.prompt_len,
                                                                           self.store.max_match) + 1
                if cost > budget:
                    budget = 0
                    break
                chosen.append(e.record)
                budget -= cost
            before = page[-1].stream_id
        n = sum(self._learn(r) for r in reversed(chosen))
        self.cursor = cursor
        return n

    def poll(self, n: int = 10_000) -> int:
        """Add the answers written since the last `warm` / `poll` (warming first if it never ran)."""
        if self.cursor is None:
            return self.warm()
        cursor = self.reader.sequence_cursor()
        if cursor == self.cursor:
            return 0
        records = self.reader.sequences_after(self.cursor, n)
        self.cursor = cursor                        # (a record read twice is added once: its key)
        return sum(self._learn(r) for r in records)

    def run(self, stop: threading.Event, interval_s: float, enabled=lambda: True) -> None:
        """`poll` every `interval_s` seconds until `stop` is set; a failure is logged once and retried."""
        while not stop.is_set():
            if enabled():
                try:
                    took = self.poll()
                    if took:
                        log.debug("suffix store: %d answers from the replay buffer", took)
                    self.error = None
                except Exception as e:  # noqa: BLE001 - Redis down costs the sharing, never the replica
                    if self.error is None:
                        log.warning("suffix store: cannot read the replay buffer (%s); retrying every %.0f s",
                                    e, interval_s)
                    self.error = f"{type(e).__name__}: {e}"
            stop.wait(interval_s)
