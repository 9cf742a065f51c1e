"""Issue 17, faults and pins, end to end: the replica's draft watcher retries a failed swap with backoff and
refuses a draft built for another target (loudly: log, /health), serving without it; and a real `mlflow
server` stopped in the middle of a hot-swap and in the middle of a scheduled job: serving continues over
real HTTP, no replay-buffer record is lost (real Redis), and promotion resumes once MLflow is back."""
from __future__ import annotations

import logging
import shutil
import threading
import time
import uuid

import httpx
import pytest

from deploy.registry import Registry, target_fingerprint
from tests.deploy_helpers import (MlflowServer, artifact_dir, drop_prefix, fresh_store, lora_model, make_base_draft,
                            make_degraded_draft, template_db)
from tests.tiny_models import save_pair


@pytest.fixture(scope="session")
def template(tmp_path_factory):
    return template_db(tmp_path_factory.mktemp("mlflow-template"))


@pytest.fixture
def pair(tmp_path):
    target, draft = save_pair(tmp_path / "pair")
    return target, draft, target_fingerprint(target)


def wait_for(cond, timeout_s: float, what: str, step_s: float = 0.1):
    deadline = time.time() + timeout_s
    while not cond():
        assert time.time() < deadline, f"timed out after {timeout_s:g} s waiting for {what}"
        time.sleep(step_s)


def complete(url: str, n: int = 1, mode: str = "speculative") -> list[dict]:
    out = []
    for i in range(n):
        spec = {"mode": mode} if mode == "target" else {"mode": mode, "gamma": 4, "adaptive": False}
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": f"request {i} {uuid.uuid4().hex[:6]}: count to {i + 3}", "max_tokens": 12,
            "temperature": 0.0 if i % 2 else 1.0, "seed": i, "speculative": spec})
        assert r.status_code == 200, r.text
        out.append(r.json())
    return out


def served_version(body: dict) -> str:
    return body["metrics"]["speculative_decoding"]["draft_version"]


# ----------------------------------------------------------------------------- the watcher (SQLite store)
def test_a_failed_swap_is_retried_with_backoff_until_it_loads(template, tmp_path, monkeypatch, pair):
    """The champion's artifact folder is missing for a few seconds (an artifact store hiccup): the swap
    fails, the replica keeps serving target-only and retries with backoff (not on every 0.2 s poll),
    and loads the version by itself once the artifacts are back, without the alias moving."""
    from tests.api_helpers import tiny_service

    target, _, sha = pair
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = fresh_store(template, tmp_path / "data")
    reg = Registry(str(target), tracking_uri=uri, cache_root=tmp_path / "cache")
    reg.register_base(make_base_draft(tmp_path / "base"), target_sha256=sha)
    reg.promote("1")
    store = artifact_dir(reg, "1")
    shutil.move(store, tmp_path / "away")
    svc = tiny_service(target, registry=Registry(str(target), tracking_uri=uri, cache_root=tmp_path / "svc-cache"),
                       buffer=False, watch_interval_s=0.2)
    attempts = []
    real = svc.registry.materialize
    monkeypatch.setattr(svc.registry, "materialize", lambda *a, **k: (attempts.append(time.time()), real(*a, **k))[1])
    try:
        wait_for(lambda: svc.swap_error is not None, 30, "the first failed swap")
        assert "draft version 1 failed to load" in svc.swap_error and "retry 1 in 1 s" in svc.swap_error
        assert svc.engine.draft_version == "none"                     # serving target-only meanwhile
        time.sleep(3.5)
        assert 2 <= len(attempts) <= 3, attempts                      # 1 s, then 2 s apart: not every poll
        shutil.move(tmp_path / "away", store)
        # the error clears once the swap has returned, a moment after the engine switched draft
        wait_for(lambda: svc.engine.draft_version == "1" and svc.swap_error is None, 30, "the retried swap")
        snap = svc.telemetry.snapshot()
        assert any("result=\"failed\"" in k for k in str(snap).split(","))
    finally:
        svc.close()


