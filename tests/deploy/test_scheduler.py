"""deploy/scheduler.py: one job at a time (threads and processes), failed/killed jobs leave the
champion and the record cursor alone, the interval / min-records triggers, records acked only once the
candidate is registered (real Redis, real distillation on tiny models), a gate that could not finish is
run again, and the watchdog that rolls back a champion whose live acceptance drops (real MLflow)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from deploy.gate import GatePolicy
from deploy.registry import CANDIDATE, CHAMPION, PREVIOUS, Registry
from deploy.scheduler import (DistillScheduler, JobLock, JobRequest, ScheduleConfig, parse_duration, read_status)
from tests.deploy_helpers import fresh_store, make_base_draft, make_candidate, synthetic_evidence, template_db

SHA = "5" * 64            # the served target's fingerprint in these tests

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def template(tmp_path_factory):
    return template_db(tmp_path_factory.mktemp("mlflow-template"))


@pytest.fixture
def registry(template, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    reg = Registry("tiny-target", tracking_uri=fresh_store(template, tmp_path / "data"), cache_root=tmp_path / "cache")
    reg.register_base(make_base_draft(tmp_path / "base"), target_sha256=SHA)
    reg.promote("1")
    return reg


def scheduler(registry, distill, tmp_path, *, gain=0.1, **kw):
    """A scheduler whose gate sees every request gain `gain` (synthetic_evidence: the scoring is
    tested in test_gate.py), pinned to SHA."""
    kw.setdefault("lock", JobLock(tmp_path / "l.lock"))
    kw.setdefault("progress", lambda m: None)
    kw.setdefault("evidence", synthetic_evidence(gain))
    return DistillScheduler(registry, distill, smoke_check=kw.pop("smoke_check", ok_smoke), target_sha256=SHA, **kw)


def ok_smoke(path):
    return True, "fake: identical"


def candidate_maker(tmp_path, after=0.6):
    """A distill function that trains nothing but writes a valid candidate on the requested parent."""
    calls: list[JobRequest] = []

    def distill(req: JobRequest):
        calls.append(req)
        n = len(calls)
        return make_candidate(tmp_path / f"cand{n}", req.parent_path, parent_version=req.parent_version, seed=n,
                              before=0.4, after=after, last_id=f"1700000000000-{10 * n}",
                              target_sha256=req.target_sha256)

    return distill, calls


def test_successful_jobs_promote_and_advance_the_cursor(registry, tmp_path):
    distill, calls = candidate_maker(tmp_path)
    sched = scheduler(registry, distill, tmp_path)
    out = sched.run_job()
    assert out.status == "promoted" and out.version == "2" and out.parent_version == "1", out.message
    assert calls[0].parent_version == "1" and calls[0].since_id is None and calls[0].target_sha256 == SHA
    assert registry.get("2").target_sha256 == SHA
    assert (calls[0].parent_path / "config.json").is_file()
    out2 = sched.run_job()
    assert out2.status == "promoted" and out2.version == "3"
    assert calls[1].parent_version == "2" and calls[1].since_id == "1700000000000-10"   # records after job 1
    assert registry.aliases() == {CHAMPION: "3", PREVIOUS: "2"}
    assert read_status(sched.status_path)["version"] == "3"


def test_rejected_candidate_keeps_champion(registry, tmp_path):
    distill, _ = candidate_maker(tmp_path, after=0.9)             # claims +0.5; the gate's sample says -0.05
    sched = scheduler(registry, distill, tmp_path, gain=-0.05, policy=GatePolicy(margin=0.01))
    out = sched.run_job()
    assert out.status == "rejected" and out.version == "2" and registry.champion() == "1"
    assert out.verdict["accepted"] is False and out.verdict["delta"] < 0


def test_failed_job_leaves_champion_records_and_lock(registry, tmp_path):
    def broken(req):
        raise RuntimeError("out of memory")

    lock = JobLock(tmp_path / "l.lock")
    sched = scheduler(registry, broken, tmp_path, lock=lock)
    out = sched.run_job()
    assert out.status == "failed" and "out of memory" in out.message and "records left pending" in out.message
    assert registry.aliases() == {CHAMPION: "1"} and [v.version for v in registry.versions()] == ["1"]
    assert sched.cursor() is None and not lock.held and lock.holder() is None
    # a job whose output is not a valid candidate fails the same way
    bad = tmp_path / "not-a-candidate"
    bad.mkdir()
    out = scheduler(registry, lambda r: bad, tmp_path, lock=lock).run_job()
    assert out.status == "failed" and "no candidate.json" in out.message
    assert registry.champion() == "1" and read_status(sched.status_path)["status"] == "failed"


def test_never_two_jobs_at_once(registry, tmp_path):
    started, release = threading.Event(), threading.Event()
    distill, calls = candidate_maker(tmp_path)

    def slow(req):
        started.set()
        assert release.wait(60)
        return distill(req)

    path = tmp_path / "l.lock"
    a = scheduler(registry, slow, tmp_path, lock=JobLock(path))
    b = scheduler(registry, distill, tmp_path, lock=JobLock(path))
    results = {}
    t = threading.Thread(target=lambda: results.setdefault("a", a.run_job()))
    t.start()
    assert started.wait(60)
    skipped = b.run_job()
    assert skipped.status == "skipped" and f"'pid': {os.getpid()}" in skipped.message
    # another process is refused too
    probe = subprocess.run([sys.executable, "-c", f"from deploy.scheduler import JobLock; "
                            f"print(JobLock({str(path)!r}).acquire())"], cwd=ROOT, capture_output=True, text=True,
                           timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert probe.stdout.strip() == "False", probe.stderr
    release.set()
    t.join(60)
    assert results["a"].status == "promoted" and len(calls) == 1
    assert b.run_job().status == "promoted" and len(calls) == 2


def test_killed_job_releases_the_lock_and_changes_nothing(registry, tmp_path):
    lock_path = tmp_path / "l.lock"
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from deploy.registry import Registry
        from deploy.scheduler import DistillScheduler, JobLock
        reg = Registry("tiny-target", tracking_uri={registry.tracking_uri!r}, cache_root={str(registry.cache_root)!r})
        def distill(req):
            Path({str(tmp_path / 'started')!r}).write_text("x")
            time.sleep(120)
        DistillScheduler(reg, distill, smoke_check=None, lock=JobLock({str(lock_path)!r})).run_job()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 90
        while not (tmp_path / "started").exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.time() < deadline, "job never started"
            time.sleep(0.1)
        assert JobLock(lock_path).holder()["pid"] == proc.pid
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert JobLock(lock_path).holder() is None
    assert registry.aliases() == {CHAMPION: "1"} and [v.version for v in registry.versions()] == ["1"]
    distill, _ = candidate_maker(tmp_path)
    out = scheduler(registry, distill, tmp_path, lock=JobLock(lock_path)).run_job()
    assert out.status == "promoted"


class FakeRegistry:
    """Only what `due()` reads: the data window of the newest candidate (pure trigger logic)."""

    def __init__(self):
        self.window = None
        self.target = "t"

    def last_data_window(self):
        return self.window

    def promotions_paused(self):
        return None

    def alias(self, name):          # no candidate waiting for evidence
        return None


def test_triggers():
    clock = [0.0]
    pending_calls = []

    def pending(since):
        pending_calls.append(since)
        return pending.n

    pending.n = 0
    reg = FakeRegistry()

    def sched(**kw):
        return DistillScheduler(reg, lambda r: None, smoke_check=None, schedule=ScheduleConfig(**kw),
                                pending_records=pending, clock=lambda: clock[0], lock=JobLock("/nonexistent/x"))

    every = sched(every_s=600)
    assert every.due()[0] is False
    clock[0] = 599.0
    assert every.due()[0] is False
    clock[0] = 600.0
    assert every.due() == (True, "interval elapsed")

    clock[0] = 0.0
    by_count = sched(min_records=100)
    pending.n = 99
    assert by_count.due() == (False, "99 new records, waiting for 100")
    pending.n = 100
    reg.window = {"last_id": "17-3"}
    assert by_count.due()[0] is True and pending_calls[-1] == "17-3"

    both = sched(every_s=60, min_records=10)
    pending.n = 50
    assert both.due()[0] is False                 # enough records, interval not elapsed
    clock[0] = 61.0
    pending.n = 5
    assert both.due()[0] is False                 # interval elapsed, too few records
    pending.n = 10
    assert both.due()[0] is True


def test_run_forever_runs_when_due(registry, tmp_path):
    distill, calls = candidate_maker(tmp_path)
    counts = iter([0, 3, 7, 7, 7])
    sched = scheduler(registry, distill, tmp_path, schedule=ScheduleConfig(min_records=5, poll_s=0.01),
                      pending_records=lambda since: next(counts))
    outs = sched.run_forever(max_jobs=2)
    assert [o.status for o in outs] == ["promoted", "promoted"] and len(calls) == 2
    assert list(counts) == [7]                     # four checks: 0, 3 (wait), 7 (job), 7 (job), then stop


def test_a_job_share_rests_the_schedule_after_each_job_for_its_length(registry, tmp_path):
    """`distill --job-share 0.5`: a job (with its gate) that took 100 s is followed by 100 s with no job, although
    enough records are pending (and drift, which could bring a job forward, is not asked); then one runs."""
    made, calls = candidate_maker(tmp_path)
    clock = [0.0]

    def distill(req):
        clock[0] += 100.0                                          # the job's length on the scheduler's clock
        return made(req)

    sched = scheduler(registry, distill, tmp_path, clock=lambda: clock[0], pending_records=lambda since: 50,
                      schedule=ScheduleConfig(min_records=5, poll_s=0.01, job_share=0.5))
    assert sched.due()[0] is True and sched.run_job().status == "promoted"
    clock[0] += 99.0
    ok, why = sched.due()
    assert ok is False and why.startswith("resting 1 s more") and "at most 50% of the time (--job-share)" in why
    clock[0] += 1.0
    assert sched.due() == (True, "50 new records >= 5") and sched.run_job().status == "promoted"
    assert len(calls) == 2
    with pytest.raises(ValueError, match="--job-share must be a fraction in"):
        ScheduleConfig(min_records=5, job_share=0)
    unlimited = scheduler(registry, distill, tmp_path, clock=lambda: clock[0], pending_records=lambda since: 50,
                          schedule=ScheduleConfig(min_records=5, poll_s=0.01))
    assert unlimited.run_job().status == "promoted" and unlimited.due()[0] is True     # share 1: no rest


def test_rollback_pauses_scheduled_promotion_until_resumed(registry, tmp_path):
    distill, calls = candidate_maker(tmp_path)
    sched = scheduler(registry, distill, tmp_path, schedule=ScheduleConfig(min_records=5, poll_s=0.01),
                      pending_records=lambda since: 50)
    assert sched.run_forever(max_jobs=1)[0].status == "promoted" and registry.champion() == "2"
    move = registry.rollback(reason="bad live acceptance")
    assert move.changed and registry.champion() == "1" and "paused" in move.message
    paused = registry.promotions_paused()
    assert paused is not None and "bad live acceptance" in paused["reason"]
    ok, why = sched.due()
    assert ok is False and "paused" in why and "draftsmith resume" in why
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    assert sched.run_forever(stop) == [] and len(calls) == 1       # no job while paused, records stay pending
    assert registry.champion() == "1"
    assert registry.resume_promotions() is True and registry.promotions_paused() is None
    assert registry.resume_promotions() is False                   # idempotent
    assert sched.due()[0] is True
    assert sched.run_forever(max_jobs=1)[0].status == "promoted" and registry.champion() == "3"
    # an operator can roll back without pausing
    assert registry.rollback(pause=False).changed and registry.promotions_paused() is None
    actions = [h["action"] for h in registry.history()]
    assert actions.count("pause") == 1 and actions.count("resume") == 1


def test_schedule_and_duration_validation():
    assert parse_duration("10m") == 600 and parse_duration("90") == 90 and parse_duration("1.5h") == 5400
    for bad in ("ten minutes", "0", "-5m", ""):
        with pytest.raises(ValueError, match="duration"):
            parse_duration(bad)
    with pytest.raises(ValueError, match="--every and/or --min-records"):
        ScheduleConfig()
    with pytest.raises(ValueError, match="--min-records"):
        ScheduleConfig(min_records=0)
    with pytest.raises(ValueError, match="pending_records"):
        DistillScheduler(FakeRegistry(), lambda r: None, smoke_check=None, schedule=ScheduleConfig(min_records=3))


def test_lock_file_content(tmp_path):
    lock = JobLock(tmp_path / "x.lock")
    assert lock.holder() is None and lock.acquire()
    assert json.loads((tmp_path / "x.lock").read_text())["pid"] == os.getpid()
    assert JobLock(tmp_path / "x.lock").acquire() is False
    lock.release()
    assert JobLock(tmp_path / "x.lock").holder() is None


# ----------------------------------------------------------------------------- issue 17: acks after registration
@pytest.fixture(scope="module")
def buffer(tmp_path_factory, redis_url):
    """12 training requests and 4 held-out ones really served into real Redis (unique prefix)."""
    import uuid

    from tests.deploy_helpers import drop_prefix, serve_records
    from tests.tiny_models import save_pair

    root = tmp_path_factory.mktemp("sched-buffer")
    target, draft = save_pair(root)
    prefix = f"test:sched:{uuid.uuid4().hex[:10]}"
    serve_records(target, draft, redis_url, prefix, requests=12, heldout=False, tag="train")
    serve_records(target, draft, redis_url, prefix, requests=4, heldout=True, tag="held")
    yield {"url": redis_url, "prefix": prefix}
    drop_prefix(redis_url, prefix)


def _pending(url, key, group):
    from buffer.redis_store import connect

    c = connect(url)
    try:
        rows = c.xpending_range(key, group, min="-", max="+", count=100_000)
    finally:
        c.close()
    return {r["message_id"].decode() if isinstance(r["message_id"], bytes) else r["message_id"] for r in rows}


def _training_ids(url, prefix):
    from buffer.redis_store import BufferConfig, ReplayBufferReader
    from training.data import is_heldout

    reader = ReplayBufferReader(url, BufferConfig(prefix=prefix))
    return {e.stream_id for e in reader.newest(100_000) if not is_heldout(e.record.request_id, 0.25)}


def test_records_are_acked_only_once_the_candidate_is_registered(registry, tmp_path, buffer, monkeypatch):
    """The real job (training.job.run_distillation, `ack: registered` as `draftsmith distill` configures it)
    trains on real records; registration fails: every record it trained on is still pending in the
    consumer group and the cursor did not move. The next job re-claims them, its candidate is registered,
    and only then are they acked: none lost, none left pending."""
    import uuid

    from deploy import cli
    from training.job import run_distillation

    key = f"{buffer['prefix']}:steps"
    group = f"g-{uuid.uuid4().hex[:8]}"
    overrides = {"redis_url": buffer["url"], "buffer_prefix": buffer["prefix"], "group": group,
                 "heldout_fraction": 0.25, "claim_idle_ms": 0, "steps": 4, "batch_tokens": 1024, "min_records": 8,
                 "mlflow": False, "lr": 1e-2}
    jobs = []

    def distill(req):
        cfg = cli.job_config(req, "tiny-target", {**overrides, "out_dir": str(tmp_path / f"cand{len(jobs)}")})
        jobs.append(cfg)
        return run_distillation(cfg, progress=lambda m: None)

    sched = scheduler(registry, distill, tmp_path, ack_records=cli._ack_records(overrides))
    real_register = registry.register_candidate
    with monkeypatch.context() as mp:
        def broken(*a, **k):
            raise RuntimeError("MLflow went away during registration")
        mp.setattr(registry, "register_candidate", broken)
        out = sched.run_job()
    assert out.status == "failed" and "records left pending" in out.message and jobs[0]["ack"] == "registered"
    trained = _training_ids(buffer["url"], buffer["prefix"])
    assert len(trained) > 50 and _pending(buffer["url"], key, group) == trained     # every one still pending
    assert sched.cursor() is None and registry.aliases() == {CHAMPION: "1"}
    assert json.loads((tmp_path / "cand0" / "records.json").read_text())["ids"]     # never acked

    assert registry.register_candidate == real_register
    out = sched.run_job()
    assert out.status == "promoted" and f"{len(trained)} records acked" in out.message, out.message
    assert _pending(buffer["url"], key, group) == set()
    window = registry.last_data_window()
    assert window["steps"] == len(trained) and sched.cursor() == max(trained, key=lambda s: tuple(map(int, s.split("-"))))
    assert (tmp_path / "cand1" / "records.acked.json").is_file() and not (tmp_path / "cand1" / "records.json").exists()


def test_a_gate_that_could_not_finish_runs_again_on_a_later_tick(registry, tmp_path):
    """Redis (or MLflow) fails mid-gate: the job fails with the candidate registered (its records acked)
    and no verdict; the next tick gates it again and promotes it. Candidates an operator registered by
    hand are left alone."""
    from buffer.redis_store import BufferUnavailable

    good = synthetic_evidence(0.1)
    state = {"fail": True}

    def flaky(champ, cand):
        if state.pop("fail", False):
            raise BufferUnavailable("Redis unreachable: connection refused")
        return good(champ, cand)

    distill, _ = candidate_maker(tmp_path)
    sched = scheduler(registry, distill, tmp_path, evidence=flaky, schedule=ScheduleConfig(min_records=5, poll_s=0.01),
                      pending_records=lambda since: 0)
    out = sched.run_job()
    assert out.status == "failed" and "the gate runs again on a later tick" in out.message and out.version == "2"
    info = registry.get("2")
    assert "draftsmith.gate.verdict" not in info.tags and info.tags["draftsmith.gate_pending"] == "scheduler"
    assert registry.aliases() == {CHAMPION: "1", CANDIDATE: "2"}
    assert sched.tick() is None                                   # no job due: the pending gate ran
    assert registry.champion() == "2" and read_status(sched.status_path)["status"] == "promoted"
    assert sched.gate_pending() is None                           # nothing pending any more

    manual = registry.register_candidate(make_candidate(tmp_path / "by-hand", tmp_path / "base", seed=9))
    assert sched.gate_pending() is None and registry.get(manual).tags.get("draftsmith.gate.verdict") is None


def test_a_candidate_short_of_held_out_evidence_waits_for_it_instead_of_being_discarded(registry, tmp_path):
    """Early in new traffic the gate's held-out sample is below its minimum: the candidate is not worse,
    only unjudged. It stays the candidate, no new job starts (one would train from the champion again on
    newer records only), every tick gates it again, and it is promoted once the sample is large enough;
    past `evidence_wait_s` it stays rejected and jobs resume."""
    small, large = synthetic_evidence(0.1, n=5), synthetic_evidence(0.1, n=40)
    state = {"evidence": small, "pending": 100}
    distill, calls = candidate_maker(tmp_path)
    sched = scheduler(registry, distill, tmp_path, evidence=lambda a, b: state["evidence"](a, b),
                      schedule=ScheduleConfig(min_records=5, poll_s=0.01), pending_records=lambda since: state["pending"])
    out = sched.run_job()
    assert out.status == "held" and "waits for held-out evidence" in out.message and "5 requests" in out.message
    info = registry.get("2")
    assert info.tags["draftsmith.gate.verdict"] == "rejected" and info.tags["draftsmith.gate.insufficient"] == "1"
    assert registry.champion() == "1" and sched.waiting_candidate() == "2"
    ok, why = sched.due()
    assert not ok and "waits for held-out evidence" in why
    assert sched.tick() is None and len(calls) == 1          # gated again (still too small), no new job
    assert registry.champion() == "1"
    state["evidence"], state["pending"] = large, 0
    assert sched.tick() is None                               # the pending gate promotes it; no job ran
    assert registry.champion() == "2" and len(calls) == 1 and sched.waiting_candidate() is None
    assert registry.get("2").tags["draftsmith.gate.insufficient"] == "0"

    # a worse candidate is rejected for good (not "insufficient"), and one waiting too long stops waiting
    state["evidence"] = synthetic_evidence(-0.1, n=40)
    assert sched.run_job().status == "rejected" and sched.waiting_candidate() is None
    state["evidence"], state["pending"] = small, 100
    sched.evidence_wait_s = 0.0
    out = sched.run_job()
    assert out.status == "held" and sched.waiting_candidate() is None and sched.due()[0]


def test_a_waiting_candidate_is_gated_again_only_when_the_held_out_sample_changed(registry, tmp_path):
    """Re-gating scores both drafts; on the same sample it would give the same verdict. With an evidence
    source that can fingerprint its sample (`sample_key`), a tick re-gates only once the key changed."""
    small, large = synthetic_evidence(0.1, n=5), synthetic_evidence(0.1, n=40)
    state = {"evidence": small, "key": (50, "1-0"), "collected": 0, "pending": 100, "cuts": []}

    class Source:
        def sample_key(self, fresh_after=None):
            state["cuts"].append(fresh_after)
            return state["key"]

        def collect(self, a, b):
            state["collected"] += 1
            return state["evidence"](a, b)

    distill, calls = candidate_maker(tmp_path)
    sched = scheduler(registry, distill, tmp_path, evidence=Source(),
                      schedule=ScheduleConfig(min_records=5, poll_s=0.01),
                      pending_records=lambda since: state["pending"])
    assert sched.run_job().status == "held" and state["collected"] == 1
    assert sched.tick() is None and state["collected"] == 2      # first look at this sample: gated again
    assert sched.tick() is None and sched.tick() is None and state["collected"] == 2   # same sample: not scored
    assert sched.waiting_candidate() == "2" and len(calls) == 1
    state["key"] = (19, "1-5")       # changed, but below the gate's 20 requests (e.g. older ones trimmed away)
    assert sched.tick() is None and state["collected"] == 2
    assert set(state["cuts"]) == {None}                 # the stand-in candidates keep no sequence cut
    state["key"], state["evidence"], state["pending"] = (60, "2-0"), large, 0    # a held-out request finished
    assert sched.tick() is None and state["collected"] == 3
    assert registry.champion() == "2"


def test_an_accepted_candidate_held_by_a_pause_is_promoted_after_resume(registry, tmp_path):
    distill, _ = candidate_maker(tmp_path)
    sched = scheduler(registry, distill, tmp_path)
    registry.pause_promotions("operator: hold everything")
    out = sched.run_job()                                          # `distill` once: runs, but cannot promote
    assert out.status == "held" and "paused" in out.message and registry.champion() == "1"
    assert sched.gate_pending() is None                            # still paused: nothing happens
    registry.resume_promotions()
    assert sched.gate_pending().status == "promoted" and registry.champion() == "2"


# ----------------------------------------------------------------------------- issue 17: the watchdog
def log_live(registry, version, rates, start, *, drafted=1000, every_s=15.0):
    """Log one live interval per rate for `version` through the real LiveStatsLogger (as the MetricsHub
    does), with timestamps start, start + every_s, ..."""
    from deploy.live_stats import LiveStatsLogger

    clock = [start]
    live = LiveStatsLogger(registry=registry, interval_s=60, clock=lambda: clock[0])
    for rate in rates:
        live.observe({"draft_version": version, "draft_tokens": drafted, "accepted_tokens": round(rate * drafted),
                      "steps": drafted // 4, "tokens": drafted, "wall_time_s": 10.0, "energy_j": None})
        live.flush()
        clock[0] += every_s


def test_watchdog_rolls_back_a_champion_that_falls_below_its_gate_figure(registry, tmp_path):
    from deploy.scheduler import LiveWatchdog, WatchdogPolicy, read_watchdog_status

    distill, _ = candidate_maker(tmp_path)
    sched = scheduler(registry, distill, tmp_path, schedule=ScheduleConfig(min_records=5, poll_s=0.01),
                      pending_records=lambda since: 0,
                      watchdog=LiveWatchdog(registry, WatchdogPolicy(min_draft_tokens=2000, min_intervals=3,
                                                                     window_s=60),
                                            status_path=tmp_path / "dog.json", progress=lambda m: None))
    assert sched.run_job().status == "promoted" and registry.champion() == "2"
    gate_figure = registry.get("2").metrics["gate_expected_rate"]
    assert 0.4 < gate_figure < 0.7                                     # what the gate expects live
    now = time.time()
    log_live(registry, "2", [0.55, 0.57], now + 1)                     # healthy, but too little evidence yet
    assert sched.watchdog.check().action == "waiting"
    log_live(registry, "2", [0.56, 0.54], now + 40)
    v = sched.watchdog.check()
    assert v.action == "ok" and v.live == pytest.approx(0.555, abs=0.01) and v.gate_figure == gate_figure

    # the draft breaks after loading: live acceptance collapses; one scheduler tick rolls it back
    log_live(registry, "2", [0.12, 0.10, 0.11, 0.09], now + 100)
    assert sched.tick() is None
    assert registry.aliases() == {CHAMPION: "1"} and registry.promotions_paused() is not None
    info = registry.get("2")
    assert info.tags["draftsmith.auto_rollback"] == "1"
    assert "significantly below its gate figure" in info.tags["draftsmith.rollback_reason"]
    details = json.loads(info.tags["draftsmith.rollback_details"])
    assert details["gate_figure"] == pytest.approx(gate_figure) and details["drafted_tokens"] == 4000   # the newest 60 s only
    last = [h for h in registry.history() if h["action"] == "rollback"][-1]
    assert last["from"] == "2" and last["to"] == "1" and "watchdog" in last["reason"]
    dog = read_watchdog_status(tmp_path / "dog.json")
    assert dog["action"] == "rolled back" and dog["rolled_back_to"] == "1"
    # the restored champion is judged on its own live figures from now on: none yet
    assert sched.watchdog.check().action == "waiting" and registry.champion() == "1"


def test_watchdog_checks_offline_before_rolling_back_so_a_traffic_shift_is_not_a_rollback(registry, tmp_path):
    """Live acceptance falls because the traffic changed (found by scripts/bench_online.py: the first
    promoted draft was rolled back at the traffic shift, which paused learning from the new traffic).
    Before rolling back, the watchdog scores champion and previous version on the newest held-out
    records: not worse there -> the traffic's doing, no rollback (an event says so, and the finding
    stands for `recheck_s`); significantly worse -> rolled back, the offline figures in the reason."""
    from deploy.scheduler import LiveWatchdog, WatchdogPolicy

    state = {"evidence": synthetic_evidence(0.0, n=40)}
    distill, _ = candidate_maker(tmp_path)
    dog = LiveWatchdog(registry, WatchdogPolicy(min_draft_tokens=2000, min_intervals=3, window_s=60),
                       status_path=tmp_path / "dog.json", progress=lambda m: None,
                       evidence=lambda prev, champ: state["evidence"](prev, champ), recheck_s=0.0)
    sched = scheduler(registry, distill, tmp_path, schedule=ScheduleConfig(min_records=5, poll_s=0.01),
                      pending_records=lambda since: 0, watchdog=dog)
    assert sched.run_job().status == "promoted" and registry.champion() == "2"
    now = time.time()
    log_live(registry, "2", [0.12, 0.10, 0.11, 0.09], now + 1)       # far below its gate figure
    v = dog.check()
    assert v.action == "ok" and "the traffic changed, not the draft" in v.message, v.message
    assert registry.champion() == "2" and registry.promotions_paused() is None
    assert any(h["action"] == "watchdog" and "traffic changed" in h["reason"] for h in registry.history())

    state["evidence"] = synthetic_evidence(-0.2, n=40)                # now it IS worse than version 1
    v = dog.check()
    assert v.action == "rolled back" and registry.champion() == "1"
    reason = registry.get("2").tags["draftsmith.rollback_reason"]
    assert "significantly below its gate figure" in reason and "scores" in reason and "offline" in reason

    # too small a sample to tell: the live evidence alone decides (as without the check)
    assert dog._offline_check("1", "2")[0] == "worse"
    state["evidence"] = synthetic_evidence(0.0, n=5)
    assert dog._offline_check("1", "2")[0] == "unknown"


def test_watchdog_compares_with_the_previous_versions_live_acceptance(registry, tmp_path):
    from deploy.gate import force_promote
    from deploy.scheduler import LiveWatchdog, WatchdogPolicy

    dog = LiveWatchdog(registry, WatchdogPolicy(min_draft_tokens=2000, min_intervals=3, window_s=60),
                       status_path=tmp_path / "dog.json", progress=lambda m: None)
    now = time.time()
    log_live(registry, "1", [0.70, 0.72, 0.69, 0.71], now - 100)      # version 1 while it was champion
    registry.register_candidate(make_candidate(tmp_path / "c", tmp_path / "base"))
    force_promote(registry, "2")                                       # no gate figure: only "previous" applies
    # version 2's intervals start after its promotion (registering and promoting took > 1 s in a loaded CI run,
    # and intervals stamped before the promotion are not the champion's)
    promoted = time.time()
    log_live(registry, "2", [0.66, 0.70, 0.68], promoted + 1)          # within the 10% tolerance: fine
    assert dog.check().action == "ok"
    log_live(registry, "2", [0.35, 0.33, 0.36, 0.34], promoted + 50)
    v = dog.check()
    assert v.action == "rolled back" and v.previous_version == "1" and v.previous_live == pytest.approx(0.705, abs=0.01)
    assert registry.champion() == "1"
    assert "below version 1's 0.705" in registry.get("2").tags["draftsmith.rollback_reason"]


def test_watchdog_keeps_a_champion_below_its_gate_figure_that_beats_the_previous_version_live(registry, tmp_path):
    """The forty-first session's online run: the gate predicted 0.631 live for version 2 of the draft (version 1's
    live rate scaled by the gate's expected rates); the adaptive controller drafted longer chains with it, and it
    ran at 0.449 live against version 1's 0.420, and the watchdog rolled it back on the prediction. The gate
    figure now decides only where the previous version's live figure cannot."""
    from deploy.gate import force_promote
    from deploy.scheduler import LiveWatchdog, WatchdogPolicy

    dog = LiveWatchdog(registry, WatchdogPolicy(min_draft_tokens=2000, min_intervals=3, window_s=60),
                       status_path=tmp_path / "dog.json", progress=lambda m: None)
    now = time.time()
    log_live(registry, "1", [0.42, 0.41, 0.43, 0.42], now - 100)      # version 1 while it was champion
    registry.register_candidate(make_candidate(tmp_path / "c", tmp_path / "base"))
    force_promote(registry, "2")
    registry.log_version_metrics("2", {"gate_predicted_live_acceptance": 0.631})
    promoted = time.time()
    log_live(registry, "2", [0.45, 0.44, 0.46, 0.45], promoted + 1)   # far below 0.631, above version 1
    v = dog.check()
    assert v.action == "ok" and v.gate_figure == pytest.approx(0.631) and v.previous_live == pytest.approx(0.42, abs=0.01)
    assert registry.champion() == "2"
    log_live(registry, "2", [0.30, 0.29, 0.31, 0.30], promoted + 70)  # now worse than version 1 too: rolled back
    v = dog.check()
    assert v.action == "rolled back" and registry.champion() == "1"
    reason = registry.get("2").tags["draftsmith.rollback_reason"]
    assert "below version 1's" in reason and "gate figure" not in reason


