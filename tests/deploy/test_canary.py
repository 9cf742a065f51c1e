"""Issue 17, canary then champion: per-request routing of a share of traffic to the canary draft
(deterministic by request id), one batch decoding rows of two drafts losslessly, the canary judge
(promote when live acceptance and tokens/s are not significantly worse than the champion's on the same
window, drop with the reason otherwise, decide on timeout), the scheduler starting a canary after a gate
pass, `draftsmith status` showing it, the replica's watcher loading it; and a real watchdog rolling back a
degraded champion under 4-client load with no failed request (real MLflow store, tiny models)."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from tests import tiny_models
from serving.config import SamplingParams, SpecParams
from serving.controller import CostModel
from serving.engine import Engine, canary_bucket, routes_to_canary

PROMPTS = ["abc abc abd the cat sat on the mat the cat", "hello", "the mat the cat sat on the cat abc abd abc x",
           "q: 1 + 2 = 3; 2 + 3 = 5; 3 + 4 =", "one two three one two three one", "zz"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_models.save_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def near_draft(tmp_path_factory):
    """A draft close to the target with a reduced output vocabulary (its own rows, unlike the champion's)."""
    model = tiny_models.make_model(0, layers=2, sharp=8.0)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.5 * param.std() * torch.randn(param.shape, generator=gen))
    path = tmp_path_factory.mktemp("near") / "draft"
    model.save_pretrained(path)
    tiny_models.make_tokenizer().save_pretrained(path)
    (path / "draftsmith.json").write_text(json.dumps({"output_token_ids": list(range(0, 259, 2)) + [257]}))
    return path


def ids_for(arm_canary: bool, share: float, n: int, tag: str = "r") -> list[str]:
    out, i = [], 0
    while len(out) < n:
        rid = f"{tag}-{i}"
        if routes_to_canary(rid, share) == arm_canary:
            out.append(rid)
        i += 1
    return out


# ----------------------------------------------------------------------------- routing
def test_routing_is_deterministic_by_request_id_and_takes_the_share():
    from training.data import is_heldout

    rids = [f"chatcmpl-{i:05d}" for i in range(20000)]
    for share in (0.1, 0.25, 0.5):
        chosen = [r for r in rids if routes_to_canary(r, share)]
        assert abs(len(chosen) / len(rids) - share) < 0.015
        assert chosen == [r for r in rids if routes_to_canary(r, share)]          # same ids every time
    assert not any(routes_to_canary(r, 0.0) for r in rids[:500])
    assert all(canary_bucket(r) == canary_bucket(r) and 0 <= canary_bucket(r) < 1 for r in rids[:100])
    # a larger share keeps every request of a smaller one (raising the share only adds traffic)
    assert {r for r in rids if routes_to_canary(r, 0.1)} <= {r for r in rids if routes_to_canary(r, 0.25)}
    # independent of the held-out split (which hashes the bare id): the canary sees the same traffic mix
    held = [r for r in rids if is_heldout(r, 0.1)]
    assert abs(sum(routes_to_canary(r, 0.25) for r in held) / len(held) - 0.25) < 0.04


