"""deploy/gate.py: the acceptance rule (pure), verdicts recorded on real MLflow versions, and the
real lossless smoke decode on tiny models."""
from __future__ import annotations

import json

import pytest

from deploy.gate import GatePolicy, engine_smoke_check, force_promote, judge_acceptance, run_gate
from deploy.registry import CANDIDATE, CHAMPION, PREVIOUS, Registry, VersionInfo
from deploy_helpers import artifact_dir, fresh_store, make_base_draft, make_candidate, template_db
from tiny_models import save_pair


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


def _info(kind="adapter", parent="1", **metrics):
    m = {"offline_acceptance_before": 0.40, "offline_acceptance_after": 0.45, "heldout_records": 50}
    m.update(metrics)
    m = {k: v for k, v in m.items() if v is not None}
    return VersionInfo("2", kind, parent, (), "run", "src", 0, metrics=m)


class FakeSmoke:
    def __init__(self, ok=True, detail="identical", exc=None):
        self.ok, self.detail, self.exc, self.calls = ok, detail, exc, []

    def __call__(self, path):
        self.calls.append(path)
        if self.exc:
            raise self.exc
        return self.ok, self.detail


@pytest.mark.parametrize("after,margin,ok", [
    (0.45, 0.01, True),       # +0.05 >= 0.01
    (0.41, 0.01, True),       # exactly the margin (0.41 - 0.40 is 0.00999... in floats: tolerated)
    (0.405, 0.01, False),     # improvement below the margin
    (0.40, 0.0, False),       # margin 0 still needs a strict improvement
    (0.4001, 0.0, True),
    (0.30, 0.0, False),       # worse
])
def test_acceptance_margin(after, margin, ok):
    got, reason, cand, champ = judge_acceptance(_info(offline_acceptance_after=after), "1",
                                                GatePolicy(margin=margin))
    assert got is ok, reason
    assert cand == after and champ == 0.40


def test_acceptance_refusals_say_why():
    pol = GatePolicy(margin=0.01, min_heldout_records=20)
    cases = [
        (_info(parent="1"), "3", "stale candidate: trained from version 1, but the champion is version 3"),
        (_info(offline_acceptance_after=None), "1", "no offline_acceptance_after"),
        (_info(offline_acceptance_before=None), "1", "no offline_acceptance_before"),
        (_info(heldout_records=5), "1", "held-out set too small: 5 records"),
        (_info(kind="base", parent=None), "1", "is a base draft"),
    ]
    for info, champion, text in cases:
        ok, reason, _, _ = judge_acceptance(info, champion, pol)
        assert not ok and text in reason
    ok, reason, _, _ = judge_acceptance(_info(), None, pol)
    assert ok and reason == "no champion yet"


def test_policy_validation():
    for bad in (-0.1, 1.0, "0.1", True):
        with pytest.raises(ValueError, match="margin"):
            GatePolicy(margin=bad)
    with pytest.raises(ValueError, match="min_heldout_records"):
        GatePolicy(min_heldout_records=-1)


def test_accepted_candidate_is_promoted_and_verdict_recorded(registry, tmp_path):
    v = registry.register_candidate(make_candidate(tmp_path / "c", tmp_path / "base", before=0.40, after=0.47))
    smoke = FakeSmoke(detail="3 prompts identical")
    verdict = run_gate(registry, v, smoke, policy=GatePolicy(margin=0.02))
    assert verdict.accepted and verdict.promoted and verdict.smoke_ok
    assert len(smoke.calls) == 1 and (smoke.calls[0] / "config.json").is_file()   # the materialised folder
    assert registry.aliases() == {CHAMPION: v, PREVIOUS: "1"}
    info = registry.get(v)
    assert info.tags["draftsmith.gate.verdict"] == "accepted"
    assert info.tags["draftsmith.gate.smoke_detail"] == "3 prompts identical"
    assert info.metrics["gate_delta"] == pytest.approx(0.07)
    assert info.metrics["gate_champion_acceptance"] == pytest.approx(0.40)
    assert info.metrics["gate_accepted"] == 1.0
    assert info.tags["draftsmith.gate.vocabulary"] == "259 rows"          # no vocabulary.json: the parent's
    assert [h["action"] for h in registry.history()][-2:] == ["gate", "promote"]


def test_low_acceptance_is_rejected_without_smoke_and_recorded(registry, tmp_path):
    v = registry.register_candidate(make_candidate(tmp_path / "c", tmp_path / "base", before=0.40, after=0.405))
    smoke = FakeSmoke()
    verdict = run_gate(registry, v, smoke, policy=GatePolicy(margin=0.01))
    assert not verdict.accepted and not verdict.promoted and smoke.calls == []
    assert registry.aliases() == {CHAMPION: "1", CANDIDATE: v}
    info = registry.get(v)
    assert info.tags["draftsmith.gate.verdict"] == "rejected"
    assert "does not beat the margin" in info.tags["draftsmith.gate.reason"]
    assert info.tags["draftsmith.gate.smoke"] == "not run"
    assert info.metrics["gate_accepted"] == 0.0 and info.metrics["gate_delta"] == pytest.approx(0.005)


