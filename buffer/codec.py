"""Fixed, versioned binary layout for replay-buffer records (no pickle), and the log-mode filter.

Every record is one self-contained byte string. All integers and floats are little-endian.

    offset  size  field
    0       4     magic  b"DSRB"
    4       1     layout version (VERSION, currently 2; version 1 records are still read)
    5       1     kind: 1 = StepRecord, 2 = SequenceRecord
    6       ...   kind-specific header, strings and arrays (below)
    -4      4     CRC-32 (zlib.crc32) of every byte before it

StepRecord (kind 1), after the 6-byte prefix:

    header  struct "<IHHHBdiddi" (43 bytes): position u32, gamma u16, num_accepted u16, k u16,
            log-prob dtype u8 (1 = float16, 2 = float32), temperature f64, top_k i32, top_p f64,
            timestamp f64, next_token i32
    strings request_id, algorithm, draft_version: each u16 byte length + UTF-8 bytes
    arrays  draft_tokens   int32   [gamma]
            target_topk_ids int32  [gamma + 1, k]   (row-major)
            target_topk_logprobs   [gamma + 1, k]   float16 (default) or float32

    Size at k = 20, gamma = 4 with a 32-character request id: 6 + 43 + (2+32) + (2+4) + (2+~4)
    + 16 + 400 + 200 + 4 ~= 715 bytes (float16 log-probs).

SequenceRecord (kind 2), after the prefix:

    header  struct "<IId" (16 bytes): prompt_len u32, n u32, timestamp f64
    strings request_id, draft_version, source: u16 length + UTF-8; meta: u32 length + UTF-8 JSON;
            target (layout 2 only; a version 1 record reads as target ""): u16 length + UTF-8
    arrays  token_ids int32 [n]

Layout 2 differs from 1 only by the sequence's `target` (the fingerprint of the target that scored its
steps); a step record reads the same in both.

Decoding checks the magic, version, kind, the CRC, every length against the buffer, UTF-8, the
JSON and the record's own invariants; any failure raises `DecodeError` (a `ValueError`), so a
reader can count the entry and skip it. float16 log-probs keep 11 significant bits: spacing
2**-10 ~= 0.001 for |logprob| in [1, 2), 2**-7 ~= 0.008 in [8, 16); values below -65504 become -inf.

Log modes (per request; `apply_log_mode`):
    "full"      store everything.
    "ids_only"  store token ids, top-k ids/log-probs and the numeric/identifier fields (request id,
                algorithm, draft version, source label, target fingerprint) but drop the free-text `meta` dict of the
                SequenceRecord (it is replaced by {"log_mode": "ids_only"}). This is not
                anonymisation: token ids decode back to the text with the tokenizer.
    "none"      store nothing for that request.
"""
from __future__ import annotations

import json
import math
import struct
import zlib

import numpy as np

from buffer.records import SequenceRecord, StepRecord

MAGIC = b"DSRB"
VERSION = 2
READABLE_VERSIONS = (1, 2)
KIND_STEP = 1
KIND_SEQUENCE = 2

LOG_MODES = ("full", "ids_only", "none")

_PREFIX = struct.Struct("<4sBB")               # magic, version, kind
_STEP_HEADER = struct.Struct("<IHHHBdiddi")    # see module docstring
_SEQ_HEADER = struct.Struct("<IId")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_CRC = struct.Struct("<I")

_DTYPE_CODES = {np.dtype(np.float16): 1, np.dtype(np.float32): 2}
_CODE_DTYPES = {1: np.dtype("<f2"), 2: np.dtype("<f4")}
_I32 = np.dtype("<i4")


class DecodeError(ValueError):
    """The bytes are not a valid record of this layout (truncated, garbled, wrong kind/version)."""


class EncodeError(ValueError):
    """The record cannot be written in this layout (a field out of range, meta not JSON)."""


# ----------------------------------------------------------------------------- helpers
def _str_field(value, name: str, width: struct.Struct) -> bytes:
    if not isinstance(value, str):
        raise EncodeError(f"{name} must be a str, got {type(value).__name__}")
    raw = _utf8(value, name)
    limit = 0xFFFF if width is _U16 else 0xFFFFFFFF
    if len(raw) > limit:
        raise EncodeError(f"{name} is {len(raw)} bytes of UTF-8; the layout allows at most {limit}")
    return width.pack(len(raw)) + raw


