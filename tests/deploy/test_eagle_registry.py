"""The EAGLE-style head as registered versions (issue 19, step 3), beside Medusa heads and drafts: its own
registered model in a real MLflow store, hot-swapped into a replica under load and rolled back (a rollback
of one kind never moves another's aliases), an online job trained from real served records in real Redis
and judged by the gate on its own held-out sample, and the CLI for all of it."""
from __future__ import annotations

import time

import pytest
import torch

from deploy.gate import GatePolicy
from deploy.heads import HeadsEvidence, heads_smoke_check, run_heads_cycle, score_eagle
from deploy.registry import CHAMPION, HEADS_KINDS, UsageError, heads_kind_of, heads_registry
from serving.config import SamplingParams, SpecParams
from serving.decoding.eagle import EagleHead
from serving.engine import Engine
from serving.service import Service, ServiceSettings
from tests.deploy.test_heads_registry import make_heads, pair, regs, target_model  # noqa: F401 - fixtures
from tests.deploy_helpers import LoadClients, artifact_dir, drop_prefix, serve_records
from tests.serving.test_eagle import random_head
from tests.serving.test_engine_rules import reference_greedy

PREFIX = "draftsmith:test-eagle"


def make_eagle(target_model, folder, seed: int, scale: float = 0.2):  # noqa: F811
    return random_head(target_model, seed=seed, scale=scale).save(folder, built_by="tests")


@pytest.fixture
def eagle(regs):  # noqa: F811
    drafts = regs[0]
    return heads_registry(drafts.target, "eagle", name=drafts.name, tracking_uri=drafts.tracking_uri,
                          cache_root=drafts._cache_root, candidates_root=drafts.candidates_root)


def test_eagle_versions_live_in_their_own_model_and_a_rollback_moves_one_kind(regs, eagle, target_model,  # noqa: F811
                                                                              tmp_path):
    drafts, medusa = regs
    assert eagle.name == drafts.name + "-eagle" and eagle.heads_kind == "eagle" and medusa.heads_kind == "medusa"
    assert heads_registry(drafts.target, "eagle", name=medusa.name, tracking_uri=drafts.tracking_uri).name == \
        eagle.name                                        # another kind's name maps to this kind's model
    e1 = make_eagle(target_model, tmp_path / "e1", seed=1)
    m1 = make_heads(target_model, tmp_path / "m1", seed=1)
    assert heads_kind_of(e1) == "eagle" and heads_kind_of(m1) == "medusa" and heads_kind_of(tmp_path) is None
    with pytest.raises(UsageError, match="eagle heads registry"):
        medusa.register(e1)
    with pytest.raises(UsageError, match="medusa heads registry"):
        eagle.register(m1)
    with pytest.raises(UsageError, match="eagle heads registry"):
        drafts.register(e1)
    with pytest.raises(UsageError, match="not an EAGLE head folder"):
        eagle.register(tmp_path)
    with pytest.raises(UsageError, match="unknown heads kind"):
        heads_registry(drafts.target, "hydra")
    v1 = eagle.register(e1)
    v2 = eagle.register(make_eagle(target_model, tmp_path / "e2", seed=2))
    info = eagle.get(v2)
    assert info.kind == "heads" and info.tags["draftsmith.heads_kind"] == "eagle"
    assert info.params["hidden_size"] == str(target_model.config.hidden_size)
    folder = eagle.materialize(v2, verify=True)
    assert (folder / HEADS_KINDS["eagle"].files[1]).is_file()
    assert EagleHead.load(folder, target_model).output_token_ids == list(range(259))
    mv = medusa.register(m1)
    medusa.promote(mv)
    eagle.promote(v1)
    eagle.promote(v2)
    move = eagle.rollback(reason="test")
    assert move.changed and eagle.champion() == v1 and move.old_champion == v2
    assert medusa.champion() == mv and medusa.promotions_paused() is None     # the other kinds never move
    assert drafts.champion() is None and eagle.promotions_paused() is not None


