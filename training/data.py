"""Replay-buffer records -> packed, teacher-forced training units for the draft.

A StepRecord at `position` P with draft tokens d[0..gamma-1] holds the target's raw top-k at gamma+1
verified positions: row i (0..gamma) is the target's next-token distribution after the context
`sequence[:P] + d[:i]` (row gamma is the bonus position). The draft, teacher-forced on the same
input, must produce at input index P-1+i a distribution compared with row i.

**Which rows.** Default `rows="all"`: all gamma+1 rows, as DistillSpec and OSD use the whole
proposed block. Rows after the first rejected draft token are still exact targets: the target
scored them conditioned on the draft's own prefix, which is precisely the on-policy state the draft
will be in again. `rows="accepted"` keeps rows 0..num_accepted (the contexts that made it into the
output).

**Packing (one forward per request chunk, not per step).** Rows 0..m of a step, where m = how many
leading draft tokens equal the sequence's tokens at P.. (m = num_accepted unless the output was cut),
have contexts that are prefixes of the final sequence: their hidden states are those of ONE causal
pass over the sequence, at indices P-1+i. Only the rejected suffix d[m..] needs its own tokens: it is
appended after the sequence as a *branch* that attends to `sequence[:P+m]` and to its own earlier
tokens, with position ids P+m, P+m+1, ... (tree attention through a custom 4D mask). A request with S
steps thus costs ~len(sequence) + (rejected tokens) instead of S full contexts.

**Left truncation.** A unit holds at most `max_len` tokens (sequence chunk + branches). A request
that does not fit is split into chunks; a new chunk starts `max_len // 2` tokens before its first
step's position, so every step keeps at least min(P, max_len // 2) tokens of left context (the tokens
before the chunk start are dropped). Position ids restart at 0 in each chunk
(rotary attention only sees relative positions).

**Held-out split.** `is_heldout(request_id, fraction)`: the first 8 bytes of sha256(request_id)
as a number in [0, 1) below `fraction`. It depends on nothing else, so every job trains on the same
complement and the gate's before/after figures of different jobs are comparable.

**Reading.** `read_training_window` consumes the steps stream through a consumer group (default
"distill"); `heldout_window` (evaluation) and `replay_window` (older training records replayed next
to the new ones) are read-only newest-first windows (XREVRANGE; nothing consumed). Delivery is
at-least-once; entries are deduplicated by stream id within a job.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field

import numpy as np

from buffer.records import SequenceRecord, StepRecord
from buffer.redis_store import BufferEntry, ReplayBufferReader, stream_id_key  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

ROW_MODES = ("all", "accepted")


# ----------------------------------------------------------------------------- split and ids
def is_heldout(request_id: str, fraction: float) -> bool:
    """True iff sha256(request_id)[:8] / 2**64 < fraction (deterministic, the same in every job)."""
    if not (0.0 <= fraction < 1.0):
        raise ValueError(f"heldout_fraction must be in [0, 1), got {fraction!r}")
    h = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big")
    return h / 2.0 ** 64 < fraction


# ----------------------------------------------------------------------------- units
@dataclass
class Unit:
    """One packed forward pass: a chunk of one request's sequence followed by branches.

    Token t of the packed input is either a sequence token (t < seq_len; causal) or a branch token
    (branch[t] >= 0) that sees the first `visible_seq[t]` sequence tokens and its own branch up to t.
    Row r is scored at packed index `row_index[r]` against the target's top-k `target_ids[r]` /
    `target_logprobs[r]`; it is row `row_offset[r]` (0..gamma) of step `row_step[r]` (index into
    `stream_ids`).
    """

    request_id: str
    source: str
    stream_ids: list[str]
    seq_start: int                 # sequence index of packed token 0 (left truncation)
    input_ids: np.ndarray          # [L] int64
    position_ids: np.ndarray       # [L] int64
    seq_len: int                   # tokens [0, seq_len) are the sequence chunk
    visible_seq: np.ndarray        # [L] int64: sequence tokens token t may attend to
    branch: np.ndarray             # [L] int64: branch id of token t, -1 for sequence tokens
    row_index: np.ndarray          # [R] int64
    row_step: np.ndarray           # [R] int64
    row_offset: np.ndarray         # [R] int64
    target_ids: np.ndarray         # [R, k] int64 (full-vocabulary ids)
    target_logprobs: np.ndarray    # [R, k] float32 (raw, temperature 1)
    temperature: np.ndarray        # [R] float32: the record's warp, for offline acceptance
    top_k: np.ndarray              # [R] int64
    top_p: np.ndarray              # [R] float32
    step_gamma: list[int] = field(default_factory=list)   # per step

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_rows(self) -> int:
        return int(self.row_index.shape[0])

    def attention_mask(self) -> np.ndarray:
        """[L, L] bool, True = query t may attend to key u."""
        L = self.num_tokens
        u = np.arange(L)
        seq_part = (u[None, :] < self.seq_len) & (u[None, :] < self.visible_seq[:, None])
        same_branch = (self.branch[None, :] == self.branch[:, None]) & (self.branch[:, None] >= 0)
        return seq_part | (same_branch & (u[None, :] <= u[:, None]))


@dataclass
class _Planned:
    entry: BufferEntry
    m: int                         # leading draft tokens found in the sequence
    rows: int                      # rows 0..rows-1 are scored
    end: int                       # sequence tokens needed: [0, end)

    @property
    def branch_len(self) -> int:
        return max(0, self.rows - 1 - self.m)


def _plan(entry: BufferEntry, seq: np.ndarray, rows_mode: str) -> _Planned | str:
    """How a step maps onto its sequence, or a reason string to skip it."""
    st: StepRecord = entry.record
    p, d, n = int(st.position), st.draft_tokens.astype(np.int64), int(st.num_accepted)
    if p < 1 or p > len(seq):
        return "position outside its sequence"
    avail = seq[p: p + len(d)]
    match = np.flatnonzero(avail != d[: len(avail)])
    m = int(match[0]) if match.size else int(len(avail))
    rows = len(d) + 1 if rows_mode == "all" else n + 1
    return _Planned(entry, m, rows, p + min(m, rows - 1))


def _unit(request_id: str, source: str, seq: np.ndarray, lo: int, plans: list[_Planned]) -> Unit:
    hi = max(pl.end for pl in plans)
    tokens = list(seq[lo:hi])
    positions = list(range(hi - lo))
    visible = list(range(1, hi - lo + 1))
    branch = [-1] * (hi - lo)
    r_idx, r_step, r_off, t_ids, t_lps, temp, tk, tp = [], [], [], [], [], [], [], []
    for s, pl in enumerate(plans):
        st: StepRecord = pl.entry.record
        p = int(st.position)
        for i in range(min(pl.m, pl.rows - 1) + 1):          # rows inside the sequence
            r_idx.append(p - 1 + i - lo)
        if pl.branch_len:
            start = len(tokens)
            for j in range(pl.branch_len):
                tokens.append(int(st.draft_tokens[pl.m + j]))
                positions.append(p + pl.m + j - lo)
                visible.append(p + pl.m - lo)
                branch.append(s)
            r_idx.extend(range(start, start + pl.branch_len))
        r_step.extend([s] * pl.rows)
        r_off.extend(range(pl.rows))
        t_ids.append(st.target_topk_ids[: pl.rows].astype(np.int64))
        t_lps.append(st.target_topk_logprobs[: pl.rows].astype(np.float32))
        temp.extend([st.temperature] * pl.rows)
        tk.extend([st.top_k] * pl.rows)
        tp.extend([st.top_p] * pl.rows)
    return Unit(
        request_id=request_id, source=source, stream_ids=[pl.entry.stream_id for pl in plans], seq_start=lo,
        input_ids=np.asarray(tokens, dtype=np.int64), position_ids=np.asarray(positions, dtype=np.int64),
        seq_len=hi - lo, visible_seq=np.asarray(visible, dtype=np.int64), branch=np.asarray(branch, dtype=np.int64),
        row_index=np.asarray(r_idx, dtype=np.int64), row_step=np.asarray(r_step, dtype=np.int64),
        row_offset=np.asarray(r_off, dtype=np.int64), target_ids=np.concatenate(t_ids),
        target_logprobs=np.concatenate(t_lps), temperature=np.asarray(temp, dtype=np.float32),
        top_k=np.asarray(tk, dtype=np.int64), top_p=np.asarray(tp, dtype=np.float32),
        step_gamma=[len(pl.entry.record.draft_tokens) for pl in plans])


def build_units(entries: list[BufferEntry], sequences: dict[str, SequenceRecord], *, max_len: int = 1024,
                rows: str = "all") -> tuple[list[Unit], dict[str, int]]:
    """Pack step entries (with their requests' SequenceRecords) into Units; returns (units, skipped
    counts by reason). Duplicate stream ids are used once."""
    if rows not in ROW_MODES:
        raise ValueError(f"rows must be one of {', '.join(ROW_MODES)}, got {rows!r}")
    if not isinstance(max_len, int) or max_len < 16:
        raise ValueError(f"max_len must be an integer >= 16, got {max_len!r}")
    skipped: dict[str, int] = {}
    by_req: dict[str, list[BufferEntry]] = {}
    seen: set[str] = set()
    for e in entries:
        if e.stream_id in seen:
            skipped["duplicate"] = skipped.get("duplicate", 0) + 1
            continue
        seen.add(e.stream_id)
        by_req.setdefault(e.record.request_id, []).append(e)
    units: list[Unit] = []
    for rid, group in by_req.items():
        seq_rec = sequences.get(rid)
        if seq_rec is None:
            skipped["no sequence"] = skipped.get("no sequence", 0) + len(group)
            continue
        seq = seq_rec.token_ids.astype(np.int64)
        plans: list[_Planned] = []
        for e in sorted(group, key=lambda e: e.record.position):
            pl = _plan(e, seq, rows)
            if isinstance(pl, str):
                skipped[pl] = skipped.get(pl, 0) + 1
            elif len(e.record.draft_tokens) + 2 > max_len // 2:   # rows 0..gamma must fit a fresh chunk
                skipped["block longer than max_len"] = skipped.get("block longer than max_len", 0) + 1
            else:
                plans.append(pl)
        chunk: list[_Planned] = []
        lo = 0
        for pl in plans:
            size = (max([pl.end] + [c.end for c in chunk]) - lo) + sum(c.branch_len for c in chunk) + pl.branch_len
            if chunk and size <= max_len:
                chunk.append(pl)
                continue
            if chunk:
                units.append(_unit(rid, seq_rec.source, seq, lo, chunk))
            lo = max(0, int(pl.entry.record.position) - max_len // 2) if pl.end + pl.branch_len > max_len else 0
            chunk = [pl]
        if chunk:
            units.append(_unit(rid, seq_rec.source, seq, lo, chunk))
    return units, skipped


# ----------------------------------------------------------------------------- reading
@dataclass
class TrainingWindow:
    """What a job read from the consumer group. `entries` are usable training steps (delivered to
    this reader, not acked yet); `sequences` their requests' records; `skipped` counts by reason."""

    entries: list[BufferEntry]
    sequences: dict[str, SequenceRecord]
    skipped: dict[str, int]
    left_pending: list[str]        # released without ack (request still in flight): a later job retries

    def summary(self, stream: str) -> dict:
        """The candidate's data_window (first_id/last_id = oldest/newest stream id used)."""
        ids = sorted((e.stream_id for e in self.entries), key=stream_id_key)
        sources: dict[str, int] = {}
        for e in self.entries:
            src = self.sequences[e.record.request_id].source or "unlabelled"
            sources[src] = sources.get(src, 0) + 1
        return {"stream": stream, "first_id": ids[0] if ids else None, "last_id": ids[-1] if ids else None,
                "steps": len(self.entries), "requests": len({e.record.request_id for e in self.entries}),
                "sources": dict(sorted(sources.items())), "skipped": dict(self.skipped),
                "left_pending": len(self.left_pending)}


