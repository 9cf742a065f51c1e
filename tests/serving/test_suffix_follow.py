"""The suffix store follows the replay buffer (serving/decoding/suffix.py `BufferFollower`): a restarted replica
starts with the answers the service served before, every replica learns the others' answers, an answer is stored
once whichever way it arrives, and Redis going away costs the sharing, never the replica. Real Redis throughout."""
from __future__ import annotations

import threading
import time
import uuid

import httpx
import numpy as np
import pytest

from buffer.records import SequenceRecord
from buffer.redis_store import BufferConfig, BufferUnavailable, ReplayBufferReader, ReplayBufferWriter
from serving.decoding.suffix import BufferFollower, SuffixStore
from tests.serving.test_medusa_mode import heads_dir, pair  # noqa: F401  (module fixtures: tiny pair, random heads)


def _seq(rid: str, prompt: list[int], answer: list[int]) -> SequenceRecord:
    return SequenceRecord(request_id=rid, token_ids=np.array(prompt + answer, dtype=np.int32),
                          prompt_len=len(prompt), draft_version="v1", timestamp=time.time())


def _write(redis_url: str, prefix: str, records: list[SequenceRecord]) -> None:
    w = ReplayBufferWriter(redis_url, BufferConfig(prefix=prefix, flush_interval_s=0.002))
    for r in records:
        w.push_sequence(r)
    assert w.flush(timeout_s=10.0)
    w.close()


def _reader(redis_url: str, prefix: str) -> ReplayBufferReader:
    return ReplayBufferReader(redis_url, BufferConfig(prefix=prefix), stream="sequences")


def test_an_answer_added_under_a_key_is_added_once():
    store = SuffixStore()
    assert store.add([1, 2], [3, 4, 5], key="r1") is True
    assert store.add([1, 2], [3, 4, 5], key="r1") is False
    assert store.add([1, 2], [3, 4, 5]) is True              # no key: no dedup
    assert store.answers == 2 and store.add([1], [], key="r2") is False


def test_warm_polls_and_skips(redis_url):
    prefix = f"test:follow:{uuid.uuid4().hex[:10]}"
    _write(redis_url, prefix, [_seq(f"old{i}", [1, 2, 3], [10 + i, 20, 21, 22]) for i in range(5)])
    store = SuffixStore()
    store.add([1, 2, 3], [14, 20, 21, 22], key="old4")      # this replica served old4 itself
    f = BufferFollower(store, _reader(redis_url, prefix), vocab_size=100)
    assert f.warm() == 4 and store.answers == 5                # old4 is not stored twice
    assert store.propose([0, 1, 2, 3, 12, 20], 2) == [21, 22]
    assert f.poll() == 0                                       # nothing new
    _write(redis_url, prefix, [_seq("new", [7, 8], [30, 31, 32]),
                               _seq("alien", [7, 8], [30, 31, 500])])   # a token outside the vocabulary
    assert f.poll() == 1 and f.skipped == 1 and f.added == 5
    assert store.propose([5, 7, 8, 30], 2) == [31, 32]
    assert f.poll() == 0 and store.answers == 6


def test_warm_takes_the_newest_answers_within_its_budget(redis_url):
    prefix = f"test:follow:{uuid.uuid4().hex[:10]}"
    _write(redis_url, prefix, [_seq(f"r{i}", [1, 2], [40 + i] * 9) for i in range(6)])
    store = SuffixStore()
    f = BufferFollower(store, _reader(redis_url, prefix), warm_tokens=25)   # 12 tokens an answer: two fit
    assert f.warm() == 2
    assert store.propose([1, 2, 45], 1) == [45] and store.propose([1, 2, 44], 1) == [44]
    assert store.propose([1, 2, 43], 1) == []
    # the cursor was taken before warming: what is written next is read by poll, not lost
    _write(redis_url, prefix, [_seq("later", [1, 2], [60, 61])])
    assert f.poll() == 1 and store.propose([1, 2, 60], 1) == [61]


def test_redis_down_is_retried_not_raised():
    reader = ReplayBufferReader("redis://127.0.0.1:1/0", BufferConfig(prefix="test:follow:down"), stream="sequences")
    f = BufferFollower(SuffixStore(), reader)
    with pytest.raises(BufferUnavailable):
        f.poll()
    stop = threading.Event()
    t = threading.Thread(target=f.run, args=(stop, 0.05), daemon=True)
    t.start()
    deadline = time.time() + 10
    while f.error is None and time.time() < deadline:
        time.sleep(0.02)
    stop.set()
    t.join(timeout=10)
    assert not t.is_alive() and f.error and "BufferUnavailable" in f.error and f.cursor is None


def _replica(pair, heads_dir, prefix):  # noqa: F811
    from tests.api_helpers import LiveServer, tiny_service

    svc = tiny_service(pair[0], buffer_prefix=prefix, suffix_follow_s=0.1, calibrate=False)
    svc.engine.load_heads(str(heads_dir))
    return LiveServer(svc).start()


def _wait_store(c: httpx.Client, want, timeout_s: float = 20.0) -> dict:
    deadline = time.time() + timeout_s
    while True:
        store = c.get("/health").json()["suffix_store"]
        if want(store) or time.time() > deadline:
            return store
        time.sleep(0.1)


def test_replicas_share_answers_and_a_restart_keeps_them(pair, heads_dir):  # noqa: F811
    """Two replicas on one buffer: each stores the other's answer within a poll and its own once; a replica
    started later begins with both; with following off (suffix_follow_s 0) a replica keeps only its own."""
    prefix = f"test:follow:{uuid.uuid4().hex[:10]}"
    body = {"max_tokens": 6, "temperature": 0, "speculative": {"mode": "medusa"}}
    a, b = _replica(pair, heads_dir, prefix), _replica(pair, heads_dir, prefix)
    try:
        with httpx.Client(base_url=a.url, timeout=60) as ca, httpx.Client(base_url=b.url, timeout=60) as cb:
            assert ca.post("/v1/completions", json={**body, "prompt": "the cat sat"}).status_code == 200
            assert cb.post("/v1/completions", json={**body, "prompt": "a dog ran far"}).status_code == 200
            for c in (ca, cb):
                store = _wait_store(c, lambda s: s["answers"] >= 2)
                assert store["answers"] == 2 and store["from_buffer"] == 1 and store["buffer_error"] is None
            time.sleep(0.5)                                     # more polls change nothing
            assert ca.get("/health").json()["suffix_store"]["answers"] == 2
            answer_a = a.service.engine.suffix_store.tokens
    finally:
        a.stop()
        b.stop()
    c_ = _replica(pair, heads_dir, prefix)                     # a restart: starts from the buffer
    try:
        with httpx.Client(base_url=c_.url, timeout=60) as cc:
            store = _wait_store(cc, lambda s: s["answers"] >= 2)
            assert store["answers"] == 2 and store["from_buffer"] == 2
        assert sorted(c_.service.engine.suffix_store.tokens) == sorted(answer_a)
    finally:
        c_.stop()
    from tests.api_helpers import LiveServer, tiny_service

    alone = LiveServer(tiny_service(pair[0], buffer_prefix=prefix, suffix_follow_s=0, calibrate=False)).start()
    try:
        assert alone.service.suffix_follower is None
        time.sleep(0.3)
        assert httpx.get(alone.url + "/health").json()["suffix_store"]["answers"] == 0
    finally:
        alone.stop()
