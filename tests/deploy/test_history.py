"""A bounded history (deploy/registry.py): candidates deeper than K adapters are squashed into a new base, so
every chain stays <= K and a cold materialisation reads at most K+1 versions, with the same weights as the
unsquashed merge; retention (`gc`, `draftsmith gc`) deletes cached and candidate folders of versions neither
aliased nor recent; `verify` hashes an ancestry once, a tampered unverified artifact is still caught.
Real MLflow (SQLite in temp dirs) and tiny models, as tests/deploy/test_registry.py."""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from deploy import cli
from deploy.registry import (CANDIDATE, CHAMPION, PREVIOUS, ArtifactError, Registry, UsageError,
                             vocabulary_digest)
from tests.deploy_helpers import artifact_dir, fresh_store, make_base_draft, make_candidate, synthetic_evidence, template_db

SHA = "7" * 64
IDS = [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]


@pytest.fixture(scope="session")
def template(tmp_path_factory):
    return template_db(tmp_path_factory.mktemp("mlflow-template"))


@pytest.fixture(autouse=True)
def _no_server(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("DRAFTSMITH_MAX_CHAIN_DEPTH", raising=False)
    monkeypatch.delenv("DRAFTSMITH_KEEP_VERSIONS", raising=False)


def make_registry(template, root: Path, **kw) -> Registry:
    kw.setdefault("cache_root", root / "cache")
    kw.setdefault("candidates_root", root / "data" / "candidates")
    return Registry("tiny-target", tracking_uri=fresh_store(template, root / "data"), **kw)


@pytest.fixture
def base(tmp_path):
    return make_base_draft(tmp_path / "base")


def _logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0]


def _vocab(cand: Path, ids) -> Path:
    (cand / "vocabulary.json").write_text(json.dumps({"output_token_ids": ids, "chosen_by": "window"}))
    return cand


def _chain_of_candidates(regs: list[Registry], base: Path, tmp_path: Path, n: int) -> None:
    """Base version 1, then n candidates each trained on (and promoted over) the one before, registered
    identically in every registry of `regs`."""
    for reg in regs:
        assert reg.register_base(base, target_sha256=SHA) == "1"
        reg.promote("1")
    for i in range(2, n + 2):
        cand = make_candidate(tmp_path / "cands" / f"c{i}", base, parent_version=str(i - 1), seed=i,
                              before=0.4, after=0.5 + i / 100, last_id=f"1700000000000-{i}")
        if i == 4:                                   # one candidate re-chooses its vocabulary
            _vocab(cand, sorted(set(range(0, 256, 2)) | {256, 257, 258}))
        for reg in regs:
            assert reg.register_candidate(cand) == str(i)
            reg.promote(str(i))


def test_a_long_chain_stays_within_k_and_merges_to_the_same_draft(template, tmp_path, base):
    k = 2
    sq = make_registry(template, tmp_path / "sq", max_chain_depth=k)
    flat = make_registry(template, tmp_path / "flat", max_chain_depth=64)
    _chain_of_candidates([sq, flat], base, tmp_path, n=7)                  # versions 1..8

    depths = {v.version: sq.chain_depth(v.version) for v in sq.versions()}
    assert max(depths.values()) <= k and depths == {"1": 0, "2": 1, "3": 2, "4": 0, "5": 1, "6": 2, "7": 0, "8": 1}
    assert flat.chain_depth("8") == 7 and flat.chain("8") == [str(v) for v in range(8, 0, -1)]
    assert sq.chain("8") == ["8", "7"]

    squashed = sq.get("4")
    assert squashed.kind == "base" and squashed.squashed_from == "3" and squashed.distilled
    adapter = flat.get("4")
    assert squashed.squashed_chain == ["3", "2", "1"] and adapter.squashed_chain == []
    # the lineage, pin, vocabulary, data window and figures the gate and the scheduler read are kept
    assert squashed.parent_version == adapter.parent_version == "3"
    assert squashed.target_sha256 == adapter.target_sha256 == SHA
    for tag in ("draftsmith.vocab_sha256", "draftsmith.vocab_size", "draftsmith.data_window", "draftsmith.loss"):
        assert squashed.tags[tag] == adapter.tags[tag], tag
    assert squashed.tags["draftsmith.vocab_sha256"] == vocabulary_digest(sorted(set(range(0, 256, 2)) | {256, 257, 258}))
    assert squashed.metrics["offline_acceptance_after"] == adapter.metrics["offline_acceptance_after"]
    assert squashed.metrics["offline_acceptance_after"] == pytest.approx(0.54)
    assert squashed.params == adapter.params
    stored = json.loads((artifact_dir(sq, "4") / "manifest.json").read_text())
    assert {"draft/model.safetensors", "adapter/adapter_model.safetensors", "candidate.json",
            "vocabulary.json"} <= set(stored)                             # the candidate itself, for the record
    assert sq.last_data_window()["last_id"] == "1700000000000-8"
    assert [h.get("squashed") for h in sq.history() if h["action"] == "register"] == \
        [None, None, True, None, None, True, None]
    assert sq.aliases() == {CHAMPION: "8", PREVIOUS: "7"}

    # the champion materialises (cold, on both) to the same weights and logits
    for reg in (sq, flat):
        shutil.rmtree(reg.cache_root)
    a, b = sq.materialize("8"), flat.materialize("8")
    assert json.loads((a / "draftsmith.json").read_text()) == json.loads((b / "draftsmith.json").read_text())
    from safetensors.torch import load_file

    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa)
    la, lb = _logits(a), _logits(b)
    assert torch.equal(la, lb)
    assert not torch.allclose(la, _logits(flat.materialize("1")), atol=1e-3)   # the adapters did change it