def _eagle_ok(engine, prompt, n=12):
    """T=0 eagle output equals target greedy: a swapped-in head serves losslessly."""
    res = engine.generate_all(prompt, SamplingParams(temperature=0.0, max_tokens=n), SpecParams(mode="eagle", gamma=3))
    assert res.token_ids == reference_greedy(engine.target.model, prompt, n)
    return res


def test_replica_hot_swaps_registered_eagle_heads_under_load_rolls_back_and_refuses_a_corrupt_one(
        regs, eagle, pair, target_model, tmp_path):  # noqa: F811
    _, medusa = regs
    v1 = eagle.register(make_eagle(target_model, tmp_path / "e1", seed=1))
    v2 = eagle.register(make_eagle(target_model, tmp_path / "e2", seed=2))
    eagle.promote(v1)
    m1 = medusa.register(make_heads(target_model, tmp_path / "m1", seed=1))
    medusa.promote(m1)
    engine = Engine.from_paths(str(pair[0]), str(pair[1]), dtype=torch.float32, draft_version="d1")
    svc = Service(ServiceSettings(target=str(pair[0]), buffer=False, watch_interval_s=3600), engine=engine,
                  heads_source=medusa, eagle_source=eagle)
    try:
        assert svc.check_heads(kind="eagle") == f"eagle-v{v1}" and engine.eagle_version == f"eagle-v{v1}"
        assert svc.check_heads() == f"medusa-v{m1}"
        prompt = engine.tokenizer("the cat sat on the mat")["input_ids"]
        with LoadClients(lambda: _eagle_ok(engine, prompt)) as load:
            time.sleep(0.5)
            eagle.promote(v2)
            assert svc.check_heads(kind="eagle") == f"eagle-v{v2}"
            time.sleep(0.5)
            answer = svc.rollback(kind="eagle", reason="test")      # POST /v1/admin/rollback {"kind": "eagle"}
            assert answer["changed"] and answer["champion"] == v1 and answer["replica_eagle_head"] == f"eagle-v{v1}"
            time.sleep(0.3)
        assert not load.errors, load.errors
        assert load.results and {r.stats.draft_version for r in load.results} <= {f"eagle-v{v1}", f"eagle-v{v2}"}
        health = svc.health()[1]
        assert health["eagle_head"] == f"eagle-v{v1}" and health["medusa_heads"] == f"medusa-v{m1}"
        assert medusa.champion() == m1                          # the eagle rollback left the heads alone

        # a version whose stored weights were altered after registration is never served
        v3 = eagle.register(make_eagle(target_model, tmp_path / "e3", seed=3))
        with open(artifact_dir(eagle, v3) / "heads" / HEADS_KINDS["eagle"].files[1], "r+b") as f:
            f.seek(200)
            f.write(b"\x00\x01\x02\x03")
        eagle.set_alias(CHAMPION, v3)
        assert svc.check_heads(kind="eagle") == f"eagle-v{v1}"
        assert f"EAGLE head version {v3} not loaded" in svc.eagle_error and "retry 1" in svc.eagle_error
        assert svc.health()[1]["eagle_error"] == svc.eagle_error and svc.heads_error is None
        _eagle_ok(engine, prompt)                               # still serving v1
    finally:
        svc.close()


