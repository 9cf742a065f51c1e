"""The replay-buffer byte codec (buffer/codec.py) and the log-mode filter: pure, no Redis.

The layout tests rebuild the bytes field by field from the layout documented in the codec's
docstring, so a change of layout without a version bump fails here.
"""
from __future__ import annotations

import json
import struct
import uuid
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from buffer.codec import (MAGIC, VERSION, DecodeError, EncodeError, apply_log_mode, check_log_mode,
                          decode_record, decode_sequence, decode_step, encode_sequence, encode_step)
from buffer.records import SequenceRecord, StepRecord

I32 = st.integers(-(2**31), 2**31 - 1)
TEXT = st.text(max_size=40)
FLOAT = st.floats(allow_nan=False, width=64)


@st.composite
def step_records(draw):
    gamma = draw(st.integers(0, 8))
    k = draw(st.integers(1, 24))
    in_dtype = draw(st.sampled_from([np.float16, np.float32]))
    lps = draw(hnp.arrays(in_dtype, (gamma + 1, k), elements=st.floats(-6e4, 0, width=16 if in_dtype is np.float16 else 32)
                          | st.sampled_from([-np.inf, np.nan])))
    return StepRecord(
        request_id=draw(TEXT), position=draw(st.integers(0, 2**32 - 1)),
        draft_tokens=draw(hnp.arrays(np.int32, (gamma,), elements=I32)),
        num_accepted=draw(st.integers(0, gamma)),
        target_topk_ids=draw(hnp.arrays(np.int32, (gamma + 1, k), elements=I32)),
        target_topk_logprobs=lps, algorithm=draw(TEXT), draft_version=draw(TEXT),
        temperature=draw(FLOAT), top_k=draw(I32), top_p=draw(FLOAT), timestamp=draw(FLOAT),
        next_token=draw(I32))


JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**60), 2**60) | st.floats(allow_nan=False, allow_infinity=False) | TEXT,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
                    max_leaves=12)


@st.composite
def sequence_records(draw):
    tokens = draw(hnp.arrays(np.int32, st.integers(0, 300), elements=I32))
    return SequenceRecord(request_id=draw(TEXT), token_ids=tokens, prompt_len=draw(st.integers(0, len(tokens))),
                          draft_version=draw(TEXT), timestamp=draw(FLOAT), source=draw(TEXT),
                          meta=draw(st.dictionaries(TEXT, JSON, max_size=5)), target=draw(TEXT))


def assert_steps_equal(got: StepRecord, want: StepRecord, lp_dtype) -> None:
    for name in ("request_id", "position", "num_accepted", "algorithm", "draft_version", "temperature",
                 "top_k", "top_p", "timestamp", "next_token"):
        assert getattr(got, name) == getattr(want, name), name
    np.testing.assert_array_equal(got.draft_tokens, want.draft_tokens)
    np.testing.assert_array_equal(got.target_topk_ids, want.target_topk_ids)
    assert got.target_topk_logprobs.dtype == np.dtype(lp_dtype)
    np.testing.assert_array_equal(got.target_topk_logprobs, want.target_topk_logprobs.astype(lp_dtype))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(record=step_records(), lp_dtype=st.sampled_from([np.float16, np.float32]))
def test_step_round_trip(record, lp_dtype):
    data = encode_step(record, logprob_dtype=lp_dtype)
    assert_steps_equal(decode_step(data), record, lp_dtype)
    assert_steps_equal(decode_record(data), record, lp_dtype)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(record=sequence_records())
def test_sequence_round_trip(record):
    got = decode_sequence(encode_sequence(record))
    assert (got.request_id, got.prompt_len, got.draft_version, got.timestamp, got.source, got.target) == \
        (record.request_id, record.prompt_len, record.draft_version, record.timestamp, record.source, record.target)
    np.testing.assert_array_equal(got.token_ids, record.token_ids)
    assert got.token_ids.dtype == np.int32 and got.token_ids.flags.writeable
    # JSON turns tuples into lists only; the strategy makes none, so meta comes back equal
    assert got.meta == json.loads(json.dumps(record.meta))


@settings(max_examples=100, deadline=None)
@given(record=st.one_of(step_records(), sequence_records()), data=st.data())
def test_truncated_or_garbled_bytes_raise_decode_error(record, data):
    blob = encode_step(record) if isinstance(record, StepRecord) else encode_sequence(record)
    cut = data.draw(st.integers(0, len(blob) - 1), label="cut")
    with pytest.raises(DecodeError):
        decode_record(blob[:cut])
    pos = data.draw(st.integers(0, len(blob) - 1), label="pos")
    flip = data.draw(st.integers(1, 255), label="xor")
    garbled = bytearray(blob)
    garbled[pos] ^= flip
    with pytest.raises(DecodeError):
        decode_record(bytes(garbled))
    with pytest.raises(DecodeError, match="trailing|checksum"):
        decode_record(blob + b"\x00")


