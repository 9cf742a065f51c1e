"""The replay buffer on Redis Streams: a non-blocking writer for the engine, a consumer-group reader
for the trainer, and read-only windows for evaluation. The one module in the project that imports
`redis`.

Key layout (`prefix` from BufferConfig, default "draftsmith:buf"; tests use a unique prefix each):

    {prefix}:steps             STREAM  one entry per verification step; field "d" = codec bytes of a
                                       StepRecord (buffer/codec.py). XADD ... MAXLEN ~ max_steps; every
                                       trim_interval_s, XTRIM MINID ~ (Redis server time - max_age_s).
                                       Trainers read it through a consumer group (default "trainer").
    {prefix}:seqs              STREAM  one entry per finished request; field "d" = codec bytes of a
                                       SequenceRecord; MAXLEN ~ max_sequences, same MINID trimming.
    {prefix}:seq:{request_id}  STRING  the same SequenceRecord bytes, expiring after max_age_s
                                       (sequence_ttl_s when max_age_s is None).

Why a sequence is stored twice: the stream gives ordered windows ("the newest 500 requests from
source X") and consumer groups; the per-request key gives a trainer an O(1) look-up of a step's
context (`sequence.token_ids[:step.position]`) by the step's request_id. It is a key per request
rather than one hash because Redis < 7.4 cannot expire single hash fields, and every sequence
must age out on its own. The duplication is cheap: a request's sequence (4 B/token) is small
next to its steps (~0.7 KB per step). Entry ids are Redis-generated ("<ms>-<n>", server clock),
which is what makes MINID trimming by age work.

Delivery: at-least-once. A reader's entries stay pending in the group until `ack`; entries that
a dead reader left pending are claimed by the next reader (XAUTOCLAIM, after `min_idle_ms`). Within
one reader, ids already delivered or acked are not delivered again (dedup by stream id); across
readers a re-claimed entry can be seen twice, so training on it must tolerate a repeat.

Log modes: see buffer/codec.py (`full`, `ids_only`, `none`). The stricter of the request's mode
and the deployment's `BufferConfig.log_mode` applies.

Needs Redis >= 6.2 (XAUTOCLAIM, XTRIM MINID, exclusive XREVRANGE bounds).
"""
from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from buffer import embedded
from buffer.codec import (KIND_SEQUENCE, KIND_STEP, LOG_MODES, DecodeError, EncodeError, apply_log_mode,
                          check_log_mode, decode_sequence, decode_step, encode_sequence, encode_step)
from buffer.records import RecordSink, SequenceRecord, StepRecord

log = logging.getLogger(__name__)

FIELD = b"d"                     # the one field of every stream entry: the codec bytes
_STRICTNESS = {m: i for i, m in enumerate(LOG_MODES)}   # full < ids_only < none
_CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)


class BufferUnavailable(RuntimeError):
    """A reader could not reach Redis (down, timed out). The writer never raises this."""