def test_watchdog_with_nothing_to_roll_back_to_records_the_finding(registry, tmp_path):
    from deploy.scheduler import LiveWatchdog, WatchdogPolicy

    registry.log_version_metrics("1", {"gate_expected_rate": 0.6})
    dog = LiveWatchdog(registry, WatchdogPolicy(min_draft_tokens=100, min_intervals=2),
                       status_path=tmp_path / "dog.json", progress=lambda m: None)
    assert dog.check().action == "waiting"
    log_live(registry, "1", [0.1, 0.12, 0.11], time.time() + 1)
    v = dog.check()
    assert v.action == "degraded" and "no previous version to roll back to" in v.message
    assert registry.champion() == "1" and "gate figure 0.600" in registry.get("1").tags["draftsmith.watchdog"]
    assert dog.check().action == "degraded"                            # recorded once, not per tick
    assert sum(h["action"] == "watchdog" for h in registry.history()) == 1


# ----------------------------------------------------------------------------- issue 15: the drift trigger
def test_drift_brings_a_job_forward_when_live_acceptance_falls_below_its_earlier_figure(registry, tmp_path):
    """With --every and --drift, a job starts before its interval ends once the champion's live acceptance
    over the newest window is significantly below its earlier figure (real MLflow live intervals); not
    before the evidence minimum, not within min_gap_s of the last job, not without min_records."""
    from deploy.scheduler import DriftPolicy

    clock = [0.0]
    pending = [50]
    distill, calls = candidate_maker(tmp_path)
    drift = DriftPolicy(window_s=60, tolerance=0.05, min_draft_tokens=1500, min_intervals=2, min_gap_s=30)
    sched = scheduler(registry, distill, tmp_path, clock=lambda: clock[0],
                      schedule=ScheduleConfig(every_s=3600, min_records=10, poll_s=0.01, drift=drift),
                      pending_records=lambda since: pending[0])
    assert sched.run_job().status == "promoted" and registry.champion() == "2"
    fig = registry.get("2").metrics["gate_expected_rate"]
    clock[0] = 100.0
    ok, why = sched.due()
    assert ok is False and why.startswith("next interval in")        # no live evidence yet
    now = time.time()
    log_live(registry, "2", [fig, fig + 0.01, fig - 0.01], now + 1)    # as the gate predicted: no drift
    assert sched.due()[0] is False and sched.drift(100.0) is None
    log_live(registry, "2", [fig - 0.25], now + 200)                   # one low interval: below the minimum
    assert sched.due()[0] is False
    log_live(registry, "2", [fig - 0.25, fig - 0.27, fig - 0.26], now + 215)
    assert sched.drift(10.0) is None                                   # too soon after the last job
    pending[0] = 5
    ok, why = sched.due()
    assert ok is False and "waiting for 10" in why and "drift" in why  # drift seen, records still short
    pending[0] = 50
    ok, why = sched.due()
    # the champion's own first window is the reference now, not the gate's prediction (drift_reference)
    assert ok is True and "drift: version 2's live acceptance" in why and "its own earlier live figure" in why
    out = sched.tick()
    assert out is not None and out.status == "promoted" and len(calls) == 2 and registry.champion() == "3"
    clock[0] = 200.0
    assert sched.drift(100.0) is None and sched.due()[0] is False      # the new champion has no live figure yet