def read_training_window(reader: ReplayBufferReader, *, max_records: int, heldout_fraction: float,
                         read_batch: int = 512) -> TrainingWindow:
    """Consume up to `max_records` usable training steps from the reader's group (oldest first).

    Where the group starts is the reader's `start_id` (the job passes the scheduler's cursor); once
    the group exists, its own delivery state (new entries + re-claimed pending ones) decides.
    Acked at once (never trained on): steps of held-out requests, and steps of requests another target
    scored (a reader built with `target`, buffer/redis_store.py: the buffer outlived a change of target or is
    shared with another deployment; their opinions are not this target's). Released without
    ack (left pending for a later job): steps whose request has no SequenceRecord yet (still in
    flight). The usable entries stay pending until the caller acks them after the training step
    that used them (at-least-once).
    """
    if not isinstance(max_records, int) or max_records < 1:
        raise ValueError(f"max_records must be an integer >= 1, got {max_records!r}")
    usable: list[BufferEntry] = []
    sequences: dict[str, SequenceRecord] = {}
    skipped: dict[str, int] = {}
    pending_release: list[str] = []
    seen: set[str] = set()
    while len(usable) < max_records:
        batch = reader.read(count=min(read_batch, max_records - len(usable)), block_ms=0)
        fresh = [e for e in batch if e.stream_id not in seen]
        if not fresh:
            break
        seen.update(e.stream_id for e in fresh)
        to_ack: list[str] = []
        candidates: list[BufferEntry] = []
        for e in fresh:
            if is_heldout(e.record.request_id, heldout_fraction):
                skipped["held out"] = skipped.get("held out", 0) + 1
                to_ack.append(e.stream_id)
            else:
                candidates.append(e)
        need = {e.record.request_id for e in candidates} - sequences.keys()
        sequences.update(reader.get_sequences(need))
        for e in candidates:
            if e.record.request_id in sequences:
                usable.append(e)
            elif e.record.request_id in reader.other_target:       # scored by another target: never this job's to learn
                skipped["another target"] = skipped.get("another target", 0) + 1
                to_ack.append(e.stream_id)
            else:
                skipped["request in flight"] = skipped.get("request in flight", 0) + 1
                pending_release.append(e.stream_id)
        reader.ack(to_ack)
    reader.release(pending_release)
    used = {e.record.request_id for e in usable}
    return TrainingWindow(usable, {r: s for r, s in sequences.items() if r in used}, skipped, pending_release)


