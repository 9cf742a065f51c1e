"""deploy/gate.py: the paired-evidence rule (pure), the gate scoring champion and candidate itself on
held-out records it draws from real Redis (tiny models, a real MLflow store on a temporary SQLite file),
target pinning, verdicts recorded on real MLflow versions, the pause enforced at promotion, and the
real lossless smoke decode."""
from __future__ import annotations

import json
import uuid

import numpy as np
import pytest

from deploy.gate import (EvidenceSource, GatePolicy, PairedEvidence, engine_smoke_check, force_promote,
                         judge_evidence, run_gate)
from deploy.registry import CANDIDATE, CHAMPION, PREVIOUS, PromotionsPaused, Registry, target_fingerprint
from tests.deploy_helpers import (artifact_dir, drop_prefix, fresh_store, make_base_draft, make_candidate,
                            make_target_clone, serve_records, synthetic_evidence, template_db)
from tests.tiny_models import save_pair

FRACTION = 0.25


@pytest.fixture(scope="session")
def template(tmp_path_factory):
    return template_db(tmp_path_factory.mktemp("mlflow-template"))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target, draft = save_pair(tmp_path_factory.mktemp("pair"))
    return target, draft, target_fingerprint(target)


@pytest.fixture(scope="module")
def served(pair, redis_url):
    """24 held-out requests really served into real Redis: "chat" at temperature 1, "code" greedy."""
    target, draft, _ = pair
    prefix = f"test:gate:{uuid.uuid4().hex[:10]}"
    ids = serve_records(target, draft, redis_url, prefix, requests=24, heldout_fraction=FRACTION)
    yield EvidenceSource(redis_url=redis_url, buffer_prefix=prefix, heldout_fraction=FRACTION, records=5000), ids
    drop_prefix(redis_url, prefix)