def test_a_replica_refuses_a_draft_built_for_another_target(template, tmp_path, monkeypatch, pair, caplog):
    """Version 1 records another target's fingerprint: the replica does not load it, logs an error, shows it
    in /health, and serves the target alone; a version pinned to this target is loaded when promoted."""
    from tests.api_helpers import LiveServer, tiny_service

    target, _, sha = pair
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = fresh_store(template, tmp_path / "data")
    reg = Registry(str(target), tracking_uri=uri, cache_root=tmp_path / "cache")
    reg.register_base(make_base_draft(tmp_path / "base"), target_sha256="e" * 64)
    reg.promote("1")
    caplog.set_level(logging.ERROR, logger="serving.service")
    svc = tiny_service(target, registry=Registry(str(target), tracking_uri=uri, cache_root=tmp_path / "svc-cache"),
                       buffer=False, watch_interval_s=0.2)
    server = LiveServer(svc).start()
    try:
        wait_for(lambda: svc.swap_error is not None, 30, "the refusal")
        assert svc.swap_error.startswith("REFUSED draft version 1: it was built for another target")
        assert "eeeeeeeeeeee" in svc.swap_error and sha[:12] in svc.swap_error
        assert "serving the target alone (no draft) meanwhile" in svc.swap_error
        assert any("REFUSED draft version 1" in r.getMessage() for r in caplog.records)
        health = httpx.get(server.url + "/health", timeout=10).json()
        assert health["swap_error"].startswith("REFUSED draft version 1") and health["draft_version"] == "none"
        assert all(served_version(b) == "none" for b in complete(server.url, 2, mode="target"))   # still served
        v2 = reg.register_base(make_base_draft(tmp_path / "base2", seed=2), target_sha256=sha)
        reg.promote(v2)
        wait_for(lambda: svc.engine.draft_version == v2, 30, "the pinned version")
        assert svc.swap_error is None and httpx.get(server.url + "/health", timeout=10).json()["swap_error"] is None
    finally:
        server.stop()