def make_step(request_id="r-1", gamma=4, k=20, seed=0) -> StepRecord:
    rng = np.random.default_rng(seed)
    lps = np.sort(np.log(rng.dirichlet(np.ones(k), size=gamma + 1)), axis=1)[:, ::-1]
    return StepRecord(request_id=request_id, position=17, draft_tokens=rng.integers(0, 49152, gamma),
                      num_accepted=2, target_topk_ids=rng.integers(0, 49152, (gamma + 1, k)),
                      target_topk_logprobs=lps.astype(np.float16), algorithm="mjsd", draft_version="7",
                      temperature=0.7, top_k=20, top_p=0.9, timestamp=1.7e9, next_token=5)


def test_step_layout_matches_the_documented_spec():
    rec = make_step()
    body = struct.pack("<4sBB", b"DSRB", 2, 1)
    body += struct.pack("<IHHHBdiddi", 17, 4, 2, 20, 1, 0.7, 20, 0.9, 1.7e9, 5)
    for s in ("r-1", "mjsd", "7"):
        body += struct.pack("<H", len(s)) + s.encode()
    body += rec.draft_tokens.astype("<i4").tobytes() + rec.target_topk_ids.astype("<i4").tobytes()
    body += rec.target_topk_logprobs.astype("<f2").tobytes()
    assert encode_step(rec) == body + struct.pack("<I", zlib.crc32(body))
    assert (MAGIC, VERSION) == (b"DSRB", 2)
    # a step of layout 1 (before sequences named their target) is the same bytes under version 1
    v1 = body[:4] + b"\x01" + body[5:]
    assert_steps_equal(decode_step(v1 + struct.pack("<I", zlib.crc32(v1))), rec, np.float16)


def test_sequence_layout_matches_the_documented_spec():
    rec = SequenceRecord("r-1", np.array([5, 6, 7]), 2, "7", timestamp=3.5, source="gsm8k",
                         meta={"log_mode": "full", "a": [1, 2]}, target="ab12")
    meta = b'{"a":[1,2],"log_mode":"full"}'
    body = struct.pack("<4sBB", b"DSRB", 2, 2) + struct.pack("<IId", 2, 3, 3.5)
    for s in (b"r-1", b"7", b"gsm8k"):
        body += struct.pack("<H", len(s)) + s
    body += struct.pack("<I", len(meta)) + meta + struct.pack("<H", 4) + b"ab12" + np.array([5, 6, 7], "<i4").tobytes()
    assert encode_sequence(rec) == body + struct.pack("<I", zlib.crc32(body))
    # layout 1, written before sequences named their target, still reads: its target is unknown ("")
    v1 = struct.pack("<4sBB", b"DSRB", 1, 2) + struct.pack("<IId", 2, 3, 3.5)
    for s in (b"r-1", b"7", b"gsm8k"):
        v1 += struct.pack("<H", len(s)) + s
    v1 += struct.pack("<I", len(meta)) + meta + np.array([5, 6, 7], "<i4").tobytes()
    old = decode_sequence(v1 + struct.pack("<I", zlib.crc32(v1)))
    assert (old.request_id, old.prompt_len, old.source, old.meta, old.target) == \
        ("r-1", 2, "gsm8k", {"log_mode": "full", "a": [1, 2]}, "")
    np.testing.assert_array_equal(old.token_ids, [5, 6, 7])


def test_step_size_at_k20_gamma4_is_under_1kb():
    rec = make_step(request_id=uuid.uuid4().hex, gamma=4, k=20)
    n = len(encode_step(rec))
    # prefix 6 + header 43 + strings (2+32)+(2+4)+(2+1) + draft 16 + ids 400 + float16 logprobs 200 + crc 4
    assert n == 6 + 43 + 34 + 6 + 3 + 16 + 400 + 200 + 4 == 712
    assert len(encode_step(rec, logprob_dtype=np.float32)) == n + 200