@pytest.mark.parametrize("previous_live, champion_live, expected", [
    (0.42, 0.45, None),                                      # the gate's prediction alone would call it drift
    (0.42, 0.30, "version 1's live figure 0.420 before it was replaced"),
    (None, 0.45, "its gate figure 0.631"),                   # no live reference: the prediction decides
])
def test_drift_holds_a_new_champion_to_its_predecessors_live_figure_before_the_gate_prediction(
        registry, tmp_path, previous_live, champion_live, expected):
    """The forty-first session's draft run: the gate predicted 0.631 live for version 2 (version 1's live rate
    scaled by the gate's expected rates, which assume the records' draft lengths); the controller drafted
    further with it, and it ran at 0.449 against version 1's 0.420. Before the champion has an earlier window
    of its own, drift is judged against the previous version's live figure; the gate figure only without one."""
    from deploy.gate import force_promote
    from deploy.scheduler import DriftPolicy, drift_reason

    pol = DriftPolicy(window_s=60, min_draft_tokens=1500, min_intervals=2, min_gap_s=0)
    now = time.time()
    if previous_live is not None:
        log_live(registry, "1", [previous_live] * 4, now - 100)      # version 1 while it was champion
    registry.register_candidate(make_candidate(tmp_path / "c", tmp_path / "base"))
    force_promote(registry, "2")
    registry.log_version_metrics("2", {"gate_predicted_live_acceptance": 0.631})
    log_live(registry, "2", [champion_live, champion_live - 0.01, champion_live + 0.01], time.time() + 1)
    why = drift_reason(registry, pol, 100.0)
    if expected is None:
        assert why is None
    else:
        assert why is not None and why.startswith("drift: version 2's live acceptance") and expected in why