def test_eagle_job_trains_on_served_records_and_the_gate_judges_it(regs, eagle, pair, target_model, tmp_path,  # noqa: F811
                                                                   redis_url):
    """Real records from real serving in real Redis: the job reads them (read-only), starts from the champion
    head, and its candidate is registered in the eagle model and judged by the gate on its own held-out
    sample, scored by the head's teacher-forced first-token agreement."""
    prefix = f"{PREFIX}:{time.time_ns()}"
    try:
        serve_records(pair[0], pair[1], redis_url, prefix, requests=16, heldout=False, heldout_fraction=0.25,
                      max_tokens=24, tag="train")
        serve_records(pair[0], pair[1], redis_url, prefix, requests=8, heldout=True, heldout_fraction=0.25,
                      max_tokens=24, tag="held")
        v1 = eagle.register(make_eagle(target_model, tmp_path / "e1", seed=1, scale=0.3))
        eagle.promote(v1)
        job = {"redis_url": redis_url, "buffer_prefix": prefix, "heldout_fraction": 0.25, "budget_s": 10.0,
               "lr": 3e-3, "batch_size": 4, "min_train_rows": 32, "min_heldout_rows": 8,
               "out_dir": str(tmp_path / "cand"), "patience": 0}       # train to the budget: it must learn
        evidence = HeadsEvidence(str(pair[0]), redis_url=redis_url, buffer_prefix=prefix, heldout_fraction=0.25,
                                 kind="eagle")
        policy = GatePolicy(min_requests=4, category_min_requests=4, bootstrap=500)
        version, verdict = run_heads_cycle(eagle, str(pair[0]), job, policy=policy, evidence=evidence,
                                           smoke_check=heads_smoke_check(str(pair[0]), prompts=("hi",),
                                                                         max_tokens=6, kind="eagle"))
        info = eagle.get(version)
        assert info.kind == "heads" and info.parent_version == v1 and info.tags["draftsmith.heads_kind"] == "eagle"
        m = info.metrics
        assert m["training_rows"] >= 32 and m["heldout_rows"] >= 8
        assert m["offline_acceptance_after"] > m["offline_acceptance_before"]     # it learnt the target's tokens
        assert 6 <= verdict.requests <= 8 and verdict.champion_version == v1
        assert verdict.candidate_acceptance > verdict.champion_acceptance
        assert verdict.accepted == (eagle.champion() == version)
        assert eagle.get(version).tags["draftsmith.gate.verdict"] in ("accepted", "rejected")
        # the gate's per-request score is the head's own, and the same head scores the same
        from training.heads_job import read_examples

        examples, _ = read_examples(redis_url=redis_url, buffer_prefix=prefix, n=1000, heldout=True,
                                    heldout_fraction=0.25)
        a, feats = score_eagle(target_model, eagle.materialize(version), examples)
        b, _ = score_eagle(target_model, eagle.materialize(version), examples, feats)
        assert a == b and set(a) == {e["request_id"] for e in examples}
        assert all(0.0 <= r["acceptance"] <= 1.0 and r["positions"] >= 1 for r in a.values())
        with pytest.raises(ValueError, match="evidence scores medusa"):
            run_heads_cycle(eagle, str(pair[0]), job, evidence=HeadsEvidence(str(pair[0]), redis_url=redis_url,
                                                                             buffer_prefix=prefix))
    finally:
        drop_prefix(redis_url, prefix)


def test_cli_registers_promotes_and_rolls_back_an_eagle_head(regs, eagle, pair, target_model, tmp_path,  # noqa: F811
                                                            capsys):
    from deploy.cli import main

    drafts, medusa = regs
    base = ["--target", str(pair[0]), "--tracking-uri", eagle.tracking_uri]
    e1, e2 = make_eagle(target_model, tmp_path / "e1", seed=1), make_eagle(target_model, tmp_path / "e2", seed=2)
    assert main(["register", str(e1), *base]) == 0            # the kind is read from the folder's files
    assert main(["register", str(e2), *base]) == 0
    out = capsys.readouterr().out
    assert f"{eagle.name} version 1 (heads" in out and f"{eagle.name} version 2 (heads" in out
    assert main(["promote", "1", "--kind", "eagle", "--force", *base]) == 0
    assert main(["promote", "2", "--kind", "eagle", "--force", *base]) == 0
    assert main(["rollback", "--kind", "eagle", "--no-pause", *base]) == 0
    assert eagle.champion() == "1" and medusa.versions() == [] and drafts.versions() == []
    capsys.readouterr()
    assert main(["versions", "--kind", "eagle", *base]) == 0
    assert "heads" in capsys.readouterr().out
    assert main(["promote", "2", "--kind", "eagle", "--canary-share", "0.2", "--force", *base]) == 0
    assert "watch --kind eagle" in capsys.readouterr().out
    assert eagle.canary()["version"] == "2" and eagle.canary()["share"] == 0.2 and eagle.champion() == "1"
    assert main(["status", *base]) == 0
    assert f"eagle heads: {eagle.name}: champion 1" in capsys.readouterr().out


