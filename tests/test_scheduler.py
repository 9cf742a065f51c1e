"""deploy/scheduler.py: one job at a time (threads and processes), failed/killed jobs leave the
champion and the record cursor alone, and the interval / min-records triggers."""
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
from deploy.registry import CHAMPION, PREVIOUS, Registry
from deploy.scheduler import DistillScheduler, JobLock, JobRequest, ScheduleConfig, parse_duration, read_status
from deploy_helpers import fresh_store, make_base_draft, make_candidate, template_db

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def template(tmp_path_factory):
    return template_db(tmp_path_factory.mktemp("mlflow-template"))


@pytest.fixture
def registry(template, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    reg = Registry("tiny-target", tracking_uri=fresh_store(template, tmp_path / "data"), cache_root=tmp_path / "cache")
    reg.register_base(make_base_draft(tmp_path / "base"))
    reg.promote("1")
    return reg


def ok_smoke(path):
    return True, "fake: identical"


def candidate_maker(tmp_path, after=0.6):
    """A distill function that trains nothing but writes a valid candidate on the requested parent."""
    calls: list[JobRequest] = []

    def distill(req: JobRequest):
        calls.append(req)
        n = len(calls)
        return make_candidate(tmp_path / f"cand{n}", req.parent_path, parent_version=req.parent_version, seed=n,
                              before=0.4, after=after, last_id=f"1700000000000-{10 * n}")

    return distill, calls


def test_successful_jobs_promote_and_advance_the_cursor(registry, tmp_path):
    distill, calls = candidate_maker(tmp_path)
    sched = DistillScheduler(registry, distill, smoke_check=ok_smoke, lock=JobLock(tmp_path / "l.lock"),
                             progress=lambda m: None)
    out = sched.run_job()
    assert out.status == "promoted" and out.version == "2" and out.parent_version == "1", out.message
    assert calls[0].parent_version == "1" and calls[0].since_id is None
    assert (calls[0].parent_path / "config.json").is_file()
    out2 = sched.run_job()
    assert out2.status == "promoted" and out2.version == "3"
    assert calls[1].parent_version == "2" and calls[1].since_id == "1700000000000-10"   # records after job 1
    assert registry.aliases() == {CHAMPION: "3", PREVIOUS: "2"}
    assert read_status(sched.status_path)["version"] == "3"


def test_rejected_candidate_keeps_champion(registry, tmp_path):
    distill, _ = candidate_maker(tmp_path, after=0.3)
    sched = DistillScheduler(registry, distill, smoke_check=ok_smoke, lock=JobLock(tmp_path / "l.lock"),
                             policy=GatePolicy(margin=0.01), progress=lambda m: None)
    out = sched.run_job()
    assert out.status == "rejected" and out.version == "2" and registry.champion() == "1"
    assert out.verdict["accepted"] is False


def test_failed_job_leaves_champion_records_and_lock(registry, tmp_path):
    def broken(req):
        raise RuntimeError("out of memory")

    lock = JobLock(tmp_path / "l.lock")
    sched = DistillScheduler(registry, broken, smoke_check=ok_smoke, lock=lock, progress=lambda m: None)
    out = sched.run_job()
    assert out.status == "failed" and "out of memory" in out.message and "records left pending" in out.message
    assert registry.aliases() == {CHAMPION: "1"} and [v.version for v in registry.versions()] == ["1"]
    assert sched.cursor() is None and not lock.held and lock.holder() is None
    # a job whose output is not a valid candidate fails the same way
    bad = tmp_path / "not-a-candidate"
    bad.mkdir()
    out = DistillScheduler(registry, lambda r: bad, smoke_check=ok_smoke, lock=lock, progress=lambda m: None).run_job()
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
    a = DistillScheduler(registry, slow, smoke_check=ok_smoke, lock=JobLock(path), progress=lambda m: None)
    b = DistillScheduler(registry, distill, smoke_check=ok_smoke, lock=JobLock(path), progress=lambda m: None)
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
    out = DistillScheduler(registry, distill, smoke_check=ok_smoke, lock=JobLock(lock_path),
                           progress=lambda m: None).run_job()
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
    sched = DistillScheduler(registry, distill, smoke_check=ok_smoke, lock=JobLock(tmp_path / "l.lock"),
                             schedule=ScheduleConfig(min_records=5, poll_s=0.01),
                             pending_records=lambda since: next(counts), progress=lambda m: None)
    outs = sched.run_forever(max_jobs=2)
    assert [o.status for o in outs] == ["promoted", "promoted"] and len(calls) == 2
    assert list(counts) == [7]                     # four checks: 0, 3 (wait), 7 (job), 7 (job), then stop


def test_rollback_pauses_scheduled_promotion_until_resumed(registry, tmp_path):
    distill, calls = candidate_maker(tmp_path)
    sched = DistillScheduler(registry, distill, smoke_check=ok_smoke, lock=JobLock(tmp_path / "l.lock"),
                             schedule=ScheduleConfig(min_records=5, poll_s=0.01),
                             pending_records=lambda since: 50, progress=lambda m: None)
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