def heldout_window(reader: ReplayBufferReader, n: int, *, heldout_fraction: float, source: str | None = None,
                   max_scan: int | None = None) -> tuple[list[BufferEntry], dict[str, SequenceRecord]]:
    """The newest `n` held-out steps (newest first), optionally of one traffic `source`, with their
    SequenceRecords. Read-only (XREVRANGE); steps without a stored sequence are left out. Scans at most
    `max_scan` entries (default 50 * n / max(heldout_fraction, 0.01))."""
    return newest_steps(reader, n, heldout=True, heldout_fraction=heldout_fraction, source=source,
                        max_scan=max_scan or int(50 * n / max(heldout_fraction, 0.01)))


def stratified_heldout(reader: ReplayBufferReader, n: int, *, heldout_fraction: float, category_floor: int = 0,
                       source: str | None = None, extra_reads: int = 3,
                       ) -> tuple[list[BufferEntry], dict[str, SequenceRecord]]:
    """The promotion gate's sample of held-out steps (newest first), read-only: the newest `n`
    (`heldout_window`), and, when `category_floor` > 0, older held-out steps of every traffic source met
    that has steps of fewer than `category_floor` requests in the sample: older steps are read max(`n`,
    1000) at a time, once always (a category the newest `n` crowded out entirely is met there) and at most
    `extra_reads` times, until each source met has its floor. After a traffic shift the newest steps are
    mostly the new traffic; without the floor an earlier category falls below the gate's per-category
    minimum and a candidate that forgot it passes untested. A source absent from the whole scan stays
    absent: the cost is bounded."""
    if isinstance(category_floor, bool) or not isinstance(category_floor, int) or category_floor < 0:
        raise ValueError(f"category_floor must be an integer >= 0, got {category_floor!r}")
    entries, sequences = heldout_window(reader, n, heldout_fraction=heldout_fraction, source=source)
    if not category_floor or source is not None or len(entries) < n:
        return entries, sequences                    # one source asked for, or the whole buffer already read

    def src(e: BufferEntry) -> str:
        return sequences[e.record.request_id].source or "unlabelled"

    requests: dict[str, set[str]] = {}
    for e in entries:
        requests.setdefault(src(e), set()).add(e.record.request_id)
    oldest, chunk = entries[-1].stream_id, max(n, 1000)
    for i in range(extra_reads):
        if i and all(len(r) >= category_floor for r in requests.values()):
            break                                    # (one read always: it finds a category the newest n lack)
        more, more_seqs = newest_steps(reader, chunk, heldout=True, heldout_fraction=heldout_fraction,
                                       before_id=oldest, max_scan=int(50 * chunk / max(heldout_fraction, 0.01)))
        if not more:
            break
        oldest = more[-1].stream_id
        for e in more:
            rid, s = e.record.request_id, more_seqs[e.record.request_id].source or "unlabelled"
            have = requests.setdefault(s, set())
            if rid in have or len(have) < category_floor:    # (a request already in: its older steps too)
                have.add(rid)
                entries.append(e)
                sequences[rid] = more_seqs[rid]
    return entries, sequences