# ----------------------------------------------------------------------------- a real MLflow outage
@pytest.mark.slow
def test_mlflow_stopped_during_a_hot_swap_and_during_a_scheduled_job(template, tmp_path, monkeypatch, pair,
                                                                     redis_url):
    """Against a real `mlflow server` (SQLite backend, proxied artifacts) and real Redis:

    1. hot-swap: the champion moves to version 2 and MLflow is stopped the moment the replica starts to
       fetch it. Requests keep being served (HTTP 200) by version 1, /health says why; once MLflow is back
       the replica's retries load version 2 by themselves.
    2. scheduled job: MLflow is stopped after the job trained and before it registers its candidate. The
       job fails, every record it trained on stays pending in the consumer group (nothing acked), the
       scheduler starts nothing while the pause cannot be read, requests keep being served and logged.
       Once MLflow is back the next tick re-claims the records, registers, acks them, the gate promotes
       the candidate (scored on its own held-out sample) and the replica swaps it in. No record is lost:
       the registered candidate's window holds every training record of the stream, none stays pending.

    The job trains for real (training.job.run_distillation, `ack: registered`); its adapter is then
    replaced by the exact repair of the degraded champion, so the gate has a clearly better candidate:
    what is under test is the record flow and fail-closed promotion, not training quality."""
    from tests.api_helpers import LiveServer, tiny_service
    from buffer.redis_store import BufferConfig, ReplayBufferReader, connect
    from deploy import cli
    from deploy.gate import EvidenceSource, GatePolicy, engine_smoke_check
    from deploy.scheduler import DistillScheduler, JobLock, ScheduleConfig
    from training.data import is_heldout, stream_id_key
    from training.job import pending_records, run_distillation

    target, _, sha = pair
    monkeypatch.setenv("DRAFTSMITH_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")      # a dead server fails fast (no 2-minute retries)
    # a stopped server refuses connections at once, so a long timeout costs nothing there; a short one can fail a
    # live but slow server on a loaded CI host (a first tick that failed before its job made the group: NOGROUP)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")
    prefix = f"test:outage:{uuid.uuid4().hex[:10]}"
    mlflow = MlflowServer(tmp_path / "mlflow", template).start()
    svc = http = None
    try:
        reg = Registry(str(target), tracking_uri=mlflow.url, cache_root=tmp_path / "cache")
        reg.register_base(make_degraded_draft(tmp_path / "d5", target, seed=5))
        reg.promote("1")
        svc = tiny_service(target, registry=Registry(str(target), tracking_uri=mlflow.url,
                                                     cache_root=tmp_path / "svc-cache"),
                           buffer_prefix=prefix, watch_interval_s=0.3)
        http = LiveServer(svc).start()
        wait_for(lambda: svc.engine.draft_version == "1", 60, "version 1 on the replica")

        # ---- 1. MLflow stops in the middle of a hot-swap
        real = svc.registry.materialize
        stopped, promoted = [], threading.Event()

        def stop_then_materialize(version, **kw):
            if version == "2" and not stopped:
                assert promoted.wait(60)                  # the operator's promote has finished writing
                mlflow.stop()
                stopped.append(time.time())
            return real(version, **kw)

        monkeypatch.setattr(svc.registry, "materialize", stop_then_materialize)
        assert reg.register_base(make_degraded_draft(tmp_path / "d6", target, seed=6)) == "2"
        reg.promote("2")
        promoted.set()
        wait_for(lambda: bool(stopped) and svc.swap_error is not None, 60, "the swap to fail")
        bodies = complete(http.url, 12)                                   # serving continues during the outage
        assert {served_version(b) for b in bodies} == {"1"}
        health = httpx.get(http.url + "/health", timeout=10).json()
        assert health["status"] == "ok" and health["draft_version"] == "1" and health["swap_error"]
        assert "MLflow unavailable" in svc.swap_error or "failed to load" in svc.swap_error
        mlflow.start()
        t_back = time.time()
        wait_for(lambda: svc.engine.draft_version == "2", 120, "the retried swap after MLflow came back")
        swap_lag = time.time() - t_back
        monkeypatch.setattr(svc.registry, "materialize", real)
        assert {served_version(b) for b in complete(http.url, 12)} == {"2"}

        # ---- 2. MLflow stops in the middle of a scheduled job
        group = f"g-{uuid.uuid4().hex[:8]}"
        overrides = {"redis_url": redis_url, "buffer_prefix": prefix, "group": group, "heldout_fraction": 0.25,
                     "claim_idle_ms": 0, "steps": 4, "batch_tokens": 1024, "min_records": 8, "mlflow": False,
                     "lr": 1e-2}
        jobs = []

        def distill(req):
            cfg = cli.job_config(req, str(target), {**overrides, "out_dir": str(tmp_path / f"cand{len(jobs)}")})
            jobs.append(cfg)
            out = run_distillation(cfg, progress=lambda m: None)
            shutil.rmtree(out / "adapter")
            lora_model(req.parent_path, 6, 0.6, sign=-1).save_pretrained(out / "adapter")   # exact repair of v2
            if len(jobs) == 1:
                mlflow.stop()                                             # before the candidate is registered
            return out

        sched_reg = Registry(str(target), tracking_uri=mlflow.url, cache_root=tmp_path / "sched-cache")
        sched = DistillScheduler(
            sched_reg, distill, smoke_check=engine_smoke_check(str(target), prompts=("hi",), max_tokens=6),
            policy=GatePolicy(min_requests=3, category_min_requests=50), lock=JobLock(tmp_path / "job.lock"),
            schedule=ScheduleConfig(min_records=1, poll_s=0.2),
            pending_records=lambda since: pending_records(since, redis_url=redis_url, buffer_prefix=prefix),
            evidence=EvidenceSource(redis_url=redis_url, buffer_prefix=prefix, heldout_fraction=0.25),
            target_sha256=sha, ack_records=cli._ack_records(overrides), progress=lambda m: None)
        svc.sink.flush()
        out = sched.tick()
        assert out is not None and out.status == "failed" and "could not register candidate" in out.message \
            and "records left pending" in out.message, out
        reader = ReplayBufferReader(redis_url, BufferConfig(prefix=prefix))
        key = reader.config.steps_key

        def training_ids():
            return {e.stream_id for e in reader.newest(100_000) if not is_heldout(e.record.request_id, 0.25)}

        def pending():
            c = connect(redis_url)
            try:
                rows = c.xpending_range(key, group, min="-", max="+", count=100_000)
            finally:
                c.close()
            return {r["message_id"].decode() for r in rows}

        first = training_ids()
        assert len(first) > 30 and pending() == first                   # trained on, nothing acked
        assert sched.tick() is None                                      # MLflow down: the trigger fails closed
        bodies = complete(http.url, 8)                                   # serving continues, records logged
        assert {served_version(b) for b in bodies} == {"2"} and svc.engine.draft_version == "2"
        svc.sink.flush()

        mlflow.start()
        assert sched_reg.champion() == "2" and sched.cursor() is None   # nothing moved while it was down
        out = sched.tick()
        assert out is not None and out.status == "promoted" and out.version == "3", out
        # the repair takes acceptance from ~0.06 to ~0.5 on the held-out sample; how much of that a 5-7 request
        # sample shows varies with which requests landed in it (CI saw +0.457 and +0.218, lower bounds +0.21), so
        # the check is a clear gain whose one-sided lower bound is above zero (the gate's own evidence)
        assert "records acked" in out.message and out.verdict["delta"] > 0.1 and out.verdict["requests"] >= 3
        assert out.verdict["delta_lower"] > 0 and "significant" in out.message
        everything = training_ids()
        assert first < everything and pending() == set()                 # none left pending
        window = sched_reg.last_data_window()
        assert window["steps"] == len(everything)                        # none lost: all trained on
        assert window["last_id"] == max(everything, key=stream_id_key)
        wait_for(lambda: svc.engine.draft_version == "3", 120, "the replica to follow the promotion")
        assert {served_version(b) for b in complete(http.url, 4)} == {"3"}
        print(f"\nswap lag after MLflow came back: {swap_lag:.1f} s")
    finally:
        if http is not None:
            http.stop()
        mlflow.stop()
        drop_prefix(redis_url, prefix)