def _utf8(value: str, name: str) -> bytes:
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as exc:  # lone surrogates
        raise EncodeError(f"{name} is not encodable as UTF-8: {exc}") from None


def _int_in(value, lo: int, hi: int, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise EncodeError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if not lo <= value <= hi:
        raise EncodeError(f"{name} = {value} outside [{lo}, {hi}]")
    return value


def _float(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise EncodeError(f"{name} must be a number, got {value!r}")
    return float(value)


class _Cursor:
    """Reads fields off a bytes buffer, raising DecodeError on any overrun."""

    def __init__(self, data: memoryview, start: int, end: int) -> None:
        self.data, self.pos, self.end = data, start, end

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > self.end:
            raise DecodeError(f"truncated record: {what} needs {n} bytes at offset {self.pos}, "
                              f"{self.end - self.pos} left")
        out = self.data[self.pos: self.pos + n]
        self.pos += n
        return out

    def unpack(self, st: struct.Struct, what: str) -> tuple:
        return st.unpack(self.take(st.size, what))

    def string(self, width: struct.Struct, what: str) -> str:
        (n,) = self.unpack(width, f"{what} length")
        try:
            return str(self.take(n, what), "utf-8")
        except UnicodeDecodeError as exc:
            raise DecodeError(f"{what} is not valid UTF-8: {exc}") from None

    def array(self, dtype: np.dtype, shape: tuple[int, ...], what: str) -> np.ndarray:
        count = math.prod(shape)
        raw = self.take(count * dtype.itemsize, what)
        return np.frombuffer(raw, dtype=dtype, count=count).reshape(shape).astype(dtype.newbyteorder("="))


def _frame(kind: int, body: list[bytes]) -> bytes:
    out = b"".join([_PREFIX.pack(MAGIC, VERSION, kind), *body])
    return out + _CRC.pack(zlib.crc32(out))


def _open(data, expect_kind: int | None) -> tuple[int, int, _Cursor]:
    """Check magic, version, CRC; return (kind, layout version, cursor positioned after the prefix)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DecodeError(f"expected bytes, got {type(data).__name__}")
    view = memoryview(data).cast("B")
    if len(view) < _PREFIX.size + _CRC.size:
        raise DecodeError(f"truncated record: {len(view)} bytes is shorter than the "
                          f"{_PREFIX.size + _CRC.size}-byte frame")
    magic, version, kind = _PREFIX.unpack(view[: _PREFIX.size])
    if magic != MAGIC:
        raise DecodeError(f"bad magic {bytes(magic)!r}: not a Draftsmith buffer record")
    if version not in READABLE_VERSIONS:
        raise DecodeError(f"unsupported layout version {version} (this reader knows "
                          f"{', '.join(map(str, READABLE_VERSIONS))})")
    (crc,) = _CRC.unpack(view[-_CRC.size:])
    if zlib.crc32(view[: -_CRC.size]) != crc:
        raise DecodeError("checksum mismatch: the record is truncated or garbled")
    if kind not in (KIND_STEP, KIND_SEQUENCE):
        raise DecodeError(f"unknown record kind {kind}")
    if expect_kind is not None and kind != expect_kind:
        names = {KIND_STEP: "StepRecord", KIND_SEQUENCE: "SequenceRecord"}
        raise DecodeError(f"expected a {names[expect_kind]}, found a {names[kind]}")
    return kind, version, _Cursor(view, _PREFIX.size, len(view) - _CRC.size)


def _finish(cur: _Cursor) -> None:
    if cur.pos != cur.end:
        raise DecodeError(f"{cur.end - cur.pos} unexpected trailing bytes before the checksum")


# ----------------------------------------------------------------------------- steps
def encode_step(record: StepRecord, *, logprob_dtype=np.float16) -> bytes:
    """StepRecord -> bytes (layout in the module docstring). Log-probs are cast to `logprob_dtype`
    (float16 by default, float32 allowed)."""
    if not isinstance(record, StepRecord):
        raise EncodeError(f"expected a StepRecord, got {type(record).__name__}")
    lp_dtype = np.dtype(logprob_dtype)
    if lp_dtype not in _DTYPE_CODES:
        raise EncodeError(f"logprob_dtype must be float16 or float32, got {lp_dtype}")
    draft = np.asarray(record.draft_tokens)
    ids = np.asarray(record.target_topk_ids)
    lps = np.asarray(record.target_topk_logprobs)
    gamma = draft.shape[0] if draft.ndim == 1 else -1
    if gamma < 0 or ids.ndim != 2 or ids.shape != lps.shape or ids.shape[0] != gamma + 1:
        raise EncodeError(f"inconsistent shapes: draft_tokens {draft.shape}, target_topk_ids {ids.shape}, "
                          f"target_topk_logprobs {lps.shape} (want [gamma], [gamma + 1, k], [gamma + 1, k])")
    k = ids.shape[1]
    header = _STEP_HEADER.pack(
        _int_in(record.position, 0, 0xFFFFFFFF, "position"),
        _int_in(gamma, 0, 0xFFFF, "gamma"),
        _int_in(record.num_accepted, 0, gamma, "num_accepted"),
        _int_in(k, 0, 0xFFFF, "k"),
        _DTYPE_CODES[lp_dtype],
        _float(record.temperature, "temperature"),
        _int_in(record.top_k, -(2**31), 2**31 - 1, "top_k"),
        _float(record.top_p, "top_p"),
        _float(record.timestamp, "timestamp"),
        _int_in(record.next_token, -(2**31), 2**31 - 1, "next_token"),
    )
    with np.errstate(over="ignore"):             # below -65504 is -inf in float16 (documented)
        lp_bytes = np.ascontiguousarray(lps, dtype=lp_dtype.newbyteorder("<")).tobytes()
    return _frame(KIND_STEP, [
        header,
        _str_field(record.request_id, "request_id", _U16),
        _str_field(record.algorithm, "algorithm", _U16),
        _str_field(record.draft_version, "draft_version", _U16),
        _as_le(draft, _I32, "draft_tokens"),
        _as_le(ids, _I32, "target_topk_ids"),
        lp_bytes,
    ])


def _as_le(arr: np.ndarray, dtype: np.dtype, name: str) -> bytes:
    if arr.dtype == dtype:                       # the common case: already little-endian int32
        return arr.tobytes()
    if arr.dtype.kind not in "iu":
        raise EncodeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < -(2**31) or arr.max() > 2**31 - 1):
        raise EncodeError(f"{name} has values outside int32")
    return np.ascontiguousarray(arr, dtype=dtype).tobytes()


def decode_step(data: bytes) -> StepRecord:
    """bytes -> StepRecord; raises DecodeError on anything but a valid kind-1 record."""
    _, _, cur = _open(data, KIND_STEP)
    return _decode_step_body(cur)


def _decode_step_body(cur: _Cursor) -> StepRecord:
    (position, gamma, num_accepted, k, code, temperature, top_k, top_p, timestamp,
     next_token) = cur.unpack(_STEP_HEADER, "step header")
    if code not in _CODE_DTYPES:
        raise DecodeError(f"unknown log-prob dtype code {code}")
    request_id = cur.string(_U16, "request_id")
    algorithm = cur.string(_U16, "algorithm")
    draft_version = cur.string(_U16, "draft_version")
    draft = cur.array(_I32, (gamma,), "draft_tokens")
    ids = cur.array(_I32, (gamma + 1, k), "target_topk_ids")
    lps = cur.array(_CODE_DTYPES[code], (gamma + 1, k), "target_topk_logprobs")
    _finish(cur)
    try:
        return StepRecord(
            request_id=request_id, position=position, draft_tokens=draft, num_accepted=num_accepted,
            target_topk_ids=ids, target_topk_logprobs=lps, algorithm=algorithm,
            draft_version=draft_version, temperature=temperature, top_k=top_k, top_p=top_p,
            timestamp=timestamp, next_token=next_token)
    except ValueError as exc:
        raise DecodeError(f"decoded step violates the schema: {exc}") from None


# ----------------------------------------------------------------------------- sequences
def encode_sequence(record: SequenceRecord) -> bytes:
    """SequenceRecord -> bytes. `meta` must be JSON-compatible (str keys; tuples come back as lists)."""
    if not isinstance(record, SequenceRecord):
        raise EncodeError(f"expected a SequenceRecord, got {type(record).__name__}")
    tokens = np.asarray(record.token_ids)
    if tokens.ndim != 1:
        raise EncodeError(f"token_ids must be 1-D, got shape {tokens.shape}")
    n = _int_in(tokens.shape[0], 0, 0xFFFFFFFF, "len(token_ids)")
    if not isinstance(record.meta, dict):
        raise EncodeError(f"meta must be a dict, got {type(record.meta).__name__}")
    try:
        meta = json.dumps(record.meta, separators=(",", ":"), sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise EncodeError(f"meta is not JSON-serialisable: {exc}") from None
    header = _SEQ_HEADER.pack(_int_in(record.prompt_len, 0, n, "prompt_len"), n,
                              _float(record.timestamp, "timestamp"))
    return _frame(KIND_SEQUENCE, [
        header,
        _str_field(record.request_id, "request_id", _U16),
        _str_field(record.draft_version, "draft_version", _U16),
        _str_field(record.source, "source", _U16),
        _str_field(meta, "meta", _U32),
        _str_field(record.target, "target", _U16),
        _as_le(tokens, _I32, "token_ids"),
    ])


def decode_sequence(data: bytes) -> SequenceRecord:
    """bytes -> SequenceRecord; raises DecodeError on anything but a valid kind-2 record."""
    _, version, cur = _open(data, KIND_SEQUENCE)
    return _decode_sequence_body(cur, version)


def _decode_sequence_body(cur: _Cursor, version: int) -> SequenceRecord:
    prompt_len, n, timestamp = cur.unpack(_SEQ_HEADER, "sequence header")
    request_id = cur.string(_U16, "request_id")
    draft_version = cur.string(_U16, "draft_version")
    source = cur.string(_U16, "source")
    meta_text = cur.string(_U32, "meta")
    target = cur.string(_U16, "target") if version >= 2 else ""
    tokens = cur.array(_I32, (n,), "token_ids")
    _finish(cur)
    try:
        meta = json.loads(meta_text)
    except ValueError as exc:
        raise DecodeError(f"meta is not valid JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise DecodeError(f"meta must decode to a JSON object, got {type(meta).__name__}")
    try:
        return SequenceRecord(request_id=request_id, token_ids=tokens, prompt_len=prompt_len,
                              draft_version=draft_version, timestamp=timestamp, source=source, meta=meta,
                              target=target)
    except ValueError as exc:
        raise DecodeError(f"decoded sequence violates the schema: {exc}") from None


def decode_record(data: bytes) -> StepRecord | SequenceRecord:
    """Decode either kind, dispatching on the kind byte."""
    kind, version, cur = _open(data, None)
    return _decode_step_body(cur) if kind == KIND_STEP else _decode_sequence_body(cur, version)


# ----------------------------------------------------------------------------- privacy
def check_log_mode(mode: str) -> str:
    """Return `mode` if it is one of LOG_MODES, else raise ValueError naming the choices."""
    if mode not in LOG_MODES:
        raise ValueError(f"unknown log_mode {mode!r}; choose one of {', '.join(LOG_MODES)}")
    return mode


def apply_log_mode(record: StepRecord | SequenceRecord, mode: str) -> StepRecord | SequenceRecord | None:
    """What may be stored of `record` under `mode` (see the module docstring); None = store nothing.

    Steps carry no free text, so "ids_only" keeps them whole; a sequence keeps its token ids,
    lengths, draft version, source label and target fingerprint, and its `meta` becomes {"log_mode": "ids_only"}.
    The input record is not modified.
    """
    check_log_mode(mode)
    if mode == "none":
        return None
    if mode == "ids_only" and isinstance(record, SequenceRecord):
        return SequenceRecord(request_id=record.request_id, token_ids=record.token_ids,
                              prompt_len=record.prompt_len, draft_version=record.draft_version,
                              timestamp=record.timestamp, source=record.source,
                              meta={"log_mode": "ids_only"}, target=record.target)
    return record