def test_drift_on_a_version_without_a_gate_figure_compares_with_its_own_earlier_tenure(registry, tmp_path):
    """The bootstrapped version 1 was never gated: its recent window is compared with its own earlier
    live figure, both standard errors counted; without earlier evidence nothing triggers."""
    from deploy.scheduler import DriftPolicy

    distill, calls = candidate_maker(tmp_path)
    sched = scheduler(registry, distill, tmp_path, clock=lambda: 10.0,
                      schedule=ScheduleConfig(every_s=3600, poll_s=0.01,
                                              drift=DriftPolicy(window_s=60, min_draft_tokens=1500, min_gap_s=0)))
    assert registry.get("1").metrics.get("gate_expected_rate") is None
    now = time.time()
    log_live(registry, "1", [0.50, 0.52, 0.49, 0.51], now + 1)          # its tenure so far: all in one window
    assert sched.due()[0] is False                                     # nothing earlier to compare with
    log_live(registry, "1", [0.30, 0.31, 0.29], now + 400)              # the newest window, well below
    ok, why = sched.due()
    assert ok is True and "its own earlier live figure 0.50" in why
    log_live(registry, "1", [0.50, 0.49, 0.51], now + 500)              # recovered in the newest window
    assert sched.due()[0] is False


def test_drift_needs_an_interval_and_valid_settings():
    from deploy.scheduler import DriftPolicy

    with pytest.raises(ValueError, match="needs --every"):
        ScheduleConfig(min_records=5, drift=DriftPolicy())
    for bad in ({"tolerance": 1.0}, {"confidence": 0.3}, {"window_s": 0}, {"min_draft_tokens": 0},
                {"previous_window_s": 0}):
        with pytest.raises(ValueError, match="drift"):
            DriftPolicy(**bad)