def heldout_units(reader: ReplayBufferReader, n: int, *, heldout_fraction: float, max_len: int = 1024,
                  source: str | None = None, category_floor: int = 0) -> tuple[list[Unit], list[BufferEntry]]:
    """The promotion gate's sample (deploy/gate.py): the held-out steps of `stratified_heldout` (the
    newest `n`, topped up to `category_floor` requests per traffic source) packed into units with every row
    scored (`rows="all"`); returns (units, entries). Held out = `is_heldout(request_id, heldout_fraction)`:
    with the jobs' fraction (or a smaller one) no job ever trained on them."""
    entries, sequences = stratified_heldout(reader, n, heldout_fraction=heldout_fraction, source=source,
                                            category_floor=category_floor)
    units, _ = build_units(entries, sequences, max_len=max_len, rows="all")
    return units, entries


FRESH_SCAN_MS = 600_000       # fresh_window: how far before the cut a fresh request's steps are looked for


def fresh_window(reader: ReplayBufferReader, after: str, n: int, *, heldout_fraction: float,
                 source: str | None = None) -> tuple[list[BufferEntry], dict[str, SequenceRecord]]:
    """The gate's fresh evidence (deploy/gate.py "Fresh evidence"), read-only: the newest `n` steps (newest
    first) of the requests whose SequenceRecord was written after `after` (a job's `data_window.sequence_cut`,
    buffer/redis_store.py `sequence_cursor`) and that are not held out (those are in the held-out sample
    already), optionally of one traffic `source`, with their records. No job up to the one that took that cut can have trained on them: a job
    uses only steps whose request's sequence is stored when it reads. Steps older than FRESH_SCAN_MS before
    the cut are not scanned (a request that long loses its first steps)."""
    ms, _ = stream_id_key(after)
    ids = {r.request_id for r in reader.sequences_after(after) if not is_heldout(r.request_id, heldout_fraction)}
    if not ids:
        return [], {}
    return reader.newest_steps(n, where=lambda st: st.request_id in ids, after_id=f"{max(0, ms - FRESH_SCAN_MS)}-0",
                               source=source)