# ----------------------------------------------------------------------------- two drafts in one batch
def test_a_batch_with_rows_on_two_drafts_decodes_losslessly(pair, near_draft):
    """Champion and canary rows share the batch (and its target forward); each drafts with its own draft;
    at T=0 every output equals target-only greedy; steps are credited to the right version; a canary that
    goes away mid-request hands its rows to the champion, still lossless."""
    target, own = pair
    eng = Engine.from_paths(str(target), str(own), dtype=torch.float32, device="cpu", draft_version="1")
    # The adaptive rows must keep drafting after the canary goes away: costs of a real pair (a draft token
    # 0.1 of a step, +3% per verified token), not the tiny models' timings, where a draft forward costs
    # about what a target forward does and the controller (rightly) stops drafting.
    fixed = CostModel(weight=1.0)
    for n in range(1, 18):
        fixed.observe_target(n, 0.03 * (1 + 0.03 * (n - 1)))
    fixed.observe_draft("chain", 1, 0.003)
    fixed.observe_target = fixed.observe_draft = fixed.observe_draft_forward = fixed.observe_overhead = \
        lambda *a, **k: None
    eng.costs = fixed
    eng.set_canary(near_draft, "2", 0.5)
    assert eng.canary.output_token_ids is not None and eng.draft.output_token_ids is None
    sampling = SamplingParams(temperature=0.0, max_tokens=40)
    prompts = [eng.tokenizer(p)["input_ids"] for p in PROMPTS]
    want = [eng.generate_all(p, sampling, SpecParams(mode="target"), log_mode="none").token_ids for p in prompts]
    canary_ids, champion_ids = ids_for(True, 0.5, 3), ids_for(False, 0.5, 3)
    rids = [canary_ids[0], champion_ids[0], canary_ids[1], champion_ids[1], canary_ids[2], champion_ids[2]]
    specs = [SpecParams(mode="speculative", gamma=3, adaptive=i % 2 == 0) for i in range(6)]
    mixed = []

    def watch(sched):
        arms = {eng.draft_for(r)[1] for r in sched.batch if r.spec.needs_draft}
        if arms == {"1", "2"}:
            mixed.append(len(sched.batch))

    def run(drop: bool = False):
        results: list = [None] * 6
        errors: list = []
        start = threading.Barrier(6)

        def one(i):
            try:
                start.wait(10)
                results[i] = eng.generate_all(prompts[i], sampling, specs[i], request_id=rids[i], log_mode="none")
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        if drop:   # once a canary request has drafted with the canary and is still running
            while not any("2" in r.stats.draft_versions for r in list(eng.scheduler.batch)) \
                    and any(t.is_alive() for t in threads):
                time.sleep(0.001)
            eng.set_canary(None)
        for t in threads:
            t.join(120)
        assert not errors, errors
        return results

    eng.scheduler.on_round = watch
    eng.scheduler.rounds = 0
    results = run()
    assert [r.token_ids for r in results] == want
    assert mixed and max(mixed) >= 4, mixed                        # both drafts' rows really shared batches
    for i, r in enumerate(results):
        assert set(r.stats.draft_versions) - {"none"} == ({"2"} if i % 2 == 0 else {"1"}), (i, r.stats.draft_versions)
        assert r.stats.draft_version == ("2" if i % 2 == 0 else "1")
        assert r.stats.draft_tokens > 0
    # the canary goes away mid-request: its rows continue on the champion draft, outputs unchanged
    results = run(drop=True)
    eng.scheduler.on_round = None
    assert [r.token_ids for r in results] == want
    assert eng.canary is None and len(eng.scheduler.dkvs) <= 1
    assert any({"1", "2"} <= set(r.stats.draft_versions) for r in results[::2]), [r.stats.draft_versions for r in results]
    # promotion reuses the loaded canary model (no second load)
    eng.set_canary(near_draft, "2", 0.25)
    canary_model = eng.canary
    eng.swap_draft(near_draft, "2")
    assert eng.draft is canary_model and eng.draft_version == "2"


# ----------------------------------------------------------------------------- registry + judge (real MLflow)
SHA = "5" * 64


@pytest.fixture(scope="session")
def template(tmp_path_factory):
    from tests.deploy_helpers import template_db

    return template_db(tmp_path_factory.mktemp("mlflow-template"))


@pytest.fixture
def store(template, tmp_path, monkeypatch):
    """A fresh MLflow SQLite store under tmp_path/data (DRAFTSMITH_DATA); its tracking URI."""
    from tests.deploy_helpers import fresh_store

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("DRAFTSMITH_DATA", str(tmp_path / "data"))
    return fresh_store(template, tmp_path / "data")


@pytest.fixture
def registry(store, tmp_path):
    """v1 champion (a base), v2 a registered candidate on it."""
    from deploy.registry import Registry
    from tests.deploy_helpers import make_base_draft, make_candidate

    reg = Registry("tiny-target", tracking_uri=store, cache_root=tmp_path / "cache")
    reg.register_base(make_base_draft(tmp_path / "base"), target_sha256=SHA)
    reg.promote("1")
    reg.register_candidate(make_candidate(tmp_path / "c2", tmp_path / "base", target_sha256=SHA))
    return reg