def test_a_heads_canary_serves_its_share_is_judged_on_live_acceptance_and_promoted_without_a_reload(
        regs, eagle, pair, target_model, tmp_path):  # noqa: F811
    """The eagle registry's canary alias: the replica loads it beside the champion and routes its share of
    mode-eagle requests to it by request id (the draft canary's hash), every request lossless at T=0 and
    attributed to the head that proposed it; the canary judge reads the live figures logged under
    "eagle-v<N>" and promotes it; the replica then serves the loaded canary as champion (no second load)."""
    from deploy.registry import CANARY
    from serving.engine import routes_to_canary
    from tests.deploy.test_canary import judge, log_live

    v1 = eagle.register(make_eagle(target_model, tmp_path / "e1", seed=1))
    v2 = eagle.register(make_eagle(target_model, tmp_path / "e2", seed=2))
    eagle.promote(v1)
    engine = Engine.from_paths(str(pair[0]), None, dtype=torch.float32)
    svc = Service(ServiceSettings(target=str(pair[0]), buffer=False, watch_interval_s=3600), engine=engine,
                  eagle_source=eagle)
    try:
        assert svc.check_heads(kind="eagle") == f"eagle-v{v1}" and svc.check_canary(kind="eagle") == "none"
        eagle.start_canary(v2, 0.5, reason="test")
        assert eagle.aliases()[CANARY] == v2
        assert svc.check_canary(kind="eagle") == f"eagle-v{v2}" and svc.check_canary() == "none"
        assert svc.health()[1]["heads_canary"]["eagle"]["version"] == f"eagle-v{v2}"
        canary_module = engine.heads_canary["eagle"][0]
        prompt = engine.tokenizer("the cat sat on the mat")["input_ids"]
        arms = set()
        for i in range(12):
            rid = f"req-{i}"
            res = engine.generate_all(prompt, SamplingParams(temperature=0.0, max_tokens=8),
                                      SpecParams(mode="eagle", gamma=3), request_id=rid)
            assert res.token_ids == reference_greedy(engine.target.model, prompt, 8)
            want = f"eagle-v{v2}" if routes_to_canary(rid, 0.5) else f"eagle-v{v1}"
            assert res.stats.draft_version == want
            arms.add(want)
        assert len(arms) == 2                                       # both arms served in 12 requests
        now = time.time()
        log_live(eagle, f"eagle-v{v1}", [0.40, 0.42, 0.41], now + 1)
        log_live(eagle, f"eagle-v{v2}", [0.55, 0.57, 0.56], now + 1)
        assert [round(i["acceptance_rate"], 2) for i in eagle.live_intervals(v2)] == [0.55, 0.57, 0.56]
        v = judge(eagle, tmp_path).check()
        assert v.action == "promoted", v.message
        assert eagle.champion() == v2 and eagle.canary() is None
        # the watcher's order: the champion first (the loaded canary takes over), then the canary alias
        assert svc.check_heads(kind="eagle") == f"eagle-v{v2}" and svc.check_canary(kind="eagle") == "none"
        assert engine.eagle is canary_module
        assert svc.health()[1]["heads_canary"]["eagle"]["version"] == "none"
    finally:
        svc.close()