@pytest.fixture
def registry(template, tmp_path, monkeypatch, pair):
    """Version 1 (champion): a tiny random base draft pinned to the tiny target."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    reg = Registry("tiny-target", tracking_uri=fresh_store(template, tmp_path / "data"), cache_root=tmp_path / "cache")
    reg.register_base(make_base_draft(tmp_path / "base"), target_sha256=pair[2])
    reg.promote("1")
    return reg


def synthetic(champion, candidate, categories=None, weight=None, records=None):
    """PairedEvidence from per-request figures (a stand-in for the scoring, for the pure rule only)."""
    n = len(champion)
    cats = categories or ["chat"] * n
    return PairedEvidence([f"r{i}" for i in range(n)], list(cats), list(weight or [8.0] * n), list(champion),
                          list(candidate), list(champion), list(candidate), records=records or 4 * n)


evidence_of = synthetic_evidence


class FakeSmoke:
    def __init__(self, ok=True, detail="identical", exc=None):
        self.ok, self.detail, self.exc, self.calls = ok, detail, exc, []

    def __call__(self, path):
        self.calls.append(path)
        if self.exc:
            raise self.exc
        return self.ok, self.detail


# ----------------------------------------------------------------------------- the rule (pure)
def test_paired_rule_needs_a_significant_gain_of_at_least_the_margin():
    rng = np.random.default_rng(1)
    champ = rng.uniform(0.2, 0.6, 60)
    pol = GatePolicy(margin=0.01, min_requests=20)
    j = judge_evidence(synthetic(champ, champ + 0.03 + rng.normal(0, 0.01, 60)), pol)
    assert j.ok and j.delta == pytest.approx(0.03, abs=0.005) and 0 < j.delta_lower < j.delta, j.reason
    j = judge_evidence(synthetic(champ, champ + 0.005), pol)                     # significant, below the margin
    assert not j.ok and "does not reach the margin 0.01" in j.reason
    noisy = champ + 0.02 + np.tile([0.3, -0.3], 30)                             # +0.02 on average, very noisy
    j = judge_evidence(synthetic(champ, noisy), GatePolicy(margin=0.0, min_requests=20))
    assert j.delta == pytest.approx(0.02)
    assert not j.ok and "not significant" in j.reason and j.delta_lower <= 0
    j = judge_evidence(synthetic(champ[:10], champ[:10] + 0.2), pol)
    assert not j.ok and "not enough held-out evidence: 10 requests" in j.reason


def test_weights_are_draft_positions():
    # one long request that got worse outweighs three short ones that got better
    j = judge_evidence(synthetic([0.5, 0.5, 0.5, 0.5], [0.6, 0.6, 0.6, 0.2], weight=[1, 1, 1, 30]),
                       GatePolicy(margin=0.0, min_requests=2))
    assert j.delta == pytest.approx((0.3 - 9.0) / 33) and not j.ok


def test_a_significant_regression_on_one_category_blocks_promotion():
    rng = np.random.default_rng(2)
    n = 40
    champ = rng.uniform(0.3, 0.5, n)
    cats = ["chat"] * 30 + ["code"] * 10
    cand = champ + np.where(np.arange(n) < 30, 0.10, -0.08) + rng.normal(0, 0.01, n)
    pol = GatePolicy(margin=0.01, min_requests=20, category_min_requests=10)
    j = judge_evidence(synthetic(champ, cand, cats), pol)
    assert j.delta > 0.05 and j.delta_lower > 0                                  # overall a clear gain ...
    assert not j.ok and "significant regression on traffic category code" in j.reason   # ... but code regressed
    assert j.categories["code"]["blocks"] and not j.categories["chat"]["blocks"]
    assert j.categories["code"]["level"] == pytest.approx(1 - 0.05 / 2)          # Bonferroni over 2 categories
    # the same regression on a category with too few requests to test is reported, not blocking
    j = judge_evidence(synthetic(champ, cand, cats), GatePolicy(margin=0.01, min_requests=20, category_min_requests=11))
    assert j.ok and j.categories["code"]["tested"] is False and j.categories["code"]["delta"] < 0


def test_policy_validation():
    for bad in (-0.1, 1.0, "0.1", True):
        with pytest.raises(ValueError, match="margin"):
            GatePolicy(margin=bad)
    with pytest.raises(ValueError, match="min_heldout_records"):
        GatePolicy(min_heldout_records=-1)
    with pytest.raises(ValueError, match="confidence"):
        GatePolicy(confidence=1.0)
    with pytest.raises(ValueError, match="min_requests"):
        GatePolicy(min_requests=1)
    with pytest.raises(ValueError, match="heldout_fraction"):
        EvidenceSource(heldout_fraction=0.0)


# ----------------------------------------------------------------------------- independent evidence
def test_gate_rejects_a_candidate_whose_own_figures_are_better_but_whose_gate_sample_is_worse(
        template, tmp_path, monkeypatch, pair, served):
    """Champion: a draft as good as the target. Candidate: LoRA on it that wrecks attention, whose
    candidate.json claims offline acceptance 0.30 -> 0.90. The gate scores both itself on 24 held-out
    requests served into real Redis and rejects it; the job's claim is recorded next to the gate's figure."""
    target, _, sha = pair
    evidence, ids = served
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    reg = Registry("tiny-target", tracking_uri=fresh_store(template, tmp_path / "data"), cache_root=tmp_path / "cache")
    reg.register_base(make_target_clone(tmp_path / "clone", target), target_sha256=sha)
    reg.promote("1")
    v = reg.register_candidate(make_candidate(tmp_path / "c", reg.materialize("1"), parent_version="1", scale=0.6,
                                              before=0.30, after=0.90, target_sha256=sha))
    smoke = FakeSmoke()
    verdict = run_gate(reg, v, smoke, policy=GatePolicy(min_requests=10, category_min_requests=8),
                       evidence=evidence, target_sha256=sha)
    assert not verdict.accepted and not verdict.promoted and smoke.calls == []
    assert verdict.reported_delta == pytest.approx(0.60)                      # what the job claimed
    assert verdict.requests == len(ids) and verdict.records > 100
    assert verdict.champion_acceptance > 0.9 and verdict.delta < -0.1, verdict.reason
    assert "gate sample of 24 held-out requests" in verdict.reason
    assert set(verdict.categories) == {"chat", "code"}
    assert reg.aliases() == {CHAMPION: "1", CANDIDATE: v}
    info = reg.get(v)
    assert info.tags["draftsmith.gate.verdict"] == "rejected"
    assert info.metrics["gate_reported_delta"] == pytest.approx(0.60)
    assert info.metrics["gate_delta"] == pytest.approx(verdict.delta) and info.metrics["gate_requests"] == 24
    ev = json.loads(info.tags["draftsmith.gate.evidence"])
    assert ev["requests"] == 24 and ev["window"]["stream"].endswith(":steps")


def test_gate_promotes_a_draft_that_is_better_on_its_own_sample(registry, tmp_path, pair, served):
    """Champion: a random tiny draft; candidate: a draft equal to the target. Real scoring, real smoke decode."""
    target, _, sha = pair
    evidence, _ = served
    v = registry.register_base(make_target_clone(tmp_path / "clone", target), target_sha256=sha)
    check = engine_smoke_check(str(target), prompts=("hello there",), max_tokens=8)
    verdict = run_gate(registry, v, check, policy=GatePolicy(min_requests=10, category_min_requests=8),
                       evidence=evidence, target_sha256=sha)
    assert verdict.accepted and verdict.promoted and verdict.smoke_ok, verdict.reason
    assert verdict.delta > 0.2 and verdict.delta_lower > 0.1
    assert all(c["delta"] > 0 and not c["blocks"] for c in verdict.categories.values())
    assert verdict.candidate_expected_rate > verdict.champion_expected_rate
    assert registry.aliases() == {CHAMPION: v, PREVIOUS: "1"}
    assert registry.get(v).metrics["gate_expected_rate"] == pytest.approx(verdict.candidate_expected_rate)
    # the sample's cheap fingerprint (what the scheduler compares before gating a waiting candidate again)
    n, newest = evidence.sample_key()
    assert newest == verdict.window["last_id"] and n == verdict.requests == 24
    assert evidence.sample_key() == (n, newest)


def test_the_draft_gate_also_scores_the_requests_that_ended_after_the_jobs_read_the_buffer(
        registry, tmp_path, pair, redis_url):
    """Fresh evidence for drafts (deploy/gate.py): the real draft job keeps the buffer's sequence cursor taken
    after its reads (`data_window.sequence_cut`); the gate on its candidate scores the held-out requests and
    the not-held-out ones whose sequence came after that cut, never the ones the job trained on. Real Redis,
    a real job on tiny models, real MLflow, real scoring."""
    from buffer.redis_store import BufferConfig, ReplayBufferReader
    from deploy import cli
    from deploy.gate import fresh_cut
    from deploy.scheduler import JobRequest
    from training.job import run_distillation

    target, draft, sha = pair
    prefix = f"test:gate-fresh:{uuid.uuid4().hex[:10]}"
    try:
        trained = serve_records(target, draft, redis_url, prefix, requests=8, heldout=False,
                                heldout_fraction=FRACTION, tag="train")
        serve_records(target, draft, redis_url, prefix, requests=3, heldout=True, heldout_fraction=FRACTION,
                      tag="held")
        req = JobRequest("1", registry.materialize("1"), "tiny-target", target_sha256=sha)
        cand = run_distillation(cli.job_config(req, "tiny-target", {
            "redis_url": redis_url, "buffer_prefix": prefix, "heldout_fraction": FRACTION, "steps": 2,
            "batch_tokens": 1024, "min_records": 4, "mlflow": False, "out_dir": str(tmp_path / "cand")}),
            progress=lambda m: None)
        window = json.loads((cand / "candidate.json").read_text())["data_window"]
        assert window["requests"] == len(trained) and window["sequence_cut"] not in (None, "0-0")
        v = registry.register_candidate(cand)
        assert fresh_cut(registry, v) == window["sequence_cut"]          # the champion (a base) kept no data
        evidence = EvidenceSource(redis_url=redis_url, buffer_prefix=prefix, heldout_fraction=FRACTION, records=5000)
        policy = GatePolicy(min_requests=20)                            # judged short of evidence: not promoted
        verdict = run_gate(registry, v, FakeSmoke(), policy=policy, evidence=evidence, target_sha256=sha)
        assert verdict.window["fresh_after"] == window["sequence_cut"] and verdict.window["fresh_requests"] == 0
        assert verdict.requests == 3 and evidence.fresh_after is None   # what it trained on is not evidence
        cut = window["sequence_cut"]
        assert evidence.sample_key(fresh_after=cut)[0] == 3 == evidence.sample_key()[0]

        fresh = serve_records(target, draft, redis_url, prefix, requests=2, heldout=False,
                              heldout_fraction=FRACTION, tag="late-fresh")
        assert evidence.sample_key(fresh_after=cut)[0] == 5 and evidence.sample_key()[0] == 3
        code = EvidenceSource(redis_url=redis_url, buffer_prefix=prefix, heldout_fraction=FRACTION, records=5000,
                              source="code")                    # requests alternate chat, code: 1 held out, 1 fresh
        assert code.sample_key(fresh_after=cut)[0] == 2 and code.sample_key()[0] == 1
        verdict = run_gate(registry, v, FakeSmoke(), policy=policy, evidence=evidence, target_sha256=sha)
        assert verdict.window["fresh_requests"] == len(fresh) == 2 and verdict.requests == 5, verdict.window
        assert not verdict.accepted and "not enough held-out evidence: 5 requests" in verdict.reason
        recorded = json.loads(registry.get(v).tags["draftsmith.gate.evidence"])
        assert recorded["window"]["fresh_requests"] == 2
        # an evidence source given its own cut keeps it: the newest traffic only
        reader = ReplayBufferReader(redis_url, BufferConfig(prefix=prefix))
        now = reader.sequence_cursor()
        reader.client.close()
        pinned = EvidenceSource(redis_url=redis_url, buffer_prefix=prefix, heldout_fraction=FRACTION,
                                records=5000, fresh_after=now)
        verdict = run_gate(registry, v, FakeSmoke(), policy=policy, evidence=pinned, target_sha256=sha)
        assert verdict.window["fresh_requests"] == 0 and verdict.requests == 3
    finally:
        drop_prefix(redis_url, prefix)


# ----------------------------------------------------------------------------- target pinning
def test_gate_refuses_a_candidate_for_another_target(registry, tmp_path, pair):
    other = "f" * 64
    collect = evidence_of(0.2)
    v = registry.register_candidate(make_candidate(tmp_path / "c", tmp_path / "base", target_sha256=other))
    verdict = run_gate(registry, v, FakeSmoke(), evidence=collect, target_sha256=pair[2])
    assert not verdict.accepted and "was built for another target (fingerprint ffffffffffff)" in verdict.reason
    assert collect.calls == [] and registry.champion() == "1"
    assert registry.get(v).tags["draftsmith.gate.target_sha256"] == other

    # a candidate without a fingerprint inherits its parent's (version 1: the tiny target's) and passes
    v2 = registry.register_candidate(make_candidate(tmp_path / "c2", tmp_path / "base", seed=2))
    assert registry.get(v2).target_sha256 == pair[2]
    assert run_gate(registry, v2, FakeSmoke(), evidence=collect, target_sha256=pair[2]).promoted

    # a version that records none at all is refused, and so is any version when the target is unknown
    unpinned = Registry("tiny-target", tracking_uri=registry.tracking_uri, cache_root=registry.cache_root)
    v3 = unpinned.register_base(make_base_draft(tmp_path / "b3", seed=3))      # "tiny-target" has no folder
    assert unpinned.get(v3).target_sha256 is None
    verdict = run_gate(unpinned, v3, FakeSmoke(), evidence=collect, target_sha256=pair[2])
    assert not verdict.accepted and "records no target fingerprint" in verdict.reason
    verdict = run_gate(unpinned, v3, FakeSmoke(), evidence=collect)
    assert not verdict.accepted and "cannot fingerprint the target 'tiny-target'" in verdict.reason


# ----------------------------------------------------------------------------- recording, smoke, pause
def test_accepted_candidate_is_promoted_and_verdict_recorded(registry, tmp_path, pair):
    collect = evidence_of(0.07)
    v = registry.register_candidate(make_candidate(tmp_path / "c", tmp_path / "base", before=0.40, after=0.47))
    smoke = FakeSmoke(detail="3 prompts identical")
    verdict = run_gate(registry, v, smoke, policy=GatePolicy(margin=0.02), evidence=collect, target_sha256=pair[2])
    assert verdict.accepted and verdict.promoted and verdict.smoke_ok
    assert len(collect.calls) == 1 and (collect.calls[0][1] / "config.json").is_file()   # materialised folders
    assert len(smoke.calls) == 1 and (smoke.calls[0] / "config.json").is_file()
    assert registry.aliases() == {CHAMPION: v, PREVIOUS: "1"}
    info = registry.get(v)
    assert info.tags["draftsmith.gate.verdict"] == "accepted"
    assert info.tags["draftsmith.gate.smoke_detail"] == "3 prompts identical"
    assert info.metrics["gate_delta"] == pytest.approx(0.07, abs=0.005)
    assert info.metrics["gate_delta_lower"] > 0.05 and info.metrics["gate_accepted"] == 1.0
    assert info.tags["draftsmith.gate.vocabulary"] == "259 rows"          # no vocabulary.json: the parent's
    assert [h["action"] for h in registry.history()][-2:] == ["gate", "promote"]


def test_low_gain_is_rejected_without_smoke_and_recorded(registry, tmp_path, pair):
    v = registry.register_candidate(make_candidate(tmp_path / "c", tmp_path / "base", before=0.40, after=0.90))
    smoke = FakeSmoke()
    verdict = run_gate(registry, v, smoke, policy=GatePolicy(margin=0.01), evidence=evidence_of(0.004),
                       target_sha256=pair[2])
    assert not verdict.accepted and not verdict.promoted and smoke.calls == []
    assert registry.aliases() == {CHAMPION: "1", CANDIDATE: v}
    info = registry.get(v)
    assert info.tags["draftsmith.gate.verdict"] == "rejected" and info.tags["draftsmith.gate.smoke"] == "not run"
    assert "does not reach the margin" in info.tags["draftsmith.gate.reason"]
    assert info.metrics["gate_accepted"] == 0.0 and info.metrics["gate_delta"] == pytest.approx(0.004, abs=0.003)


def test_no_evidence_source_means_no_promotion(registry, tmp_path, pair):
    v = registry.register_candidate(make_candidate(tmp_path / "c", tmp_path / "base", before=0.1, after=0.9))
    verdict = run_gate(registry, v, FakeSmoke(), target_sha256=pair[2])
    assert not verdict.accepted and "no evidence source configured" in verdict.reason and registry.champion() == "1"


@pytest.mark.parametrize("smoke,expect", [
    (FakeSmoke(ok=False, detail="prompt 0 differs at token 3"), "smoke decode failed: prompt 0 differs at token 3"),
    (FakeSmoke(exc=RuntimeError("engine exploded")), "smoke decode failed: smoke check raised RuntimeError: engine exploded"),
])
def test_failed_smoke_check_rejects(registry, tmp_path, pair, smoke, expect):
    v = registry.register_candidate(make_candidate(tmp_path / "c", tmp_path / "base", before=0.4, after=0.6))
    verdict = run_gate(registry, v, smoke, evidence=evidence_of(0.1), target_sha256=pair[2])
    assert not verdict.accepted and verdict.smoke_ok is False and verdict.reason == expect
    assert registry.champion() == "1"
    info = registry.get(v)
    assert info.tags["draftsmith.gate.smoke"] == "failed" and info.metrics["gate_smoke_ok"] == 0.0


def test_corrupt_candidate_is_rejected_and_recorded(registry, tmp_path, pair):
    v = registry.register_candidate(make_candidate(tmp_path / "c", tmp_path / "base", before=0.4, after=0.6))
    (artifact_dir(registry, v) / "adapter" / "adapter_config.json").write_text("{}")
    smoke, collect = FakeSmoke(), evidence_of(0.1)
    verdict = run_gate(registry, v, smoke, evidence=collect, target_sha256=pair[2])
    assert not verdict.accepted and "artifacts unusable" in verdict.reason and "corrupt" in verdict.reason
    assert smoke.calls == [] and collect.calls == [] and registry.champion() == "1"
    assert registry.get(v).tags["draftsmith.gate.verdict"] == "rejected"


def test_pause_is_enforced_where_promotion_happens(registry, tmp_path, pair):
    """After a rollback (which pauses), an accepted candidate is recorded as accepted but not promoted:
    Registry.promote itself refuses; force_promote too, unless the operator overrides the pause."""
    v2 = registry.register_candidate(make_candidate(tmp_path / "c2", tmp_path / "base", seed=2))
    assert run_gate(registry, v2, FakeSmoke(), evidence=evidence_of(0.1), target_sha256=pair[2]).promoted
    registry.rollback(reason="bad live numbers")
    assert registry.champion() == "1" and registry.promotions_paused()
    with pytest.raises(PromotionsPaused, match="paused.*bad live numbers.*draftsmith resume"):
        registry.promote(v2)
    v3 = registry.register_candidate(make_candidate(tmp_path / "c3", tmp_path / "base", seed=3))
    verdict = run_gate(registry, v3, FakeSmoke(), evidence=evidence_of(0.1), target_sha256=pair[2])
    assert verdict.accepted and not verdict.promoted and verdict.promotion.startswith("paused")
    assert registry.champion() == "1" and registry.get(v3).tags["draftsmith.gate.promotion"].startswith("paused")
    with pytest.raises(PromotionsPaused):
        force_promote(registry, v3)
    assert force_promote(registry, v3, ignore_pause=True).changed and registry.champion() == v3


def _with_vocabulary(cand, ids):
    (cand / "vocabulary.json").write_text(json.dumps({"output_token_ids": ids}))
    return cand


def test_gate_reads_the_candidates_vocabulary_from_the_materialised_folder(registry, tmp_path, pair):
    """The smoke check gets the materialised folder whose draftsmith.json holds the candidate's own
    vocabulary (read through serving.models.read_output_token_ids); a folder whose vocabulary differs
    from the registered one is rejected before any scoring or smoke decode."""
    from serving.models import read_output_token_ids

    ids = sorted(set(range(0, 256, 2)) | {256, 257, 258})
    v = registry.register_candidate(_with_vocabulary(make_candidate(tmp_path / "c", tmp_path / "base"), ids))
    path = registry.materialize(v)
    meta = json.loads((path / "draftsmith.json").read_text())
    (path / "draftsmith.json").write_text(json.dumps({**meta, "output_token_ids": list(range(259))}))  # stale
    smoke, collect = FakeSmoke(), evidence_of(0.1)
    verdict = run_gate(registry, v, smoke, evidence=collect, target_sha256=pair[2])
    assert not verdict.accepted and smoke.calls == [] and collect.calls == [] and registry.champion() == "1"
    assert f"different output vocabulary (259 rows) from the registered one ({len(ids)} rows)" in verdict.reason

    v2 = registry.register_candidate(_with_vocabulary(make_candidate(tmp_path / "c2", tmp_path / "base", seed=1), ids))
    seen = []
    smoke = FakeSmoke()
    verdict = run_gate(registry, v2, lambda p: (seen.append(read_output_token_ids(p)), smoke(p))[1],
                       evidence=collect, target_sha256=pair[2])
    assert verdict.accepted and verdict.promoted, verdict.reason
    assert seen == [ids] and verdict.vocabulary == f"{len(ids)} rows"
    assert read_output_token_ids(collect.calls[-1][1]) == ids                  # scored on its own rows too
    assert registry.get(v2).tags["draftsmith.gate.vocabulary"] == f"{len(ids)} rows"


def test_force_promote_skips_the_gate_but_not_artifact_checks(registry, tmp_path):
    v = registry.register_candidate(make_candidate(tmp_path / "c", tmp_path / "base", before=0.4, after=0.1))
    move = force_promote(registry, v)
    assert move.changed and registry.champion() == v
    assert registry.get(v).tags["draftsmith.gate.verdict"] == "skipped (--force)"


def test_real_engine_smoke_check_on_tiny_models(registry, tmp_path, pair):
    """speculative sampling at temperature 0 (fp32) == target greedy, via serving.engine.Engine."""
    target, _, sha = pair
    v = registry.register_candidate(make_candidate(tmp_path / "c", tmp_path / "base", before=0.4, after=0.6))
    check = engine_smoke_check(str(target), prompts=("hello there", "2+2="), max_tokens=12)
    verdict = run_gate(registry, v, check, evidence=evidence_of(0.1), target_sha256=sha)
    assert verdict.accepted and verdict.smoke_ok, verdict.reason
    assert "identical to target greedy" in verdict.smoke_detail
    assert "draft output vocabulary 259 rows" in verdict.smoke_detail
    assert registry.champion() == v

    # a candidate with its own (cut) vocabulary: the engine decodes on exactly those rows, still lossless
    ids = sorted(set(range(0, 256, 4)) | {256, 257, 258})
    v3 = registry.register_candidate(_with_vocabulary(
        make_candidate(tmp_path / "c3", registry.materialize(v), parent_version=v, seed=2, before=0.6, after=0.7),
        ids))
    verdict = run_gate(registry, v3, check, evidence=evidence_of(0.1), target_sha256=sha)
    assert verdict.accepted and verdict.smoke_ok, verdict.reason
    assert f"draft output vocabulary {len(ids)} rows" in verdict.smoke_detail
    assert verdict.vocabulary == f"{len(ids)} rows" and registry.champion() == v3

    # negative control: a draft whose tokenizer differs from the target's cannot pass
    from transformers import AutoTokenizer

    odd = tmp_path / "odd"
    make_base_draft(odd)
    tok = AutoTokenizer.from_pretrained(odd)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(odd)
    ok, detail = check(odd)
    assert not ok and "does not load" in detail