@pytest.mark.parametrize("smoke,expect", [
    (FakeSmoke(ok=False, detail="prompt 0 differs at token 3"), "smoke decode failed: prompt 0 differs at token 3"),
    (FakeSmoke(exc=RuntimeError("engine exploded")), "smoke decode failed: smoke check raised RuntimeError: engine exploded"),
])
def test_failed_smoke_check_rejects(registry, tmp_path, smoke, expect):
    v = registry.register_candidate(make_candidate(tmp_path / "c", tmp_path / "base", before=0.4, after=0.6))
    verdict = run_gate(registry, v, smoke)
    assert not verdict.accepted and verdict.smoke_ok is False and verdict.reason == expect
    assert registry.champion() == "1"
    info = registry.get(v)
    assert info.tags["draftsmith.gate.smoke"] == "failed" and info.metrics["gate_smoke_ok"] == 0.0


def test_corrupt_candidate_is_rejected_and_recorded(registry, tmp_path):
    v = registry.register_candidate(make_candidate(tmp_path / "c", tmp_path / "base", before=0.4, after=0.6))
    (artifact_dir(registry, v) / "adapter" / "adapter_config.json").write_text("{}")
    smoke = FakeSmoke()
    verdict = run_gate(registry, v, smoke)
    assert not verdict.accepted and "artifacts unusable" in verdict.reason and "corrupt" in verdict.reason
    assert smoke.calls == [] and registry.champion() == "1"
    assert registry.get(v).tags["draftsmith.gate.verdict"] == "rejected"


def _with_vocabulary(cand, ids):
    (cand / "vocabulary.json").write_text(json.dumps({"output_token_ids": ids}))
    return cand


def test_gate_reads_the_candidates_vocabulary_from_the_materialised_folder(registry, tmp_path):
    """The smoke check gets the materialised folder whose draftsmith.json holds the candidate's own
    vocabulary (read through serving.models.read_output_token_ids); a folder whose vocabulary differs
    from the registered one is rejected before any smoke decode."""
    from serving.models import read_output_token_ids

    ids = sorted(set(range(0, 256, 2)) | {256, 257, 258})
    v = registry.register_candidate(_with_vocabulary(make_candidate(tmp_path / "c", tmp_path / "base"), ids))
    path = registry.materialize(v)
    meta = json.loads((path / "draftsmith.json").read_text())
    (path / "draftsmith.json").write_text(json.dumps({**meta, "output_token_ids": list(range(259))}))  # stale
    smoke = FakeSmoke()
    verdict = run_gate(registry, v, smoke)
    assert not verdict.accepted and smoke.calls == [] and registry.champion() == "1"
    assert f"different output vocabulary (259 rows) from the registered one ({len(ids)} rows)" in verdict.reason

    v2 = registry.register_candidate(_with_vocabulary(make_candidate(tmp_path / "c2", tmp_path / "base", seed=1), ids))
    seen = []
    smoke = FakeSmoke()
    verdict = run_gate(registry, v2, lambda p: (seen.append(read_output_token_ids(p)), smoke(p))[1])
    assert verdict.accepted and verdict.promoted, verdict.reason
    assert seen == [ids] and verdict.vocabulary == f"{len(ids)} rows"
    assert registry.get(v2).tags["draftsmith.gate.vocabulary"] == f"{len(ids)} rows"


def test_force_promote_skips_the_gate_but_not_artifact_checks(registry, tmp_path):
    v = registry.register_candidate(make_candidate(tmp_path / "c", tmp_path / "base", before=0.4, after=0.1))
    move = force_promote(registry, v)
    assert move.changed and registry.champion() == v
    assert registry.get(v).tags["draftsmith.gate.verdict"] == "skipped (--force)"


def test_real_engine_smoke_check_on_tiny_models(registry, tmp_path):
    """speculative sampling at temperature 0 (fp32) == target greedy, via serving.engine.Engine."""
    target, _ = save_pair(tmp_path / "pair")
    v = registry.register_candidate(make_candidate(tmp_path / "c", tmp_path / "base", before=0.4, after=0.6))
    check = engine_smoke_check(str(target), prompts=("hello there", "2+2="), max_tokens=12)
    verdict = run_gate(registry, v, check)
    assert verdict.accepted and verdict.smoke_ok, verdict.reason
    assert "identical to target greedy" in verdict.smoke_detail
    assert "draft output vocabulary 259 rows" in verdict.smoke_detail
    assert registry.champion() == v

    # a candidate with its own (cut) vocabulary: the engine decodes on exactly those rows, still lossless
    ids = sorted(set(range(0, 256, 4)) | {256, 257, 258})
    v3 = registry.register_candidate(_with_vocabulary(
        make_candidate(tmp_path / "c3", registry.materialize(v), parent_version=v, seed=2, before=0.6, after=0.7),
        ids))
    verdict = run_gate(registry, v3, check)
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