# ----------------------------------------------------------------------------- configuration
@dataclass
class BufferConfig:
    """Where the buffer lives and how much it keeps.

    prefix: key prefix (see the module docstring).
    max_steps / max_sequences: MAXLEN ~ bound of each stream (None: no count bound). Approximate
      trimming removes whole stream nodes, so a stream can exceed its bound by up to one node
      (stream-node-max-entries, 100 by default, fewer for ~0.7 KB entries: 4 KB nodes hold ~5).
    max_age_s: drop entries older than this (MINID trimming every trim_interval_s, and the TTL of
      the per-request sequence keys). None: no age bound.
    sequence_ttl_s: TTL of the sequence keys when max_age_s is None.
    queue_size: bound of the writer's in-process queue; a push into a full queue is dropped.
    batch_size: most records per pipelined round trip; flush_interval_s: longest a record waits.
    log_mode: deployment-wide log mode; the stricter of it and a request's own mode applies.
    logprob_dtype: "float16" (default, ~0.7 KB/step at k=20, gamma=4) or "float32".
    log_interval_s: at most one warning per kind of failure per this many seconds.
    """

    prefix: str = "draftsmith:buf"
    max_steps: int | None = 200_000
    max_sequences: int | None = 50_000
    max_age_s: float | None = 7 * 24 * 3600.0
    sequence_ttl_s: float = 7 * 24 * 3600.0
    queue_size: int = 20_000
    batch_size: int = 500
    flush_interval_s: float = 0.01
    trim_interval_s: float = 30.0
    log_mode: str = "full"
    logprob_dtype: str = "float16"
    log_interval_s: float = 30.0

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or not self.prefix or any(c.isspace() for c in self.prefix):
            raise ValueError(f"prefix must be a non-empty string without spaces, got {self.prefix!r}")
        for name in ("max_steps", "max_sequences"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {v!r}")
        for name in ("queue_size", "batch_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.max_age_s is not None and not (self.max_age_s > 0):
            raise ValueError(f"max_age_s must be > 0 or None, got {self.max_age_s!r}")
        for name in ("sequence_ttl_s", "flush_interval_s", "trim_interval_s", "log_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        check_log_mode(self.log_mode)
        if self.logprob_dtype not in ("float16", "float32"):
            raise ValueError(f"logprob_dtype must be 'float16' or 'float32', got {self.logprob_dtype!r}")

    @property
    def steps_key(self) -> str:
        return f"{self.prefix}:steps"

    @property
    def seqs_key(self) -> str:
        return f"{self.prefix}:seqs"

    def seq_key(self, request_id: str) -> str:
        return f"{self.prefix}:seq:{request_id}"

    @property
    def sequence_key_ttl_s(self) -> float:
        return self.max_age_s if self.max_age_s is not None else self.sequence_ttl_s


# ----------------------------------------------------------------------------- connection
def redis_url_from_env() -> str | None:
    """`$REDIS_URL`, or None when unset/empty (then `connect` starts the embedded server)."""
    return os.environ.get("REDIS_URL") or None


def resolve_redis_url(url: str | None = None) -> str:
    """`url`, else `$REDIS_URL`, else the URL of the embedded server (started if needed): the URL to hand
    to a process or task that must reach the same Redis (a job's Ray task, the gate's reader)."""
    return url or redis_url_from_env() or embedded.ensure_embedded()


def stream_id_key(stream_id: str) -> tuple[int, int]:
    """'<ms>-<seq>' -> (ms, seq), for ordering Redis stream ids; ValueError on anything else."""
    try:
        ms, _, seq = str(stream_id).partition("-")
        return int(ms), int(seq or 0)
    except ValueError:
        raise ValueError(f"not a Redis stream id: {stream_id!r} (expected '<ms>-<seq>')") from None


def connect(url: str | None = None, *, socket_timeout: float = 2.0, socket_connect_timeout: float = 1.0,
            health_check_interval: int = 10, client_name: str = "draftsmith-buffer") -> redis.Redis:
    """A binary-safe client for `url`, else `$REDIS_URL`, else the embedded server (buffer/embedded.py).

    Options, deliberately:
    - socket_timeout / socket_connect_timeout short (2 s / 1 s): a hung Redis shows up as an error
      within seconds, so the writer's thread notices and starts dropping instead of stalling.
    - health_check_interval 10 s: a connection idle that long is PINGed before use, so a half-open
      socket (Redis restarted behind a NAT, say) fails on the PING rather than on a write.
    - NO automatic retries (redis-py 8 defaults to 10 retries with backoff on connection and timeout
      errors): a timed-out XADD may already have been applied, and retrying it appends the entry a
      second time under a new id. The writer drops and counts instead; readers surface the error.
    """
    target = url or redis_url_from_env() or embedded.ensure_embedded()
    return redis.Redis.from_url(
        target, socket_timeout=socket_timeout, socket_connect_timeout=socket_connect_timeout,
        health_check_interval=health_check_interval, retry=Retry(NoBackoff(), 0), retry_on_error=[],
        client_name=client_name, decode_responses=False)


def delete_prefix(url: str | None, prefix: str) -> int:
    """Delete every key under `prefix:` (a buffer's streams, sequences, groups); returns how many. For tests
    and benchmarks that write a buffer of their own and must leave Redis as they found it."""
    client = connect(url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        return client.delete(*keys) if keys else 0
    finally:
        client.close()


def _client(client: "redis.Redis | str | None", **kw) -> redis.Redis:
    return client if isinstance(client, redis.Redis) else connect(client, **kw)


def trim_by_age(client: redis.Redis, config: BufferConfig, *, exact: bool = False) -> int:
    """XTRIM MINID both streams to (Redis server time - config.max_age_s); return entries removed.

    Approximate (`~`) by default: only whole stream nodes go, so a few entries past the age may stay.
    """
    if config.max_age_s is None:
        return 0
    sec, usec = client.time()
    cutoff_ms = int(sec) * 1000 + int(usec) // 1000 - int(config.max_age_s * 1000)
    if cutoff_ms <= 0:
        return 0
    pipe = client.pipeline(transaction=False)
    for key in (config.steps_key, config.seqs_key):
        pipe.xtrim(key, minid=f"{cutoff_ms}-0", approximate=not exact)
    return int(sum(pipe.execute()))


# ----------------------------------------------------------------------------- counters
_process_decode_errors = 0
_decode_lock = threading.Lock()


def _count_decode_error() -> None:
    global _process_decode_errors
    with _decode_lock:
        _process_decode_errors += 1


def process_decode_errors() -> int:
    """Records that failed to decode in this process (readers, windows, sequence look-ups)."""
    return _process_decode_errors


class _Throttle:
    """At most one log line per key per interval, with a count of the suppressed ones."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warn(self, key: str, msg: str, *args) -> None:
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        self._last[key] = now
        n = self._suppressed.pop(key, 0)
        log.warning("replay buffer: " + msg + (f" ({n} similar since the last message)" if n else ""), *args)


# ----------------------------------------------------------------------------- writer
class ReplayBufferWriter(RecordSink):
    """The engine's sink: `push_*` append to a bounded in-process queue and return at once; a
    background thread writes the queue to Redis in pipelined, non-transactional batches.

    push_* never block and never raise. A record is dropped (and counted) when the queue is full,
    when its batch fails (Redis down, full, or timed out: an unknown outcome counts as dropped), or
    when it cannot be encoded. While Redis is unreachable the thread keeps records queued (up to
    queue_size) and PINGs with backoff (50 ms doubling to 1 s); it resumes by itself when Redis
    answers again. The writer takes ownership of pushed records: do not mutate their arrays later.
    """

    def __init__(self, client: "redis.Redis | str | None" = None, config: BufferConfig | None = None,
                 *, start: bool = True) -> None:
        self.config = config or BufferConfig()
        self.client = _client(client)
        self._lp_dtype = np.dtype(self.config.logprob_dtype)
        self._queue: deque = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._close_deadline = float("inf")
        self._throttle = _Throttle(self.config.log_interval_s)
        self._c = dict(pushed=0, enqueued=0, written=0, dropped_queue_full=0, dropped_write_error=0,
                       dropped_encode_error=0, dropped_invalid_log_mode=0, dropped_on_close=0,
                       skipped_opt_out=0, batches=0, reconnects=0)
        self._in_flight = 0
        self._connected = False
        self._ever_connected = False
        self._next_ping = 0.0
        self._backoff_s = 0.05
        self._last_trim = time.monotonic()
        self._cpu_s = 0.0
        self._thread = threading.Thread(target=self._run, name="replay-buffer-writer", daemon=True)
        if start:
            self.start()

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()
            ref = weakref.ref(self)
            atexit.register(lambda: (w := ref()) is not None and w.close(timeout_s=2.0))

    # -- the hot path ------------------------------------------------------------------
    def push_step(self, record: StepRecord, log_mode: str | None = None) -> None:
        self._push(KIND_STEP, record, log_mode)

    def push_sequence(self, record: SequenceRecord, log_mode: str | None = None) -> None:
        """`log_mode` defaults to record.meta["log_mode"] (what the engine sets), then "full"."""
        if log_mode is None:
            meta = getattr(record, "meta", None)
            log_mode = meta.get("log_mode") if isinstance(meta, dict) else None
        self._push(KIND_SEQUENCE, record, log_mode)

    def _push(self, kind: int, record, log_mode: str | None) -> None:
        try:
            mode = log_mode if log_mode is not None else "full"
            warn = None
            with self._lock:
                c = self._c
                c["pushed"] += 1
                if self._stop.is_set():
                    c["dropped_on_close"] += 1
                elif mode not in _STRICTNESS:
                    c["dropped_invalid_log_mode"] += 1      # fail closed: unknown mode stores nothing
                    warn = ("invalid_mode", "unknown log_mode %r: record dropped", mode)
                elif mode == "none" or self.config.log_mode == "none":
                    c["skipped_opt_out"] += 1
                elif len(self._queue) >= self.config.queue_size:
                    c["dropped_queue_full"] += 1
                    warn = ("queue_full", "queue full (%d records): dropping records", self.config.queue_size)
                else:
                    if _STRICTNESS[self.config.log_mode] > _STRICTNESS[mode]:
                        mode = self.config.log_mode
                    self._queue.append((kind, record, mode))
                    c["enqueued"] += 1
                    if len(self._queue) >= self.config.batch_size:
                        self._wake.set()
            if warn is not None:
                self._throttle.warn(*warn)
        except Exception:  # noqa: BLE001 - a sink must never raise into the decode loop
            pass

    # -- control ---------------------------------------------------------------------
    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued record is written or dropped; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                done = not self._queue and self._in_flight == 0
            if done:
                return True
            if time.monotonic() > deadline or not self._thread.is_alive():
                return False
            self._wake.set()
            time.sleep(0.002)

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (for at most timeout_s), count the rest as dropped, stop the thread."""
        if self._stop.is_set():
            return
        self._close_deadline = time.monotonic() + timeout_s
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s + 1.0)
        with self._lock:
            left = len(self._queue)
            self._queue.clear()
            self._c["dropped_on_close"] += left

    def __enter__(self) -> "ReplayBufferWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def trim_now(self, *, exact: bool = False) -> int:
        """Age-trim both streams now (see `trim_by_age`); raises BufferUnavailable if Redis is down."""
        try:
            return trim_by_age(self.client, self.config, exact=exact)
        except _CONNECTION_ERRORS as exc:
            raise BufferUnavailable(f"cannot trim: {exc}") from exc

    def stats(self) -> dict:
        """Counters. dropped = queue_full + write_error + encode_error + invalid_log_mode + on_close.
        After flush(): enqueued == written + dropped_write_error + dropped_encode_error.
        decode_errors is process-wide (readers in this process); cpu_s is the writer thread's CPU."""
        with self._lock:
            out = dict(self._c)
            out["queue_depth"] = len(self._queue) + self._in_flight
        out["dropped"] = (out["dropped_queue_full"] + out["dropped_write_error"] + out["dropped_encode_error"]
                          + out["dropped_invalid_log_mode"] + out["dropped_on_close"])
        out["decode_errors"] = process_decode_errors()
        out["connected"] = self._connected
        out["cpu_s"] = self._cpu_s
        return out

    # -- the background thread ----------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._wake.wait(self.config.flush_interval_s)
            self._wake.clear()
            try:
                # ping on the backoff schedule while down, even when idle, so `connected` is current
                connected = self._ensure_connected() if (self._queue or not self._connected) else True
                while self._queue and connected:
                    self._write(self._pop_batch())
                    connected = self._connected
                if self.config.max_age_s is not None and self._connected and \
                        time.monotonic() - self._last_trim >= self.config.trim_interval_s:
                    self._last_trim = time.monotonic()
                    trim_by_age(self.client, self.config)
            except _CONNECTION_ERRORS as exc:
                self._disconnected(exc)
            except Exception as exc:  # noqa: BLE001 - keep the thread alive whatever happens
                self._throttle.warn("internal", "writer thread error: %r", exc)
            if self._stop.is_set() and (not self._queue or time.monotonic() > self._close_deadline):
                return

    def _ensure_connected(self) -> bool:
        if self._connected:
            return True
        now = time.monotonic()
        if now < self._next_ping:
            if self._stop.is_set() and now <= self._close_deadline:
                time.sleep(min(self._next_ping - now, 0.05))
            return False
        try:
            self.client.ping()
        except _CONNECTION_ERRORS as exc:
            self._disconnected(exc)
            return False
        self._connected, self._backoff_s = True, 0.05
        if self._ever_connected:
            with self._lock:
                self._c["reconnects"] += 1
            log.info("replay buffer: Redis is reachable again; writing resumes")
        self._ever_connected = True
        return True

    def _disconnected(self, exc: BaseException) -> None:
        self._connected = False
        self._next_ping = time.monotonic() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, 1.0)
        self._throttle.warn("down", "Redis unreachable (%s); records queue up to %d, then drop",
                            exc, self.config.queue_size)

    def _pop_batch(self) -> list:
        with self._lock:
            n = min(len(self._queue), self.config.batch_size)
            batch = [self._queue.popleft() for _ in range(n)]
            self._in_flight = n
        return batch

    def _write(self, batch: list) -> None:
        t0 = time.thread_time()
        cfg = self.config
        ttl_ms = max(1, int(cfg.sequence_key_ttl_s * 1000))
        pipe = self.client.pipeline(transaction=False)
        n_cmds: list[int] = []          # commands per encoded record, in pipeline order
        encode_errors = 0
        for kind, record, mode in batch:
            try:
                record = apply_log_mode(record, mode)
                if kind == KIND_STEP:
                    pipe.xadd(cfg.steps_key, {FIELD: encode_step(record, logprob_dtype=self._lp_dtype)},
                              maxlen=cfg.max_steps, approximate=True)
                    n_cmds.append(1)
                else:
                    data = encode_sequence(record)
                    pipe.xadd(cfg.seqs_key, {FIELD: data}, maxlen=cfg.max_sequences, approximate=True)
                    pipe.set(cfg.seq_key(record.request_id), data, px=ttl_ms)
                    n_cmds.append(2)
            except (EncodeError, ValueError, TypeError, AttributeError) as exc:
                encode_errors += 1
                self._throttle.warn("encode", "cannot encode a record, dropped: %s", exc)
        written = failed = 0
        first_error = None
        try:
            if n_cmds:
                results = pipe.execute(raise_on_error=False)
                i = 0
                for n in n_cmds:
                    errs = [r for r in results[i: i + n] if isinstance(r, Exception)]
                    i += n
                    if errs:
                        failed += 1
                        first_error = first_error or errs[0]
                    else:
                        written += 1
        except _CONNECTION_ERRORS as exc:
            failed, written = len(n_cmds), 0     # outcome unknown: some may have landed; counted dropped
            self._disconnected(exc)
        except redis.RedisError as exc:
            failed, written, first_error = len(n_cmds), 0, exc
        finally:
            with self._lock:
                c = self._c
                c["written"] += written
                c["dropped_write_error"] += failed
                c["dropped_encode_error"] += encode_errors
                c["batches"] += 1
                self._in_flight = 0
            self._cpu_s += time.thread_time() - t0
        if first_error is not None:
            self._throttle.warn("write", "%d of %d records not written: %s", failed, len(n_cmds), first_error)


# ----------------------------------------------------------------------------- reader
@dataclass(frozen=True)
class BufferEntry:
    stream_id: str                               # Redis stream entry id, "<ms>-<seq>"
    record: StepRecord | SequenceRecord


class ReplayBufferReader:
    """Consumer-group reader for a trainer, plus read-only windows and sequence look-ups.

    stream: "steps" or "sequences". group: consumer group (created at the stream's start, id
    `start_id`, on first read). consumer: this reader's name; give a long-lived trainer a stable
    one (a fresh name per process otherwise). min_idle_ms: how long an entry must sit unacked in
    another (presumably dead) consumer before this reader claims it - longer than a training step.
    dedup_window: how many acked ids to remember for dedup. target: the fingerprint of the target whose
    opinions the reader wants (buffer/fingerprint.py `target_fingerprint`; None: any): a SequenceRecord that
    names another target is left out wherever sequences are read (`get_sequences`, `sequences_after`, the
    windows), so its steps, which need it, are too; its request id is kept in `other_target` (the newest
    dedup_window of them) for a consumer that must ack such steps rather than wait for their sequence, and
    counted. Sequences of unknown target (layout 1, or a writer that knew none) are kept.
    """

    def __init__(self, client: "redis.Redis | str | None" = None, config: BufferConfig | None = None, *,
                 group: str = "trainer", consumer: str | None = None, stream: str = "steps",
                 min_idle_ms: int = 60_000, start_id: str = "0", dedup_window: int = 100_000,
                 target: str | None = None) -> None:
        if stream not in ("steps", "sequences"):
            raise ValueError(f"stream must be 'steps' or 'sequences', got {stream!r}")
        if not isinstance(min_idle_ms, int) or min_idle_ms < 0:
            raise ValueError(f"min_idle_ms must be an integer >= 0, got {min_idle_ms!r}")
        self.config = config or BufferConfig()
        # blocking reads need a socket timeout longer than the block
        self.client = _client(client, socket_timeout=30.0)
        self.stream = stream
        self.key = self.config.steps_key if stream == "steps" else self.config.seqs_key
        self.group = group
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.min_idle_ms = min_idle_ms
        self.start_id = start_id
        self.dedup_window = dedup_window
        self._group_ready = False
        self._cursor = "0-0"
        self._in_flight: dict[str, None] = {}
        self._acked: OrderedDict[str, None] = OrderedDict()
        self._c = dict(delivered=0, reclaimed=0, acked=0, duplicates_skipped=0, decode_errors=0, trimmed=0,
                       other_target=0)
        self._throttle = _Throttle(self.config.log_interval_s)
        if target is not None and not (isinstance(target, str) and target):
            raise ValueError(f"target must be a non-empty fingerprint string or None, got {target!r}")
        self.target = target
        self.other_target: OrderedDict[str, None] = OrderedDict()

    def _mine(self, seq: SequenceRecord) -> bool:
        """Whether `seq` holds this reader's target's opinions (any, without a target; unknown ones too);
        another target's request is remembered and counted once."""
        if self.target is None or not seq.target or seq.target == self.target:
            return True
        if seq.request_id not in self.other_target:
            self._c["other_target"] += 1
            self._throttle.warn("target", "leaving out requests scored by another target (%s, this reader's is "
                                "%s): the buffer outlived a change of target or is shared", seq.target[:12],
                                self.target[:12])
            self.other_target[seq.request_id] = None
            while len(self.other_target) > self.dedup_window:
                self.other_target.popitem(last=False)
        return False

    def _decode(self, kind: str, blob) -> StepRecord | SequenceRecord:
        if blob is None:
            raise DecodeError(f"entry has no {FIELD.decode()!r} field")
        return decode_step(blob) if kind == "steps" else decode_sequence(blob)

    def _decode_error(self, where: str, exc: Exception) -> None:
        self._c["decode_errors"] += 1
        _count_decode_error()
        self._throttle.warn("decode", "skipping an undecodable record (%s): %s", where, exc)

    # -- consuming -------------------------------------------------------------------------
    def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            self.client.xgroup_create(self.key, self.group, id=self.start_id, mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    def read(self, count: int = 256, block_ms: int = 1000) -> list[BufferEntry]:
        """Up to `count` entries: first ones re-claimed from idle consumers, then new ones (waiting
        up to block_ms for any; 0 = do not wait). Ack them with `ack` once used. Entries that fail
        to decode are counted, acked and skipped."""
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be an integer >= 1, got {count!r}")
        timeout = self.client.connection_pool.connection_kwargs.get("socket_timeout")
        if not isinstance(block_ms, int) or block_ms < 0 or (timeout and block_ms >= timeout * 1000):
            raise ValueError(f"block_ms must be an integer in [0, {int((timeout or 0) * 1000)}) "
                             f"(below the client's socket_timeout), got {block_ms!r}")
        for attempt in (0, 1):
            try:
                self._ensure_group()
                return self._read(count, block_ms)
            except redis.ResponseError as exc:
                if "NOGROUP" in str(exc) and attempt == 0:   # stream or group deleted under us
                    self._group_ready = False
                    continue
                raise BufferUnavailable(f"read failed: {exc}") from exc
            except _CONNECTION_ERRORS as exc:
                raise BufferUnavailable(f"Redis unreachable: {exc}") from exc
        raise AssertionError("unreachable")

    def _read(self, count: int, block_ms: int) -> list[BufferEntry]:
        out: list[BufferEntry] = []
        to_ack: list[str] = []
        claim = self.client.xautoclaim(self.key, self.group, self.consumer, self.min_idle_ms,
                                       start_id=self._cursor, count=count)
        self._cursor = _s(claim[0])
        if len(claim) > 2 and claim[2]:                     # Redis 7: pending ids whose data was trimmed
            self._c["trimmed"] += len(claim[2])
        claimed = self._accept(claim[1], to_ack)
        self._c["reclaimed"] += len(claimed)
        out += claimed
        if len(out) < count:
            resp = self.client.xreadgroup(self.group, self.consumer, {self.key: ">"}, count=count - len(out),
                                          block=block_ms if (block_ms > 0 and not out) else None)
            for _key, entries in resp or []:                # RESP2: [[key, [(id, fields), ...]]]
                out += self._accept(entries, to_ack)
        if to_ack:
            self.client.xack(self.key, self.group, *to_ack)
        self._c["delivered"] += len(out)
        return out

    def _accept(self, entries, to_ack: list[str]) -> list[BufferEntry]:
        good = []
        for sid, fields in entries or []:
            if sid is None:
                continue
            sid = _s(sid)
            if not fields:                                  # entry trimmed while pending (Redis 6.2)
                self._c["trimmed"] += 1
                to_ack.append(sid)
                continue
            if sid in self._acked:                          # acked before; the ack was lost
                self._c["duplicates_skipped"] += 1
                to_ack.append(sid)
                continue
            if sid in self._in_flight:                      # already handed out by this reader
                self._c["duplicates_skipped"] += 1
                continue
            try:
                record = self._decode(self.stream, fields.get(FIELD))
            except DecodeError as exc:
                self._decode_error(f"{self.key} {sid}", exc)
                to_ack.append(sid)
                continue
            self._in_flight[sid] = None
            good.append(BufferEntry(sid, record))
        return good

    def ack(self, ids: Iterable[str]) -> int:
        """Acknowledge entries once their data was used; returns how many Redis acknowledged."""
        ids = [_s(i) for i in ids]
        if not ids:
            return 0
        try:
            n = int(self.client.xack(self.key, self.group, *ids))
        except _CONNECTION_ERRORS as exc:
            raise BufferUnavailable(f"ack failed, entries stay pending: {exc}") from exc
        for sid in ids:
            self._in_flight.pop(sid, None)
            self._acked[sid] = None
        while len(self._acked) > self.dedup_window:
            self._acked.popitem(last=False)
        self._c["acked"] += n
        return n

    def release(self, ids: Iterable[str]) -> None:
        """Give entries back without acking: another read may re-claim them after min_idle_ms."""
        for sid in ids:
            self._in_flight.pop(_s(sid), None)

    def pending(self) -> int:
        """Entries delivered to any consumer of the group and not acked yet."""
        try:
            self._ensure_group()
            return int(self.client.xpending(self.key, self.group)["pending"])
        except _CONNECTION_ERRORS as exc:
            raise BufferUnavailable(f"Redis unreachable: {exc}") from exc

    def stats(self) -> dict:
        return {**self._c, "in_flight": len(self._in_flight)}

    # -- windows without consuming ------------------------------------------------------------
    def newest(self, n: int, *, stream: str | None = None, draft_version: str | None = None,
               source: str | None = None, max_scan: int | None = None, before_id: str | None = None,
               where: Callable[[StepRecord | SequenceRecord], bool] | None = None) -> list[BufferEntry]:
        """The newest `n` entries (newest first) matching the filters, via XREVRANGE; nothing is
        consumed or acked. `before_id`: only entries strictly older than that stream id. `where`: a
        predicate on the record. `source` filters steps through their request's SequenceRecord, so steps
        of requests still in flight (no sequence yet) or whose sequence expired are left out.
        Scans at most max_scan entries (default max(10 * n, 10_000))."""
        return self._newest(n, stream=stream, draft_version=draft_version, source=source, max_scan=max_scan,
                            before_id=before_id, where=where)[0]

    def newest_steps(self, n: int, *, where: Callable[[StepRecord], bool] | None = None,
                     before_id: str | None = None, after_id: str | None = None, source: str | None = None,
                     max_scan: int = 100_000) -> tuple[list[BufferEntry], dict[str, SequenceRecord]]:
        """The newest `n` step entries (newest first) matching `where` / `before_id` / `source` whose request
        has a stored SequenceRecord, with those records by request id (what a trainer needs to rebuild each
        step's context); `after_id`: the scan stops at that stream id (exclusive). Read-only, as `newest`;
        steps without a stored sequence are left out."""
        return self._newest(n, stream="steps", source=source, max_scan=max_scan, before_id=before_id,
                            after_id=after_id, where=where, need_sequence=True)

    def sequence_cursor(self) -> str:
        """The id of the newest entry of the sequences stream ("0-0" while it has none). A reader that looks
        SequenceRecords up after taking it (`newest_steps` rebuilds only requests whose sequence is stored)
        cannot have seen a request whose sequence is written later: that request's entry comes after the
        cursor (`sequences_after`), since the writer adds it to the stream before it sets the request's key.
        A heads job keeps it as its window's `sequence_cut`; the gate's fresh evidence is what comes after."""
        try:
            page = self.client.xrevrange(self.config.seqs_key, count=1)
        except _CONNECTION_ERRORS as exc:
            raise BufferUnavailable(f"Redis unreachable: {exc}") from exc
        return _s(page[0][0]) if page else "0-0"

    def sequences_after(self, cursor: str, n: int = 10_000) -> list[SequenceRecord]:
        """The SequenceRecords written after `cursor` (a `sequence_cursor`), oldest first, at most `n`;
        undecodable ones are counted and left out. Read-only."""
        stream_id_key(cursor)
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        try:
            page = self.client.xrange(self.config.seqs_key, min="(" + cursor, max="+", count=n)
        except _CONNECTION_ERRORS as exc:
            raise BufferUnavailable(f"Redis unreachable: {exc}") from exc
        out = []
        for sid, fields in page:
            try:
                out.append(self._decode("sequences", (fields or {}).get(FIELD)))
            except DecodeError as exc:
                self._decode_error(f"{self.config.seqs_key} {_s(sid)}", exc)
        return [r for r in out if self._mine(r)]

    def _newest(self, n: int, *, stream: str | None, draft_version: str | None = None, source: str | None = None,
                max_scan: int | None = None, before_id: str | None = None, after_id: str | None = None,
                where=None, need_sequence: bool = False) -> tuple[list[BufferEntry], dict[str, SequenceRecord]]:
        stream = stream or self.stream
        if stream not in ("steps", "sequences"):
            raise ValueError(f"stream must be 'steps' or 'sequences', got {stream!r}")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        for sid in (before_id, after_id):
            if sid is not None:
                stream_id_key(sid)
        key = self.config.steps_key if stream == "steps" else self.config.seqs_key
        max_scan = max_scan or max(10 * n, 10_000)
        by_seq = stream == "steps" and (need_sequence or source is not None)
        out: list[BufferEntry] = []
        sequences: dict[str, SequenceRecord | None] = {}       # request id -> its record (None: not stored)
        hi, scanned = ("(" + before_id) if before_id else "+", 0
        try:
            while len(out) < n and scanned < max_scan:
                page = self.client.xrevrange(key, max=hi, min=("(" + after_id) if after_id else "-",
                                             count=min(max(2 * n, 64), 1000, max_scan - scanned))
                if not page:
                    break
                scanned += len(page)
                hi = "(" + _s(page[-1][0])
                batch = []
                for sid, fields in page:
                    try:
                        batch.append(BufferEntry(_s(sid), self._decode(stream, (fields or {}).get(FIELD))))
                    except DecodeError as exc:
                        self._decode_error(f"{key} {_s(sid)}", exc)
                if stream == "sequences":
                    batch = [e for e in batch if self._mine(e.record)]
                if draft_version is not None:
                    batch = [e for e in batch if e.record.draft_version == draft_version]
                if where is not None:
                    batch = [e for e in batch if where(e.record)]
                if by_seq:
                    missing = {e.record.request_id for e in batch} - sequences.keys()
                    found = self.get_sequences(missing)
                    sequences.update({rid: found.get(rid) for rid in missing})
                    batch = [e for e in batch if sequences[e.record.request_id] is not None
                             and (source is None or sequences[e.record.request_id].source == source)]
                elif source is not None:
                    batch = [e for e in batch if e.record.source == source]
                out += batch[: n - len(out)]
        except _CONNECTION_ERRORS as exc:
            raise BufferUnavailable(f"Redis unreachable: {exc}") from exc
        used = {e.record.request_id for e in out} if by_seq else set()
        return out, {r: s for r, s in sequences.items() if r in used and s is not None}

    def get_sequence(self, request_id: str) -> SequenceRecord | None:
        """The SequenceRecord of a request (None if never written, expired or undecodable)."""
        return self.get_sequences([request_id]).get(request_id)

    def get_sequences(self, request_ids: Iterable[str]) -> dict[str, SequenceRecord]:
        """SequenceRecords by request id (one MGET); missing/undecodable ones, and those of another target
        (`target`), are left out."""
        ids = list(request_ids)
        if not ids:
            return {}
        try:
            blobs = self.client.mget([self.config.seq_key(r) for r in ids])
        except _CONNECTION_ERRORS as exc:
            raise BufferUnavailable(f"Redis unreachable: {exc}") from exc
        out = {}
        for rid, blob in zip(ids, blobs):
            if blob is None:
                continue
            try:
                seq = decode_sequence(blob)
            except DecodeError as exc:
                self._decode_error(self.config.seq_key(rid), exc)
                continue
            if self._mine(seq):
                out[rid] = seq
        return out


# Counts XRANGE pages inside Redis, so no entry is transferred: returns {entries in the page, last id}.
_COUNT_SCRIPT = """
local r = redis.call('XRANGE', KEYS[1], ARGV[1], '+', 'COUNT', ARGV[2])
if #r == 0 then return {0, ''} end
return {#r, r[#r][1]}
"""


def count_after(client: "redis.Redis | str | None", key: str, since_id: str | None = None, *,
                page: int = 10_000) -> int:
    """Number of entries of stream `key` with an id after `since_id` (all of them when None), counted inside
    Redis (a Lua script over XRANGE pages of `page` ids). BufferUnavailable when Redis cannot be reached."""
    if since_id is not None:
        stream_id_key(since_id)
    if not isinstance(page, int) or page < 1:
        raise ValueError(f"page must be an integer >= 1, got {page!r}")
    own = not isinstance(client, redis.Redis)
    conn = _client(client)
    try:
        if since_id is None:
            return int(conn.xlen(key))
        script = conn.register_script(_COUNT_SCRIPT)
        total, start = 0, f"({since_id}"
        while True:
            n, last = script(keys=[key], args=[start, page])
            total += int(n)
            if int(n) < page:
                return total
            start = "(" + _s(last)
    except _CONNECTION_ERRORS as exc:
        raise BufferUnavailable(f"Redis unreachable: {exc}") from exc
    finally:
        if own:
            conn.close()


def ack_entries(client: "redis.Redis | str | None", key: str, group: str, ids: Iterable[str], *,
                batch: int = 1000) -> int:
    """XACK `ids` in `group` of stream `key`, whoever they were delivered to (the scheduler acks a job's
    records once its candidate is registered, after the job's reader is gone). Returns how many Redis
    acknowledged (ids already acked or trimmed count 0). BufferUnavailable when Redis cannot be reached:
    the entries then stay pending and a later job re-claims them."""
    ids = [_s(i) for i in ids]
    own = not isinstance(client, redis.Redis)
    conn = _client(client)
    try:
        n = 0
        for i in range(0, len(ids), batch):
            n += int(conn.xack(key, group, *ids[i:i + batch]))
        return n
    except _CONNECTION_ERRORS as exc:
        raise BufferUnavailable(f"ack failed, entries stay pending: {exc}") from exc
    finally:
        if own:
            conn.close()


def _s(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