def _reframe(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


def test_decode_rejects_well_framed_but_inconsistent_records():
    """A valid checksum is not enough: lengths and schema invariants are checked too."""
    good = encode_step(make_step())[:-4]
    hdr = bytearray(good)
    struct.pack_into("<H", hdr, 6 + 6, 9)              # num_accepted 9 > gamma 4
    with pytest.raises(DecodeError, match="schema"):
        decode_step(_reframe(bytes(hdr)))
    hdr = bytearray(good)
    struct.pack_into("<H", hdr, 6 + 8, 21)             # k 21: the arrays are now too short
    with pytest.raises(DecodeError, match="truncated"):
        decode_step(_reframe(bytes(hdr)))
    hdr = bytearray(good)
    hdr[6 + 10] = 7                                     # unknown log-prob dtype code
    with pytest.raises(DecodeError, match="dtype"):
        decode_step(_reframe(bytes(hdr)))
    bad_utf8 = good[:49] + struct.pack("<H", 3) + b"\xff\xfe\xfd" + good[49 + 2 + 3:]
    with pytest.raises(DecodeError, match="UTF-8"):
        decode_step(_reframe(bad_utf8))
    with pytest.raises(DecodeError, match="version"):
        decode_step(_reframe(good[:4] + b"\x03" + good[5:]))
    with pytest.raises(DecodeError, match="magic"):
        decode_step(_reframe(b"XXXX" + good[4:]))
    seq = encode_sequence(SequenceRecord("r", np.arange(3), 1, "v"))
    with pytest.raises(DecodeError, match="expected a StepRecord"):
        decode_step(seq)
    with pytest.raises(DecodeError, match="expected a SequenceRecord"):
        decode_sequence(encode_step(make_step()))
    with pytest.raises(DecodeError, match="JSON object"):
        body = seq[:-4]
        meta_at = len(body) - 12 - 2 - 2 - 4            # u32 meta length sits before "{}", target "" and 3 tokens
        decode_sequence(_reframe(body[:meta_at] + struct.pack("<I", 2) + b"[]" + body[meta_at + 6:]))
    with pytest.raises(DecodeError, match="expected bytes"):
        decode_record("DSRB")


def test_encode_errors_name_the_field():
    rec = make_step()
    rec.num_accepted = 5                                # mutated after validation
    with pytest.raises(EncodeError, match="num_accepted"):
        encode_step(rec)
    with pytest.raises(EncodeError, match="request_id"):
        encode_step(make_step(request_id="x" * 70_000))
    with pytest.raises(EncodeError, match="UTF-8"):
        encode_step(make_step(request_id="\ud800"))
    with pytest.raises(EncodeError, match="float16 or float32"):
        encode_step(make_step(), logprob_dtype=np.float64)
    with pytest.raises(EncodeError, match="JSON"):
        encode_sequence(SequenceRecord("r", np.arange(3), 1, "v", meta={"s": {1, 2}}))
    with pytest.raises(EncodeError, match="JSON"):          # strict JSON: no NaN/Infinity literals
        encode_sequence(SequenceRecord("r", np.arange(3), 1, "v", meta={"x": float("inf")}))
    with pytest.raises(EncodeError, match="StepRecord"):
        encode_step(SequenceRecord("r", np.arange(3), 1, "v"))


def test_float16_storage_keeps_log_probs_to_documented_precision():
    rec = make_step()
    rec.target_topk_logprobs = np.array([[-0.01, -1.5, -9.99, -70000.0]] * 5, dtype=np.float32)
    rec.target_topk_ids = np.zeros((5, 4), np.int32)
    got = decode_step(encode_step(rec)).target_topk_logprobs.astype(np.float64)
    want = rec.target_topk_logprobs.astype(np.float64)
    # float16 has 11 significant bits: round-to-nearest is within 2**-11 relative error
    np.testing.assert_allclose(got[:, :3], want[:, :3], rtol=2**-11)
    assert np.all(got[:, 3] == -np.inf)


def test_log_modes():
    seq = SequenceRecord("r", np.arange(5), 2, "v3", source="gsm8k", meta={"user": "alice", "log_mode": "ids_only"},
                         target="ab12")
    ids_only = apply_log_mode(seq, "ids_only")
    assert ids_only.meta == {"log_mode": "ids_only"} and ids_only.source == "gsm8k" and ids_only.target == "ab12"
    np.testing.assert_array_equal(ids_only.token_ids, seq.token_ids)
    assert seq.meta["user"] == "alice"                    # the input is not modified
    assert apply_log_mode(seq, "full") is seq
    assert apply_log_mode(seq, "none") is None
    step = make_step()
    assert apply_log_mode(step, "ids_only") is step and apply_log_mode(step, "none") is None
    with pytest.raises(ValueError, match="unknown log_mode 'partial'"):
        apply_log_mode(step, "partial")
    assert check_log_mode("full") == "full"