def replay_window(reader: ReplayBufferReader, n: int, *, before_id: str, heldout_fraction: float,
                  max_scan: int | None = None) -> tuple[list[BufferEntry], dict[str, SequenceRecord]]:
    """The newest `n` training (not held-out) steps strictly older than `before_id`, read-only: older
    traffic replayed next to a job's new records so that adapting to new traffic does not erase what
    the draft does on the old (continual-learning replay)."""
    return newest_steps(reader, n, heldout=False, heldout_fraction=heldout_fraction, before_id=before_id,
                        max_scan=max_scan or 20 * n)


def newest_steps(reader: ReplayBufferReader, n: int, *, heldout: bool, heldout_fraction: float,
                 before_id: str | None = None, source: str | None = None,
                 max_scan: int = 100_000) -> tuple[list[BufferEntry], dict[str, SequenceRecord]]:
    """The newest `n` steps (newest first) whose request is (`heldout=True`) or is not held out, older
    than `before_id` if given, of `source` if given, with their SequenceRecords; steps without a
    stored sequence are left out. Read-only (`ReplayBufferReader.newest_steps`), at most `max_scan`
    entries scanned."""
    is_heldout("", heldout_fraction)                          # validates the fraction before any read
    return reader.newest_steps(n, where=lambda r: is_heldout(r.request_id, heldout_fraction) == heldout,
                               before_id=before_id, source=source, max_scan=max_scan)