def test_a_cold_materialisation_after_squash_reads_at_most_k_plus_1_versions(template, tmp_path, base):
    k = 3
    sq = make_registry(template, tmp_path / "sq", max_chain_depth=k)
    flat = make_registry(template, tmp_path / "flat", max_chain_depth=64)
    _chain_of_candidates([sq, flat], base, tmp_path, n=10)                 # versions 1..11
    for reg in (sq, flat):
        assert max(reg.chain_depth(v.version) for v in reg.versions()) == (k if reg is sq else 10)

    def reads(reg: Registry, version: str) -> list[str]:
        shutil.rmtree(reg.cache_root)
        seen: list[str] = []
        real = reg._verified_artifacts

        def spy(mv):
            seen.append(str(mv.version))
            return real(mv)

        reg._verified_artifacts = spy
        try:
            reg.materialize(version)
        finally:
            del reg._verified_artifacts
        return seen

    for v in map(str, range(1, 12)):
        assert len(reads(sq, v)) <= k + 1, v
    assert sorted(reads(sq, "11"), key=int) == sorted(sq.chain("11"), key=int) == ["9", "10", "11"]
    assert len(reads(flat, "11")) == 11


def test_the_squash_depth_comes_from_the_environment(template, tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_MAX_CHAIN_DEPTH", "1")
    monkeypatch.setenv("DRAFTSMITH_KEEP_VERSIONS", "5")
    reg = make_registry(template, tmp_path)
    assert reg.max_chain_depth == 1 and reg.keep_last == 5
    assert make_registry(template, tmp_path / "b", max_chain_depth=2).max_chain_depth == 2     # the argument wins
    monkeypatch.setenv("DRAFTSMITH_MAX_CHAIN_DEPTH", "deep")
    with pytest.raises(UsageError, match="DRAFTSMITH_MAX_CHAIN_DEPTH must be a whole number >= 0, got 'deep'"):
        make_registry(template, tmp_path / "c")
    monkeypatch.delenv("DRAFTSMITH_MAX_CHAIN_DEPTH")
    assert make_registry(template, tmp_path / "d").max_chain_depth == 4


def test_scheduled_jobs_through_the_gate_keep_the_chain_bounded(template, tmp_path, base):
    """The scheduler registers, gates and promotes squashed candidates as any other: stale checks, the
    target pin, the job's claim and the record cursor all read the same tags."""
    from deploy.scheduler import DistillScheduler, JobLock

    reg = make_registry(template, tmp_path, max_chain_depth=1)
    reg.register_base(base, target_sha256=SHA)
    reg.promote("1")
    requests = []

    def distill(req):
        requests.append(req)
        n = len(requests)
        return make_candidate(tmp_path / f"job{n}", req.parent_path, parent_version=req.parent_version, seed=n,
                              before=0.4, after=0.6, last_id=f"1700000000000-{10 * n}", target_sha256=req.target_sha256)

    sched = DistillScheduler(reg, distill, smoke_check=lambda p: (True, "fake"), lock=JobLock(tmp_path / "j.lock"),
                             evidence=synthetic_evidence(0.1), target_sha256=SHA, progress=lambda m: None)
    for n in range(1, 5):
        out = sched.run_job()
        assert out.status == "promoted" and out.version == str(n + 1) and out.parent_version == str(n), out.message
    assert [reg.chain_depth(str(v)) for v in range(1, 6)] == [0, 1, 0, 1, 0]
    assert [r.since_id for r in requests] == [None, "1700000000000-10", "1700000000000-20", "1700000000000-30"]
    info = reg.get("3")
    assert info.kind == "base" and info.squashed_from == "2"
    assert info.tags["draftsmith.gate.verdict"] == "accepted"
    assert info.metrics["gate_reported_delta"] == pytest.approx(0.2)       # the job's claim is still recorded
    assert reg.aliases() == {CHAMPION: "5", PREVIOUS: "4"}


# ----------------------------------------------------------------------------------------- verify
def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_verify_hashes_an_ancestry_once_and_still_catches_tampering(template, tmp_path, base):
    reg = make_registry(template, tmp_path, max_chain_depth=8)
    reg.register_base(base)
    for i in (2, 3):
        reg.register_candidate(make_candidate(tmp_path / f"c{i}", base, parent_version=str(i - 1), seed=i))
    assert reg.verify("3") == ["3", "2", "1"]                  # nothing verified yet: the whole chain
    assert reg.verify("3") == ["3"]                            # then only the version itself
    reg.promote("3")
    assert reg.verify("3") == ["3"]
    assert reg.verify("3", full=True) == ["3", "2", "1"]

    # an ancestor that was verified and then rots is caught by a full check and by any cold read
    _flip_byte(artifact_dir(reg, "1") / "draft" / "model.safetensors")
    assert reg.verify("3") == ["3"]
    with pytest.raises(ArtifactError, match="version 1 .*model.safetensors.* corrupt"):
        reg.verify("3", full=True)
    shutil.rmtree(reg.cache_root)
    with pytest.raises(ArtifactError, match="version 1 .*corrupt"):
        reg.materialize("3")

    # a new version's unverified ancestor is hashed, and tampering there refuses the promotion
    reg2 = make_registry(template, tmp_path / "two", max_chain_depth=8)
    reg2.register_base(base)
    reg2.register_candidate(make_candidate(tmp_path / "d2", base, parent_version="1", seed=2))
    reg2.promote("2")                                          # verifies 2 and 1
    reg2.register_candidate(make_candidate(tmp_path / "d3", base, parent_version="2", seed=3))
    reg2.register_candidate(make_candidate(tmp_path / "d4", base, parent_version="3", seed=4))
    _flip_byte(artifact_dir(reg2, "3") / "adapter" / "adapter_model.safetensors")
    before = reg2.aliases()
    with pytest.raises(ArtifactError, match="version 3 .*adapter_model.safetensors.* corrupt"):
        reg2.promote("4")
    assert reg2.aliases() == before
    # a changed manifest (its sha256 tag) is not the verified one: checked again, and refused
    assert reg2.verify("2") == ["2"]
    reg2.set_version_tags("1", {"draftsmith.manifest_sha256": "0" * 64})
    with pytest.raises(ArtifactError, match="version 1 .*manifest.json is corrupt"):
        reg2.verify("2")
    # the version itself is always re-hashed, verified before or not (a replica's swap)
    _flip_byte(artifact_dir(reg2, "2") / "adapter" / "adapter_model.safetensors")
    with pytest.raises(ArtifactError, match="version 2 .*corrupt"):
        reg2.materialize("2", verify=True)


# ----------------------------------------------------------------------------------------- retention
def _age(folder: Path, seconds: float) -> None:
    """Make a folder look written/used `seconds` ago (the grace period is measured from mtimes)."""
    t = time.time() - seconds
    for p in [folder, *folder.rglob("*")]:
        os.utime(p, (t, t), follow_symlinks=False)


def _populated(template, root: Path, base: Path, **kw) -> Registry:
    """Versions 1..6 (base + 5 candidates written under the candidates folder, version 3's elsewhere);
    champion 5, previous 4, candidate 6, canary 2; every version materialised; everything old."""
    kw.setdefault("auto_gc", False)
    reg = make_registry(template, root, max_chain_depth=64, **kw)
    reg.register_base(base)
    for i in range(2, 7):
        where = root / "elsewhere" if i == 3 else reg.candidates_root
        reg.register_candidate(make_candidate(where / f"2024-from-v{i - 1}-{i}", base, parent_version=str(i - 1),
                                              seed=i))
    for v in ("2", "3", "4", "5"):
        reg.promote(v)
    reg.client.set_registered_model_alias(reg.name, "canary", "2")
    for v in range(1, 7):
        reg.materialize(str(v))
    (reg.candidates_root / "unregistered-job").mkdir()                     # a job's folder never registered
    (reg.candidates_root / ".2025-from-v6-x.tmp-abc").mkdir()              # a job writing its candidate now
    (reg.cache_root / reg.name / "9-0123456789ab").mkdir()                 # another store's entry
    for folder in (reg.cache_root / reg.name, reg.candidates_root, root / "elsewhere"):
        for entry in folder.iterdir():
            if entry.is_dir() and not entry.name.startswith("."):
                _age(entry, 3600)
    return reg


def _cache_versions(reg: Registry) -> set[str]:
    return {p.name.split("-")[0] for p in (reg.cache_root / reg.name).iterdir() if p.is_dir()}


def test_retention_keeps_aliased_and_recent_versions_and_deletes_the_rest(template, tmp_path, base):
    reg = _populated(template, tmp_path, base, keep_last=1)
    assert reg.aliases() == {CHAMPION: "5", PREVIOUS: "4", CANDIDATE: "6", "canary": "2"}
    assert reg.retained_versions() == {"5": ["champion"], "4": ["previous"], "6": ["candidate", "recent"],
                                       "2": ["canary"]}
    assert _cache_versions(reg) == {"1", "2", "3", "4", "5", "6", "9"}

    dry = reg.gc(dry_run=True)
    assert sorted(dry["cache"].deleted) == sorted(p.name for p in (reg.cache_root / reg.name).iterdir()
                                                  if p.name.split("-")[0] in ("1", "3"))
    assert _cache_versions(reg) == {"1", "2", "3", "4", "5", "6", "9"}     # a dry run deletes nothing

    reports = reg.gc()
    assert _cache_versions(reg) == {"2", "4", "5", "6", "9"}
    assert len(reports["cache"].deleted) == 2 and reports["cache"].freed_bytes > 0
    assert ("9-0123456789ab", "not a version of this store") in reports["cache"].skipped
    assert not any(p.name.startswith(".trash-") for p in (reg.cache_root / reg.name).iterdir())
    left = {p.name for p in reg.candidates_root.iterdir()}
    # candidate 3 was registered from outside the candidates folder: never touched; 1 is a base
    assert left == {"2024-from-v1-2", "2024-from-v3-4", "2024-from-v4-5", "2024-from-v5-6", "unregistered-job",
                    ".2025-from-v6-x.tmp-abc"}
    assert (tmp_path / "elsewhere" / "2024-from-v2-3").is_dir()
    assert ("unregistered-job", "not registered") in reports["candidates"].skipped

    # keep fewer: candidate 2 stays while it is the canary
    reg.client.delete_registered_model_alias(reg.name, "canary")
    reports = reg.gc(keep_last=0)
    assert reports["candidates"].deleted == ["2024-from-v1-2"] and _cache_versions(reg) == {"4", "5", "6", "9"}
    # an old unregistered folder goes only when asked
    assert reg.gc(unregistered_older_than_s=600)["candidates"].deleted == ["unregistered-job"]
    assert (reg.candidates_root / ".2025-from-v6-x.tmp-abc").is_dir()

    # a deleted cache entry is simply materialised again
    again = reg.materialize("1")
    assert (again / "config.json").is_file()


def test_recently_used_folders_are_never_deleted(template, tmp_path, base):
    reg = _populated(template, tmp_path, base, keep_last=0)
    reg.materialize("1")                                     # a replica found it in the cache just now
    reports = reg.gc()                                       # default grace: 10 minutes
    assert _cache_versions(reg) == {"1", "2", "4", "5", "6", "9"}
    assert any(name.startswith("1-") and "grace 600" in why for name, why in reports["cache"].skipped)
    assert reg.gc(grace_s=0)["cache"].deleted and _cache_versions(reg) == {"2", "4", "5", "6", "9"}


def test_retention_runs_after_promotion_and_never_fails_it(template, tmp_path, base, caplog):
    reg = _populated(template, tmp_path, base, keep_last=1)
    reg.auto_gc, reg.gc_grace_s = True, 0.0
    reg.register_candidate(make_candidate(reg.candidates_root / "new", base, parent_version="6", seed=7))
    assert reg.aliases()[CANDIDATE] == "7"
    assert _cache_versions(reg) == {"2", "4", "5", "9"}      # 1, 3, 6 no longer retained (6 lost `candidate`)
    assert not (reg.candidates_root / "2024-from-v5-6").exists()

    def broken(*a, **kw):
        raise OSError("disk on fire")

    reg.gc = broken
    with caplog.at_level(logging.WARNING, logger="deploy.registry"):
        move = reg.promote("7")
    assert move.changed and reg.champion() == "7"
    assert "retention (gc) of" in caplog.text and "disk on fire" in caplog.text


# ----------------------------------------------------------------------------------------- the CLI
def test_gc_command(template, tmp_path, base, monkeypatch, capsys):
    monkeypatch.setenv("DRAFTSMITH_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "dcache"))
    reg = _populated(template, tmp_path, base, cache_root=tmp_path / "dcache" / "drafts")
    assert reg.candidates_root == tmp_path / "data" / "candidates"
    common = ["--target", "tiny-target", "--tracking-uri", reg.tracking_uri]

    def run(*argv):
        code = cli.main(["gc", *common, *argv])
        out, err = capsys.readouterr()
        assert "Traceback" not in out + err
        return code, out, err

    code, out, _ = run("--keep-last", "1", "--dry-run")
    assert code == 0 and "keeping versions 2 (canary), 4 (previous), 5 (champion), 6 (candidate, recent)" in out
    assert "would delete 2 folder(s)" in out and _cache_versions(reg) == {"1", "2", "3", "4", "5", "6", "9"}
    code, out, _ = run("--keep-last", "1")
    assert code == 0 and "cache " in out and "deleted 2 folder(s)" in out and "deleted 0" not in out
    assert "unregistered-job (not registered)" in out and "--unregistered-older-than" in out
    assert _cache_versions(reg) == {"2", "4", "5", "6", "9"}
    code, out, _ = run("--keep-last", "1")
    assert code == 0 and out.count("nothing to delete") == 2
    code, out, _ = run("--unregistered-older-than", "30m")
    assert code == 0 and "deleted: " + str(reg.candidates_root / "unregistered-job") in out

    with pytest.raises(SystemExit) as e:
        cli.main(["gc", *common, "--keep-last", "-1"])
    assert e.value.code == 2 and "expected a whole number >= 0, got '-1'" in capsys.readouterr().err

    code, out, _ = run("--grace", "0")
    assert code == 0
    code = cli.main(["status", *common])
    out, _ = capsys.readouterr()
    assert code == 0 and "champion chain: 5 -> 4 -> 3 -> 2 -> 1 (adapter depth 4, at most 4)" in out


def test_register_command_says_when_it_squashes(template, tmp_path, base, monkeypatch, capsys):
    monkeypatch.setenv("DRAFTSMITH_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "dcache"))
    monkeypatch.setenv("DRAFTSMITH_MAX_CHAIN_DEPTH", "1")
    reg = make_registry(template, tmp_path, cache_root=tmp_path / "dcache" / "drafts")
    reg.register_base(base, target_sha256=SHA)
    common = ["--target", "tiny-target", "--tracking-uri", reg.tracking_uri]
    for v in ("2", "3"):
        cand = make_candidate(tmp_path / f"c{v}", base, parent_version=str(int(v) - 1), seed=int(v))
        assert cli.main(["register", str(cand), *common]) == 0
    out, err = capsys.readouterr()
    assert f"version 2 (adapter on version 1; target {SHA[:12]})" in out
    assert (f"version 3 (base on version 2, squashed: its chain 2 -> 1 merged in, as the adapter chain would "
            f"exceed 1; target {SHA[:12]})") in out
    assert [reg.chain_depth(v) for v in ("1", "2", "3")] == [0, 1, 0]
