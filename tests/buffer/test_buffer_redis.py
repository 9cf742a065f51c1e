"""The Redis replay buffer against a real Redis server (buffer/redis_store.py, buffer/embedded.py).

Shared tests use the test run's Redis (tests/conftest.py `redis_url`: REDIS_URL, else 127.0.0.1:6379,
else an embedded server) with a unique key prefix each (deleted afterwards).
Tests that stop or fill a server start their OWN redis-server on a free port.
"""
from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from buffer import embedded
from buffer.codec import encode_sequence, encode_step
from buffer.embedded import EmbeddedRedis, ping
from buffer.records import SequenceRecord, StepRecord
from buffer.redis_store import (BufferConfig, BufferUnavailable, ReplayBufferReader, ReplayBufferWriter, connect,
                                redis_url_from_env)



@pytest.fixture
def cfg(redis_url):
    """A config with a unique prefix; every key under it is deleted after the test."""
    config = BufferConfig(prefix=f"test:{uuid.uuid4().hex[:12]}", flush_interval_s=0.002)
    yield config
    client = connect(redis_url)
    keys = list(client.scan_iter(match=f"{config.prefix}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


def make_step(i: int, request_id: str = "req-0", draft_version: str = "v1", gamma: int = 4, k: int = 20) -> StepRecord:
    rng = np.random.default_rng(i)
    return StepRecord(request_id=request_id, position=10 + i, draft_tokens=rng.integers(0, 49152, gamma),
                      num_accepted=int(rng.integers(0, gamma + 1)),
                      target_topk_ids=rng.integers(0, 49152, (gamma + 1, k)),
                      target_topk_logprobs=-rng.random((gamma + 1, k)).astype(np.float16) * 10,
                      algorithm="mjsd", draft_version=draft_version, temperature=0.7, top_k=20, top_p=0.9,
                      timestamp=time.time(), next_token=int(rng.integers(0, 49152)))


def make_seq(request_id: str, draft_version: str = "v1", source: str = "unit", log_mode: str = "full") -> SequenceRecord:
    return SequenceRecord(request_id, np.arange(40), 12, draft_version, timestamp=time.time(), source=source,
                          meta={"log_mode": log_mode, "note": "free text"})


def wait_until(cond, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.01)


# ----------------------------------------------------------------------------- configuration
def test_connect_sets_deliberate_client_options(redis_url, monkeypatch):
    client = connect(redis_url)
    kw = client.connection_pool.connection_kwargs
    assert (kw["socket_timeout"], kw["socket_connect_timeout"], kw["health_check_interval"]) == (2.0, 1.0, 10)
    assert client.get_retry().get_retries() == 0          # redis-py 8 would retry 10 times by default
    assert client.ping()
    monkeypatch.setenv("REDIS_URL", redis_url)
    assert redis_url_from_env() == redis_url and connect(None).ping()
    monkeypatch.setenv("REDIS_URL", "")
    assert redis_url_from_env() is None


def test_config_and_reader_arguments_are_validated(redis_url, cfg):
    with pytest.raises(ValueError, match="max_steps"):
        BufferConfig(max_steps=0)
    with pytest.raises(ValueError, match="log_mode"):
        BufferConfig(log_mode="some")
    with pytest.raises(ValueError, match="prefix"):
        BufferConfig(prefix="a b")
    reader = ReplayBufferReader(connect(redis_url), cfg)   # socket_timeout 2 s
    with pytest.raises(ValueError, match="socket_timeout"):
        reader.read(10, block_ms=5000)
    with pytest.raises(ValueError, match="stream"):
        ReplayBufferReader(redis_url, cfg, stream="logs")


# ----------------------------------------------------------------------------- write / read
def test_records_round_trip_through_redis_with_sequence_lookup(redis_url, cfg):
    steps = [make_step(i, request_id=f"req-{i % 3}") for i in range(30)]
    with ReplayBufferWriter(redis_url, cfg) as writer:
        for s in steps:
            writer.push_step(s)
        for r in range(3):
            writer.push_sequence(make_seq(f"req-{r}"))
        assert writer.flush(10)
        stats = writer.stats()
    assert (stats["written"], stats["dropped"], stats["queue_depth"], stats["connected"]) == (33, 0, 0, True)

    reader = ReplayBufferReader(redis_url, cfg, consumer="t0")
    got = reader.read(100, block_ms=100)
    assert [e.record.position for e in got] == [s.position for s in steps]      # stream order = push order
    for entry, want in zip(got, steps):
        np.testing.assert_array_equal(entry.record.target_topk_ids, want.target_topk_ids)
        np.testing.assert_array_equal(entry.record.target_topk_logprobs, want.target_topk_logprobs)
        assert entry.record.next_token == want.next_token and entry.record.request_id == want.request_id
    assert reader.pending() == 30
    assert reader.ack([e.stream_id for e in got]) == 30 and reader.pending() == 0
    assert reader.read(10, block_ms=0) == []

    seq = reader.get_sequence("req-1")
    assert seq is not None and seq.prompt_len == 12 and list(seq.token_ids) == list(range(40))
    assert reader.get_sequence("nope") is None
    ttl_ms = reader.client.pttl(cfg.seq_key("req-1"))
    assert 0 < ttl_ms <= cfg.max_age_s * 1000
    seqs = ReplayBufferReader(redis_url, cfg, stream="sequences", consumer="s0").read(10, block_ms=0)
    assert sorted(e.record.request_id for e in seqs) == ["req-0", "req-1", "req-2"]


def test_maxlen_trimming_keeps_the_stream_near_its_bound(redis_url, cfg):
    """Approximate MAXLEN removes whole stream nodes, so XLEN lands in [bound, bound + one node)."""
    cfg.max_steps, cfg.queue_size = 1000, 6000
    with ReplayBufferWriter(redis_url, cfg) as writer:
        record = make_step(0)
        for _ in range(5000):
            writer.push_step(record)
        assert writer.flush(20)
        assert writer.stats()["written"] == 5000
        client = writer.client
        node_entries = int(client.config_get("stream-node-max-entries")["stream-node-max-entries"])
        assert 1000 <= client.xlen(cfg.steps_key) < 1000 + node_entries


def test_age_trimming_uses_server_time(redis_url, cfg):
    cfg.max_age_s, cfg.trim_interval_s = 0.4, 3600.0     # trim only when asked, to control timing
    with ReplayBufferWriter(redis_url, cfg) as writer:
        for i in range(20):
            writer.push_step(make_step(i))
        writer.push_sequence(make_seq("old"))
        assert writer.flush(10)
        time.sleep(0.6)
        for i in range(5):
            writer.push_step(make_step(100 + i))
        assert writer.flush(10)
        assert writer.trim_now(exact=True) == 21
        client = writer.client
        assert client.xlen(cfg.steps_key) == 5 and client.xlen(cfg.seqs_key) == 0
        assert client.get(cfg.seq_key("old")) is None        # the per-request key expired (TTL = max age)


# ----------------------------------------------------------------------------- consumer groups
def test_crashed_reader_leaves_entries_pending_and_another_reclaims_them(redis_url, cfg):
    with ReplayBufferWriter(redis_url, cfg) as writer:
        for i in range(50):
            writer.push_step(make_step(i))
        assert writer.flush(10)
    all_ids = [sid.decode() for sid, _ in connect(redis_url).xrange(cfg.steps_key)]
    assert len(all_ids) == 50

    first = ReplayBufferReader(redis_url, cfg, consumer="a", min_idle_ms=300)
    batch = first.read(20, block_ms=0)
    assert len(batch) == 20
    first.ack([e.stream_id for e in batch[:8]])           # then "dies" with 12 unacked
    del first

    second = ReplayBufferReader(redis_url, cfg, consumer="b", min_idle_ms=300)
    fresh = second.read(100, block_ms=0)                   # the 12 are not idle long enough yet
    assert [e.stream_id for e in fresh] == all_ids[20:]
    second.ack([e.stream_id for e in fresh])
    time.sleep(0.35)
    reclaimed = second.read(100, block_ms=0)
    assert [e.stream_id for e in reclaimed] == [e.stream_id for e in batch[8:]]
    assert second.stats()["reclaimed"] == 12
    second.ack([e.stream_id for e in reclaimed])
    acked = {e.stream_id for e in batch[:8] + fresh + reclaimed}
    assert acked == set(all_ids) and second.pending() == 0                      # nothing lost


def test_reader_does_not_hand_out_an_entry_twice(redis_url, cfg):
    with ReplayBufferWriter(redis_url, cfg) as writer:
        for i in range(6):
            writer.push_step(make_step(i))
        assert writer.flush(10)
    reader = ReplayBufferReader(redis_url, cfg, consumer="solo", min_idle_ms=100)
    got = reader.read(10, block_ms=0)
    assert len(got) == 6
    time.sleep(0.15)                                      # idle enough that XAUTOCLAIM offers them again
    assert reader.read(10, block_ms=0) == []
    assert reader.stats()["duplicates_skipped"] == 6
    reader.release([e.stream_id for e in got[:2]])        # give two back: they come again after idle
    time.sleep(0.15)
    again = reader.read(10, block_ms=0)
    assert [e.stream_id for e in again] == [e.stream_id for e in got[:2]]
    assert reader.ack([e.stream_id for e in got]) == 6 and reader.pending() == 0


def test_corrupt_entries_are_counted_and_skipped(redis_url, cfg):
    client = connect(redis_url)
    good = make_step(1)
    truncated = encode_step(good)[:-10]
    client.xadd(cfg.steps_key, {b"d": b"\x00garbage"})
    client.xadd(cfg.steps_key, {b"d": encode_step(good)})
    client.xadd(cfg.steps_key, {b"d": truncated})
    client.xadd(cfg.steps_key, {b"other": b"no d field"})
    client.xadd(cfg.steps_key, {b"d": encode_sequence(make_seq("r"))})    # wrong kind in this stream
    client.xadd(cfg.steps_key, {b"d": encode_step(make_step(2))})
    client.set(cfg.seq_key("broken"), b"DSRB\x01\x02...")

    reader = ReplayBufferReader(redis_url, cfg, consumer="c")
    got = reader.read(20, block_ms=0)
    assert [e.record.position for e in got] == [good.position, make_step(2).position]
    assert reader.stats()["decode_errors"] == 4
    assert reader.pending() == 2                          # corrupt entries were acked, not left to loop
    window = reader.newest(10)
    assert [e.record.position for e in window] == [12, 11] and reader.stats()["decode_errors"] == 8
    assert reader.get_sequence("broken") is None and reader.stats()["decode_errors"] == 9


def test_newest_windows_filter_without_consuming(redis_url, cfg):
    with ReplayBufferWriter(redis_url, cfg) as writer:
        for i in range(12):
            writer.push_step(make_step(i, request_id=f"r{i % 4}", draft_version="v2" if i % 2 else "v1"))
        for r in range(4):
            writer.push_sequence(make_seq(f"r{r}", source="gsm8k" if r < 2 else "mtbench"))
        writer.push_step(make_step(99, request_id="in-flight", draft_version="v2"))   # no sequence yet
        assert writer.flush(10)
    reader = ReplayBufferReader(redis_url, cfg, consumer="eval")
    v2 = reader.newest(3, draft_version="v2")
    assert [e.record.position for e in v2] == [109, 21, 19]                       # newest first
    gsm = reader.newest(100, source="gsm8k")
    assert [e.record.position for e in gsm] == [19, 18, 15, 14, 11, 10]          # r0 and r1 only
    seqs = reader.newest(5, stream="sequences", source="mtbench")
    assert [e.record.request_id for e in seqs] == ["r3", "r2"]
    assert reader.pending() == 0                                                  # nothing consumed


def test_a_reader_for_one_target_leaves_out_requests_another_target_scored(redis_url, cfg):
    """A buffer outlives a change of target (the default prefix is shared): a job for target A must not learn
    target B's opinions. Sequences of unknown target (layout 1, a writer that knew none) are kept."""
    from training.data import read_training_window

    a, b = "a" * 64, "b" * 64
    with ReplayBufferWriter(redis_url, cfg) as writer:
        for i, (rid, tgt) in enumerate([("ra", a), ("rb", b), ("ru", "")]):
            for j in range(3):
                writer.push_step(make_step(10 * i + j, request_id=rid))
            seq = make_seq(rid)
            seq.target = tgt
            writer.push_sequence(seq)
        assert writer.flush(10)
    anyone = ReplayBufferReader(redis_url, cfg)
    assert {s.target for s in anyone.get_sequences(["ra", "rb", "ru"]).values()} == {a, b, ""}
    reader = ReplayBufferReader(redis_url, cfg, target=a)
    assert sorted(reader.get_sequences(["ra", "rb", "ru"])) == ["ra", "ru"]
    entries, seqs = reader.newest_steps(100)
    assert sorted({e.record.request_id for e in entries}) == ["ra", "ru"] and sorted(seqs) == ["ra", "ru"]
    assert [s.request_id for s in reader.sequences_after("0-0")] == ["ra", "ru"]
    assert [e.record.request_id for e in reader.newest(10, stream="sequences")] == ["ru", "ra"]
    assert list(reader.other_target) == ["rb"] and reader.stats()["other_target"] == 1      # counted once
    # a consuming job acks the other target's steps (never trainable), instead of leaving them pending as if
    # their request were still in flight
    job = ReplayBufferReader(redis_url, cfg, group="trainer-a", target=a)
    window = read_training_window(job, max_records=100, heldout_fraction=0.01)
    assert sorted({e.record.request_id for e in window.entries}) == ["ra", "ru"]
    assert window.skipped == {"another target": 3} and window.left_pending == []
    job.ack([e.stream_id for e in window.entries])
    assert job.pending() == 0
    with pytest.raises(ValueError, match="fingerprint"):
        ReplayBufferReader(redis_url, cfg, target="")


# ----------------------------------------------------------------------------- writer behaviour
def test_log_modes_through_the_writer(redis_url, cfg):
    with ReplayBufferWriter(redis_url, cfg) as writer:
        writer.push_sequence(make_seq("a", log_mode="ids_only"))
        writer.push_sequence(make_seq("b", log_mode="none"))
        writer.push_step(make_step(0, request_id="b"), log_mode="none")
        writer.push_step(make_step(1, request_id="c"), log_mode="partial")
        writer.push_sequence(make_seq("d"))
        assert writer.flush(10)
        s = writer.stats()
    assert (s["written"], s["skipped_opt_out"], s["dropped_invalid_log_mode"]) == (2, 2, 1)
    reader = ReplayBufferReader(redis_url, cfg)
    assert reader.get_sequence("a").meta == {"log_mode": "ids_only"}
    assert reader.get_sequence("d").meta == {"log_mode": "full", "note": "free text"}
    assert reader.get_sequence("b") is None and reader.newest(5) == []

    strict = BufferConfig(prefix=cfg.prefix, log_mode="ids_only")                 # deployment-wide floor
    with ReplayBufferWriter(redis_url, strict) as writer:
        writer.push_sequence(make_seq("e", log_mode="full"))
        assert writer.flush(10)
    assert reader.get_sequence("e").meta == {"log_mode": "ids_only"}


def test_push_never_blocks_or_raises_and_a_full_queue_drops(redis_url, cfg):
    cfg.queue_size = 10
    writer = ReplayBufferWriter(redis_url, cfg, start=False)      # nobody drains the queue yet
    record = make_step(0)
    t0 = time.perf_counter()
    writer.push_step("not a record")                              # a bad record surfaces at encode, counted
    for _ in range(25):
        writer.push_step(record)
    per_push_us = (time.perf_counter() - t0) / 26 * 1e6
    s = writer.stats()
    assert (s["enqueued"], s["dropped_queue_full"], s["queue_depth"]) == (10, 16, 10)
    assert per_push_us < 200                                      # microseconds, not a network round trip
    writer.start()
    assert writer.flush(10)
    s = writer.stats()
    assert s["written"] == 9 and s["dropped_encode_error"] == 1
    assert s["enqueued"] == s["written"] + s["dropped_write_error"] + s["dropped_encode_error"]
    writer.close()
    writer.push_step(record)                                      # after close: no exception, counted
    assert writer.stats()["dropped_on_close"] == 1 and writer.stats()["queue_depth"] == 0


def test_writer_with_unreachable_redis_keeps_returning_instantly(tmp_path):
    srv = EmbeddedRedis(tmp_path / "gone", transport="tcp", persist=False)
    url = srv.start()
    srv.stop()                                                    # a port where nothing listens now
    cfg = BufferConfig(prefix="test:down", queue_size=100)
    writer = ReplayBufferWriter(url, cfg)
    t0 = time.perf_counter()
    for i in range(300):
        writer.push_step(make_step(i % 5))
    assert time.perf_counter() - t0 < 0.5
    wait_until(lambda: writer.stats()["queue_depth"] == 100, what="queue to fill")
    s = writer.stats()
    assert not s["connected"] and s["written"] == 0 and s["dropped_queue_full"] == 200
    writer.close(timeout_s=0.2)
    assert writer.stats()["dropped_on_close"] == 100 and writer.stats()["dropped"] == 300
    with pytest.raises(BufferUnavailable):
        ReplayBufferReader(url, cfg).read(1, block_ms=0)
    idle = ReplayBufferWriter(url, cfg)                           # nothing queued: it still notices Redis
    time.sleep(0.1)
    assert not idle.stats()["connected"]
    srv.start()
    try:
        wait_until(lambda: idle.stats()["connected"], what="the idle writer to reconnect")
    finally:
        idle.close()
        srv.stop()


def test_writer_survives_a_redis_restart_mid_load(tmp_path):
    """Own redis-server on a free port: stopped and restarted (empty) while a thread keeps pushing."""
    srv = EmbeddedRedis(tmp_path / "own", transport="tcp", persist=False)
    url = srv.start()
    try:
        cfg = BufferConfig(prefix="test:restart", queue_size=50_000, flush_interval_s=0.002)
        writer = ReplayBufferWriter(url, cfg)
        record = make_step(3)
        stop, errors, slowest = threading.Event(), [], [0.0]

        def load():
            try:
                while not stop.is_set():
                    t = time.perf_counter()
                    writer.push_step(record)
                    slowest[0] = max(slowest[0], time.perf_counter() - t)
                    time.sleep(0.0005)
            except BaseException as exc:  # noqa: BLE001 - the test asserts there is none
                errors.append(exc)

        pusher = threading.Thread(target=load)
        pusher.start()
        try:
            wait_until(lambda: writer.stats()["written"] >= 200, what="first writes")
            srv.stop()
            wait_until(lambda: not writer.stats()["connected"], what="the writer to notice")
            time.sleep(0.3)                                       # pushing goes on while Redis is down
            before = writer.stats()
            srv.start()                                           # same port, empty server
            fresh = connect(url)
            wait_until(lambda: fresh.xlen(cfg.steps_key) >= 300, what="writes to resume")
        finally:
            stop.set()
            pusher.join()
        assert writer.flush(10)
        s = writer.stats()
        assert errors == [] and s["reconnects"] >= 1 and s["connected"]
        assert s["written"] >= before["written"] + 300
        assert s["enqueued"] == s["written"] + s["dropped_write_error"] + s["dropped_encode_error"]
        assert slowest[0] < 0.5      # never waited on Redis (1 s connect timeout); GIL hand-offs are ~5 ms
        entries = ReplayBufferReader(url, cfg).read(50, block_ms=0)
        assert len(entries) == 50 and all(e.record.position == record.position for e in entries)
        writer.close()
    finally:
        srv.stop()


def test_writer_counts_writes_refused_by_a_full_redis(tmp_path):
    srv = EmbeddedRedis(tmp_path / "full", transport="tcp", persist=False)
    url = srv.start()
    try:
        client = connect(url)
        client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + 300_000)
        cfg = BufferConfig(prefix="test:oom", queue_size=5000)
        with ReplayBufferWriter(url, cfg) as writer:
            for i in range(3000):                                 # ~2.3 MB of steps
                writer.push_step(make_step(i % 7))
            assert writer.flush(20)
            s = writer.stats()
        assert s["connected"] and s["written"] > 0 and s["dropped_write_error"] > 0
        assert s["written"] + s["dropped_write_error"] == 3000
        assert client.xlen(cfg.steps_key) == s["written"]
    finally:
        srv.stop()


# ----------------------------------------------------------------------------- embedded server
def test_embedded_server_starts_accepts_writes_is_shared_and_persists(tmp_path):
    directory = tmp_path / "data" / "redis"
    owner = EmbeddedRedis(directory, persist=True)
    url = owner.start()
    assert owner.owned and url.startswith("unix://") and (directory / "redis.conf").exists()
    cfg = BufferConfig(prefix="test:embedded")
    with ReplayBufferWriter(url, cfg) as writer:
        for i in range(20):
            writer.push_step(make_step(i))
        assert writer.flush(10) and writer.stats()["written"] == 20
    guest = EmbeddedRedis(directory)
    assert guest.start() == url and not guest.owned               # a second process attaches
    guest.stop()                                                  # ...and does not stop the owner's server
    assert ping(url)
    owner.stop()
    assert not ping(url) and not (directory / "redis.url").exists()
    again = EmbeddedRedis(directory, persist=True)
    try:
        assert connect(again.start()).xlen(cfg.steps_key) == 20   # the snapshot was reloaded
    finally:
        again.stop()


def test_connect_without_url_starts_the_embedded_server(tmp_path, monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setenv("DRAFTSMITH_DATA", str(tmp_path / "d"))
    try:
        client = connect(None)
        assert client.ping() and client.set("k", b"v")
        url = (tmp_path / "d" / "redis" / "redis.url").read_text().strip()
        assert ping(url)
    finally:
        embedded.stop_embedded()
    assert not ping(url)


def test_embedded_server_reports_a_missing_binary(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="not an executable"):
        EmbeddedRedis(tmp_path / "x", binary=str(tmp_path / "no-redis-server")).start()
    monkeypatch.setenv("DRAFTSMITH_REDIS_SERVER", str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="DRAFTSMITH_REDIS_SERVER"):
        embedded.find_redis_server()
    monkeypatch.delenv("DRAFTSMITH_REDIS_SERVER")
    assert os.access(embedded.find_redis_server(), os.X_OK)
    assert Path(embedded.find_redis_server()).name == "redis-server"


# ----------------------------------------------------------------------------- paths and defaults
def test_paths_and_defaults_have_one_home(tmp_path, monkeypatch):
    """buffer/paths.py: an empty DRAFTSMITH_DATA / DRAFTSMITH_CACHE means the default (the two copies of
    data_dir this replaced disagreed there); every package reads these values from it."""
    from buffer import paths

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DRAFTSMITH_DATA", "")
    monkeypatch.setenv("DRAFTSMITH_CACHE", "")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert paths.data_dir() == (tmp_path / "data").resolve()
    assert paths.cache_dir() == Path.home() / ".cache" / "draftsmith"
    assert paths.default_tracking_uri() == f"sqlite:///{(tmp_path / 'data').resolve() / 'mlflow.db'}"
    monkeypatch.setenv("DRAFTSMITH_DATA", str(tmp_path / "d"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    assert paths.data_dir() == tmp_path / "d" and paths.default_tracking_uri() == "http://mlflow:5000"
    assert embedded.data_dir is paths.data_dir
    assert all(paths.is_default_target(t) for t in (None, "", "default", paths.DEFAULT_TARGET))
    assert not paths.is_default_target("/models/other")


def test_count_after_and_newest_steps_page_the_stream_in_redis(redis_url):
    """The stream windows and counts trainers use live here: counts after a cursor (Lua over XRANGE pages),
    the newest steps matching a predicate / older than an id, with their sequences."""
    from buffer.redis_store import count_after, stream_id_key

    cfg = BufferConfig(prefix=f"test:count:{uuid.uuid4().hex[:8]}")
    client = connect(redis_url)
    try:
        ids = []
        for i in range(25):
            rid = f"r{i % 5}"
            ids.append(client.xadd(cfg.steps_key, {b"d": encode_step(make_step(i, request_id=rid))}).decode())
        for i in range(4):                                          # r4 has no stored sequence
            client.set(cfg.seq_key(f"r{i}"), encode_sequence(SequenceRecord(f"r{i}", list(range(40)), 3, "v1",
                                                                            source="a" if i % 2 else "b")))
        assert count_after(client, cfg.steps_key) == 25
        assert count_after(client, cfg.steps_key, ids[9], page=4) == 15
        assert count_after(client, cfg.steps_key, ids[-1], page=4) == 0
        with pytest.raises(ValueError):
            count_after(client, cfg.steps_key, "not-an-id")
        reader = ReplayBufferReader(client, cfg)
        got, seqs = reader.newest_steps(6, where=lambda r: r.request_id != "r0", before_id=ids[20])
        assert all(stream_id_key(e.stream_id) < stream_id_key(ids[20]) for e in got)
        assert all(e.record.request_id not in ("r0", "r4") for e in got) and len(got) == 6
        assert set(seqs) == {e.record.request_id for e in got}
        only_a, seqs_a = reader.newest_steps(100, source="a")
        assert {e.record.request_id for e in only_a} == {"r1", "r3"} and set(seqs_a) == {"r1", "r3"}
    finally:
        client.close()


def test_sequence_cursor_splits_requests_a_reader_could_rebuild_from_later_ones(redis_url, cfg):
    """A heads job's `sequence_cut` and the gate's fresh evidence (deploy/heads.py): the cursor taken after a read
    is at or after every sequence that read could look up; `sequences_after` returns exactly the later ones,
    oldest first; `newest_steps(after_id=...)` stops its scan at an id."""
    from buffer.redis_store import stream_id_key

    reader = ReplayBufferReader(redis_url, cfg)
    assert reader.sequence_cursor() == "0-0" and reader.sequences_after("0-0") == []
    with ReplayBufferWriter(redis_url, cfg) as writer:
        for r in ("a", "b"):
            writer.push_step(make_step(1, request_id=r))
            writer.push_sequence(make_seq(r))
        writer.push_step(make_step(2, request_id="c"))                 # in flight: its sequence comes later
        assert writer.flush(10)
    seen, _ = reader.newest_steps(10)
    assert {e.record.request_id for e in seen} == {"a", "b"}            # c cannot be rebuilt yet
    cut = reader.sequence_cursor()
    with ReplayBufferWriter(redis_url, cfg) as writer:
        writer.push_sequence(make_seq("c"))
        writer.push_step(make_step(3, request_id="d"))
        writer.push_sequence(make_seq("d"))
        assert writer.flush(10)
    assert [s.request_id for s in reader.sequences_after(cut)] == ["c", "d"]
    assert [s.request_id for s in reader.sequences_after("0-0", n=1)] == ["a"]
    assert reader.sequences_after(reader.sequence_cursor()) == []
    steps, _ = reader.newest_steps(10)
    newest_of_b = max((e.stream_id for e in steps if e.record.request_id == "b"), key=stream_id_key)
    after, seqs = reader.newest_steps(10, after_id=newest_of_b)
    assert {e.record.request_id for e in after} == {"c", "d"} and set(seqs) == {"c", "d"}
    with pytest.raises(ValueError, match="stream id"):
        reader.sequences_after("yesterday")
    with pytest.raises(ValueError, match="stream id"):
        reader.newest_steps(3, after_id="nope")