def log_live(registry, version, rates, start, *, drafted=1000, every_s=15.0, tokens_per_s=20.0, requests=5):
    """One live interval per rate for `version`, through the real LiveStatsLogger (as the MetricsHub does)."""
    from deploy.live_stats import LiveStatsLogger

    clock = [start]
    live = LiveStatsLogger(registry=registry, interval_s=60, clock=lambda: clock[0])
    for rate in rates:
        for _ in range(requests):
            n = drafted // requests
            live.observe({"draft_version": version, "draft_tokens": n, "accepted_tokens": round(rate * n),
                          "steps": n // 4, "tokens": n, "wall_time_s": n / tokens_per_s, "energy_j": None})
        live.flush()
        clock[0] += every_s


def judge(registry, tmp_path, **kw):
    from deploy.scheduler import CanaryJudge, CanaryPolicy

    clock = kw.pop("clock", time.time)
    pol = CanaryPolicy(**{"min_draft_tokens": 2000, "min_requests": 10, "min_duration_s": 0, "timeout_s": 3600, **kw})
    return CanaryJudge(registry, pol, status_path=tmp_path / "canary.json", progress=lambda m: None, clock=clock)


def test_a_canary_not_worse_than_the_champion_is_promoted(registry, tmp_path):
    from deploy.registry import CANARY, CHAMPION, PREVIOUS

    move = registry.start_canary("2", 0.25, reason="gate: test")
    assert move.changed and registry.aliases() == {CHAMPION: "1", CANARY: "2"}
    c = registry.canary()
    assert c["version"] == "2" and c["share"] == 0.25 and c["since_ms"] <= time.time() * 1000
    assert registry.get("2").tags["draftsmith.canary_status"] == "running"
    j = judge(registry, tmp_path, min_duration_s=20)
    v = j.check()
    assert v.action == "waiting" and "waiting for evidence" in v.message
    now = time.time()
    log_live(registry, "1", [0.60, 0.62, 0.61], now + 1)
    log_live(registry, "2", [0.63, 0.60, 0.64], now + 1, tokens_per_s=21.0)
    assert j.check().action == "waiting"                        # enough evidence, not enough time yet
    j.clock = lambda: time.time() + 30
    v = j.check()
    assert v.action == "promoted", v.message
    assert registry.aliases() == {CHAMPION: "2", PREVIOUS: "1"} and registry.canary() is None
    info = registry.get("2")
    assert info.tags["draftsmith.canary_status"] == "promoted"
    assert "not significantly worse" in info.tags["draftsmith.canary_decision_reason"]
    assert info.metrics["canary_live_acceptance"] == pytest.approx(0.623, abs=0.005)
    assert info.metrics["canary_champion_live_acceptance"] == pytest.approx(0.61, abs=0.005)
    assert [h["action"] for h in registry.history()][-3:] == ["canary", "promote", "canary promoted"]
    assert json.loads((tmp_path / "canary.json").read_text())["action"] == "promoted"


def test_a_worse_canary_is_dropped_with_the_reason_recorded(registry, tmp_path):
    from deploy.registry import CHAMPION

    registry.start_canary("2", 0.25)
    now = time.time()
    log_live(registry, "1", [0.60, 0.62, 0.61], now + 1)
    log_live(registry, "2", [0.35, 0.30, 0.33], now + 1)
    v = judge(registry, tmp_path, min_duration_s=3600).check()   # dropped without waiting for the minimum time
    assert v.action == "dropped"
    assert registry.aliases() == {CHAMPION: "1"} and registry.canary() is None
    info = registry.get("2")
    assert info.tags["draftsmith.canary_status"] == "dropped"
    assert "significantly below the champion's" in info.tags["draftsmith.canary_decision_reason"]
    details = json.loads(info.tags["draftsmith.canary_details"])
    assert details["live_acceptance"] == pytest.approx(0.327, abs=0.005) and details["champion_version"] == "1"
    last = registry.history()[-1]
    assert last["action"] == "canary dropped" and "significantly below" in last["reason"]
    assert registry.promotions_paused() is None                  # dropping a canary pauses nothing


def test_a_canary_without_evidence_times_out_and_a_slower_one_is_dropped(registry, tmp_path):
    registry.start_canary("2", 0.1)                               # no live figures at all
    assert judge(registry, tmp_path).check().action == "waiting"
    v = judge(registry, tmp_path, clock=lambda: time.time() + 7200).check()
    assert v.action == "dropped" and "no decision on live evidence within 3600 s" in v.message
    assert "canary 2: 0/2000 drafted tokens" in registry.get("2").tags["draftsmith.canary_decision_reason"]

    registry.start_canary("2", 0.25)                              # again: as accepting, but slower
    now = time.time()
    log_live(registry, "1", [0.60, 0.61, 0.60, 0.61], now + 1, tokens_per_s=20.0)
    log_live(registry, "2", [0.60, 0.61, 0.60, 0.61], now + 1, tokens_per_s=12.0)
    v = judge(registry, tmp_path).check()
    assert v.action == "dropped" and "tokens/s is significantly below" in v.message


def test_paused_promotions_hold_a_passing_canary_and_a_new_canary_is_refused(registry, tmp_path):
    from deploy.registry import PromotionsPaused

    registry.start_canary("2", 0.25)
    now = time.time()
    log_live(registry, "1", [0.60, 0.62, 0.61], now + 1)
    log_live(registry, "2", [0.61, 0.62, 0.61], now + 1)
    registry.pause_promotions("operator")
    v = judge(registry, tmp_path).check()
    assert v.action == "held" and registry.canary()["version"] == "2" and registry.champion() == "1"
    with pytest.raises(PromotionsPaused):
        registry.start_canary("2", 0.5)
    registry.resume_promotions()
    assert judge(registry, tmp_path).check().action == "promoted" and registry.champion() == "2"


def test_the_scheduler_starts_a_canary_after_a_gate_pass_and_waits_for_it(registry, tmp_path):
    from deploy.scheduler import DistillScheduler, JobLock, ScheduleConfig
    from tests.deploy_helpers import make_candidate, synthetic_evidence

    def distill(req):
        return make_candidate(tmp_path / "c3", req.parent_path, parent_version=req.parent_version, seed=3,
                              last_id="1700000000000-30", target_sha256=req.target_sha256)

    sched = DistillScheduler(registry, distill, smoke_check=lambda p: (True, "fake"), target_sha256=SHA,
                             lock=JobLock(tmp_path / "l.lock"), progress=lambda m: None,
                             evidence=synthetic_evidence(0.1), canary_share=0.3,
                             schedule=ScheduleConfig(every_s=0.01, poll_s=0.01))
    out = sched.run_job()
    assert out.status == "canary" and "serves as the canary" in out.message
    assert registry.champion() == "1" and registry.canary()["version"] == "3" and registry.canary()["share"] == 0.3
    assert registry.alias("candidate") is None
    time.sleep(0.02)
    ok, why = sched.due()
    assert not ok and "canary version 3 is being judged" in why
    assert sched.canary is not None and sched.tick() is None      # the tick judged it: waiting, no job
    assert registry.canary()["version"] == "3"


def test_a_pipelined_job_trains_from_the_canary_and_waits_for_its_decision(registry, tmp_path):
    """Pipelining (`ScheduleConfig.pipeline`): a job due while canary 2 is judged starts at once from it; the
    scheduler goes on judging the canary while the job runs (it is promoted meanwhile), then registers the
    job's candidate on version 2 and makes it the next canary. A job whose canary is dropped (here after the
    job has finished: the scheduler waits for the decision) is discarded: nothing registered, champion kept."""
    from deploy.scheduler import DistillScheduler, JobLock, ScheduleConfig
    from tests.deploy_helpers import make_candidate, synthetic_evidence

    registry.start_canary("2", 0.3)
    seen, threads, watched = [], [], []

    class Watchdog:                         # counts the checks; the real one: test_scheduler.py
        def check(self):
            watched.append(time.time())

    def distill(req):
        seen.append(req.parent_version)
        k = len(seen)
        now = time.time()
        if k == 1:                          # canary 2 as good as the champion: promoted while the job runs
            log_live(registry, "1", [0.60, 0.62, 0.61], now + 1)
            log_live(registry, "2", [0.63, 0.60, 0.64], now + 1)
            deadline = time.time() + 20
            while (len([t for t in watched if t >= now]) < 2 or registry.canary() is not None) \
                    and time.time() < deadline:
                time.sleep(0.05)
            assert len([t for t in watched if t >= now]) >= 2    # the watchdog runs while the job does
            assert registry.canary() is None and registry.champion() == "2"
        else:                               # canary 3 much worse, decided only after the job returned
            def later():
                time.sleep(0.2)
                log_live(registry, "2", [0.60, 0.62, 0.61], now + 100)
                log_live(registry, "3", [0.30, 0.31, 0.33], now + 100)
            threads.append(threading.Thread(target=later))
            threads[-1].start()
        return make_candidate(registry.candidates_root / f"c{k}", req.parent_path, parent_version=req.parent_version,
                              seed=10 + k,
                              last_id=f"1700000000000-{40 + k}", target_sha256=req.target_sha256)

    sched = DistillScheduler(registry, distill, smoke_check=lambda p: (True, "fake"), target_sha256=SHA,
                             lock=JobLock(tmp_path / "l.lock"), progress=lambda m: None,
                             evidence=synthetic_evidence(0.1), canary_share=0.3, canary=judge(registry, tmp_path),
                             watchdog=Watchdog(),
                             schedule=ScheduleConfig(every_s=0.01, poll_s=0.05, pipeline=True))
    time.sleep(0.02)
    ok, why = sched.due()
    assert ok, why                                                 # a canary no longer blocks the next job
    out = sched.run_job()
    assert seen == ["2"] and out.status == "canary", out.message
    assert registry.champion() == "2" and registry.canary()["version"] == "3"
    assert registry.get("3").parent_version == "2"

    n_versions = len(registry.versions())
    out = sched.run_job()
    for t in threads:
        t.join()
    assert seen == ["2", "3"] and out.status == "discarded", out.message
    assert "canary version 3, which was not promoted (dropped)" in out.message
    assert "is deleted unregistered" in out.message and not (registry.candidates_root / "c2").exists()
    assert (registry.candidates_root / "c1").is_dir()             # the registered one is retention's to judge
    assert registry.champion() == "2" and registry.canary() is None and len(registry.versions()) == n_versions

    plain = DistillScheduler(registry, distill, smoke_check=lambda p: (True, "fake"), target_sha256=SHA,
                             lock=JobLock(tmp_path / "l.lock"), progress=lambda m: None,
                             evidence=synthetic_evidence(0.1), canary_share=0.3, canary=judge(registry, tmp_path),
                             schedule=ScheduleConfig(every_s=0.01, poll_s=0.05))
    registry.start_canary("3", 0.3, reason="again")
    time.sleep(0.02)
    assert plain.due() == (False, "canary version 3 is being judged; the next job waits for its decision")


def test_status_shows_the_canary(registry, tmp_path, monkeypatch, capsys):
    from deploy import cli

    monkeypatch.setenv("MLFLOW_TRACKING_URI", registry.tracking_uri)
    args = ("--target", "tiny-target")
    registry.start_canary("2", 0.25)
    now = time.time()
    log_live(registry, "1", [0.60, 0.62], now + 1)
    log_live(registry, "2", [0.58, 0.61], now + 1)
    assert cli.main(["watch", "--once", "--canary-min-time", "10m", *args]) == 0
    assert cli.main(["status", *args]) == 0
    out = capsys.readouterr().out
    assert "canary:    2" in out and "version 2 on 25% of requests since" in out
    assert "canary live: acceptance 0.595 over 2000 drafted tokens, 10 requests, 20.0 tokens/s; champion 1: 0.610" in out
    assert "canary judge: waiting" in out
    registry.end_canary("2", promote=False, reason="operator says no")
    assert cli.main(["status", *args]) == 0
    out = capsys.readouterr().out
    assert "last canary: version 2 dropped" in out and "operator says no" in out


def test_the_replica_watcher_loads_serves_and_unloads_the_canary(pair, store, tmp_path):
    """A Service over a real engine follows the canary alias: loads it with its share, routes by request id,
    takes it over as champion on promotion (same model object), and unloads a dropped one."""
    from deploy.registry import Registry
    from tests.deploy_helpers import make_target_clone
    from serving.metrics import MetricsHub
    from serving.service import Service, ServiceSettings

    target, own = pair
    reg = Registry(str(target), tracking_uri=store, cache_root=tmp_path / "cache2")
    reg.register_base(own)
    reg.promote("1")
    reg.register_base(make_target_clone(tmp_path / "clone", target))
    eng = Engine.from_paths(str(target), None, dtype=torch.float32, device="cpu")
    svc = Service(ServiceSettings(target=str(target), watch_interval_s=3600, buffer=False), engine=eng,
                  registry=reg, sink=None, hub=MetricsHub(live_stats=False))
    try:
        assert svc.check_champion() == "1" and svc.check_canary() == "none"
        reg.start_canary("2", 0.5)
        assert svc.check_canary() == "2" and eng.canary_share == 0.5
        assert svc.health()[1]["canary"] == {"version": "2", "share": 0.5, "error": None}
        sampling = SamplingParams(temperature=0.0, max_tokens=8)
        prompt = eng.tokenizer("hello there")["input_ids"]
        for rid in ids_for(True, 0.5, 2, "s") + ids_for(False, 0.5, 2, "s"):
            r = eng.generate_all(prompt, sampling, SpecParams(mode="speculative", gamma=3), request_id=rid,
                                 log_mode="none")
            assert r.stats.draft_version == ("2" if routes_to_canary(rid, 0.5) else "1")
        canary_model = eng.canary
        reg.end_canary("2", promote=True, reason="test")
        assert svc.check_champion() == "2" and eng.draft is canary_model
        assert svc.check_canary() == "none" and eng.canary is None
        reg.start_canary("1", 0.2)
        assert svc.check_canary() == "1"
        reg.end_canary("1", promote=False, reason="test")
        assert svc.check_canary() == "none" and eng.canary is None and eng.draft_version == "2"
    finally:
        svc.close()


# ----------------------------------------------------------------------------- the watchdog under load
def test_a_degraded_champion_is_rolled_back_automatically_under_4_client_load(pair, store, tmp_path):
    """A real replica (Service: draft watcher + MetricsHub logging live acceptance per version to MLflow
    every 0.5 s) serves 4 clients with a good champion (v1: the target's own weights); a degraded draft
    (v2: large perturbation) is registered and promoted over it; a real LiveWatchdog with short windows
    rolls it back with the reason recorded, the replica follows, and no request fails."""
    from deploy.live_stats import live_stats_factory
    from deploy.registry import Registry
    from deploy.scheduler import LiveWatchdog, WatchdogPolicy
    from tests.deploy_helpers import make_degraded_draft, make_target_clone
    from serving.metrics import MetricsHub
    from serving.service import Service, ServiceSettings

    target, _ = pair
    reg = Registry(str(target), tracking_uri=store, cache_root=tmp_path / "cache")
    reg.register_base(make_target_clone(tmp_path / "good", target))
    reg.promote("1")
    eng = Engine.from_paths(str(target), None, dtype=torch.float32, device="cpu")
    hub = MetricsHub(live_stats_factory(store, str(target), interval_s=0.5))
    svc = Service(ServiceSettings(target=str(target), watch_interval_s=0.2, buffer=False), engine=eng, registry=reg,
                  sink=None, hub=hub)
    dog = LiveWatchdog(reg, WatchdogPolicy(min_draft_tokens=150, min_intervals=2, window_s=2.0, previous_window_s=60),
                       status_path=tmp_path / "dog.json", progress=lambda m: None)
    stop, failures, served = threading.Event(), [], []
    prompts = [eng.tokenizer(p)["input_ids"] for p in PROMPTS]

    def client(i):
        n = 0
        while not stop.is_set():
            n += 1
            try:
                r = eng.generate_all(prompts[(i + n) % len(prompts)], SamplingParams(temperature=0.0, max_tokens=24),
                                     SpecParams(mode="speculative", gamma=4, adaptive=False), log_mode="none")
                svc.hub.observe(r.stats.to_dict())           # what Service.record does per finished request
                served.append((time.time(), r.stats.draft_version, r.stats.acceptance_rate))
            except Exception as exc:  # noqa: BLE001
                failures.append(exc)

    try:
        assert svc.check_champion() == "1"
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        deadline = time.time() + 20
        while len(reg.live_intervals("1")) < 3 and time.time() < deadline:   # v1's own live record
            time.sleep(0.2)
        reg.register_base(make_degraded_draft(tmp_path / "bad", target, scale=1.5))
        reg.promote("2", reason="degraded on purpose")
        t_degraded = time.time()
        rolled_back = None
        while time.time() < t_degraded + 30 and rolled_back is None:
            if dog.check().action == "rolled back":
                rolled_back = time.time()
            time.sleep(0.2)
        assert rolled_back is not None, dog.check().message
        while eng.draft_version != "1" and time.time() < rolled_back + 10:
            time.sleep(0.1)
        time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        svc.close()
        hub.stop()
    assert not failures, failures[:3]
    assert reg.champion() == "1" and eng.draft_version == "1"
    info = reg.get("2")
    assert info.tags["draftsmith.auto_rollback"] == "1"
    assert "significantly below version 1's" in info.tags["draftsmith.rollback_reason"]
    assert {v for _, v, _ in served} >= {"1", "2"}                  # the degraded draft really served
    assert rolled_back - t_degraded < 30
    print(f"degradation -> rollback {rolled_back - t_degraded:.1f} s; {len(served)} requests, 0 failed")
