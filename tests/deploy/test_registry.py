"""deploy/registry.py against a real MLflow (SQLite store in a temp dir) with tiny models."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from deploy.live_stats import LiveAggregate, LiveStatsLogger
from deploy.registry import (CANDIDATE, CHAMPION, PREVIOUS, AliasLock, ArtifactError, PromotionsPaused, Registry,
                             RegistryUnavailable, UsageError, model_name_for, target_fingerprint, vocabulary_digest)
from tests.deploy_helpers import artifact_dir, fresh_store, lora_model, make_base_draft, make_candidate, template_db

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def template(tmp_path_factory):
    return template_db(tmp_path_factory.mktemp("mlflow-template"))


@pytest.fixture
def registry(template, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = fresh_store(template, tmp_path / "data")
    return Registry("tiny-target", tracking_uri=uri, cache_root=tmp_path / "cache")


@pytest.fixture
def base(tmp_path):
    return make_base_draft(tmp_path / "base")


def _logits(folder_or_model, ids):
    from transformers import AutoModelForCausalLM

    model = folder_or_model
    if isinstance(folder_or_model, (str, Path)):
        model = AutoModelForCausalLM.from_pretrained(folder_or_model, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


IDS = [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]


def test_model_names():
    assert model_name_for(None) == "draftsmith-smollm2-135m-instruct-draft"
    assert model_name_for("/models/My Target_v2/") == "draftsmith-my-target_v2-draft"
    with pytest.raises(UsageError, match="model name"):
        model_name_for("///")


def test_default_store_is_created_under_the_data_dir(tmp_path, monkeypatch, base):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("DRAFTSMITH_DATA", str(tmp_path / "d"))
    reg = Registry("tiny-target", cache_root=tmp_path / "cache")
    assert reg.tracking_uri == f"sqlite:///{tmp_path / 'd' / 'mlflow.db'}"
    assert not (tmp_path / "d").exists()
    assert reg.versions() == []
    assert reg.register_base(base) == "1"
    assert (tmp_path / "d" / "mlflow.db").is_file()
    stored = list((tmp_path / "d" / "mlartifacts").rglob("draft/config.json"))
    assert len(stored) == 1


def test_register_records_lineage_config_and_metrics(registry, base, tmp_path):
    assert registry.register_base(base) == "1"
    cand = make_candidate(tmp_path / "cand", base, parent_version="1", before=0.4, after=0.55)
    v = registry.register_candidate(cand)
    assert v == "2"
    info = registry.get(v)
    assert info.kind == "adapter" and info.parent_version == "1"
    assert info.aliases == (CANDIDATE,)
    assert info.metrics["offline_acceptance_before"] == pytest.approx(0.4)
    assert info.metrics["offline_acceptance_after"] == pytest.approx(0.55)
    assert info.metrics["heldout_records"] == 64
    assert info.params["train.lr"] == "0.001" and info.params["train.lora.r"] == "4"
    assert info.params["data.last_id"] == "1700000000000-5" and info.params["loss"] == "jsd"
    assert json.loads(info.tags["draftsmith.data_window"])["num_records"] == 6
    assert info.tags["draftsmith.base_draft_path"] == str(base)
    base_info = registry.get("v1")
    assert base_info.kind == "base" and base_info.parent_version is None
    assert base_info.offline_acceptance == pytest.approx(0.42)   # from the folder's draftsmith.json
    assert base_info.params["built_by"] == "tests"
    assert registry.last_data_window()["last_id"] == "1700000000000-5"
    stored = artifact_dir(registry, v)
    files = {p.relative_to(stored).as_posix() for p in stored.rglob("*") if p.is_file()}
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors", "candidate.json",
            "manifest.json"} <= files
    manifest = json.loads((stored / "manifest.json").read_text())
    assert set(manifest) == files - {"manifest.json"}


def test_materialize_merges_the_parent_chain(registry, base, tmp_path):
    registry.register_base(base)
    registry.register_candidate(make_candidate(tmp_path / "c2", base, parent_version="1", seed=3))
    v2 = registry.materialize("2")
    # a plain folder: merged weights, the base's tokenizer and draftsmith.json, no adapter files
    assert (v2 / "config.json").is_file() and (v2 / "tokenizer.json").is_file()
    assert json.loads((v2 / "draftsmith.json").read_text())["output_token_ids"] == list(range(259))
    assert not (v2 / "adapter_config.json").exists()
    expected = _logits(lora_model(base, seed=3), IDS)
    assert torch.allclose(_logits(v2, IDS), expected, atol=1e-5)
    assert not torch.allclose(_logits(base, IDS), expected, atol=1e-3)   # the adapter did change the draft

    # version 3 was trained on the merged version 2: materialising it merges both adapters in order
    registry.register_candidate(make_candidate(tmp_path / "c3", v2, parent_version="2", seed=4))
    shutil.rmtree(registry.cache_root)                                    # force a rebuild of the whole chain
    v3 = registry.materialize("3")
    assert torch.allclose(_logits(v3, IDS), _logits(lora_model(v2, seed=4), IDS), atol=1e-5)
    assert registry.materialize("2") == v2                                # rebuilt at the same place

    marker = v3 / ".draftsmith-materialized.json"
    mtime = marker.stat().st_mtime_ns
    assert registry.materialize("3") == v3 and marker.stat().st_mtime_ns == mtime   # cached


def _with_vocabulary(cand: Path, ids) -> Path:
    """Give a candidate folder the vocabulary.json a distillation job writes (training/job.py)."""
    (cand / "vocabulary.json").write_text(json.dumps({"output_token_ids": ids, "parent_version": "1",
                                                      "chosen_by": "window", "entered": [], "left": []}))
    return cand


def test_candidate_vocabulary_is_stored_with_the_version_and_materialised(registry, base, tmp_path):
    """vocabulary.json is a verified artifact of its version; materialize writes it into draftsmith.json
    (other keys kept), where serving.models.read_output_token_ids (engine, trainer, gate) reads it; a
    candidate without one keeps its parent's; null means the full vocabulary."""
    from serving.models import read_output_token_ids

    registry.register_base(base)
    assert registry.get("1").tags["draftsmith.vocab_size"] == "259"
    assert registry.get("1").tags["draftsmith.vocab_sha256"] == vocabulary_digest(list(range(259)))
    v2_ids = sorted(set(range(0, 256, 3)) | {256, 257, 258})
    v2 = registry.register_candidate(_with_vocabulary(make_candidate(tmp_path / "c2", base, seed=3), v2_ids))
    stored = artifact_dir(registry, v2)
    assert "vocabulary.json" in json.loads((stored / "manifest.json").read_text())
    info = registry.get(v2)
    assert info.tags["draftsmith.vocab_size"] == str(len(v2_ids))
    assert info.tags["draftsmith.vocab_sha256"] == vocabulary_digest(v2_ids)
    d2 = registry.materialize(v2)
    assert read_output_token_ids(d2) == v2_ids
    meta = json.loads((d2 / "draftsmith.json").read_text())
    assert meta["built_by"] == "tests" and meta["heldout_top1_agreement_after"] == 0.42   # the parent's other keys
    assert torch.allclose(_logits(d2, IDS), _logits(lora_model(base, seed=3), IDS), atol=1e-5)
    assert read_output_token_ids(registry.materialize("1")) == list(range(259))          # the parent keeps its own

    # an older candidate without vocabulary.json, trained on version 2: version 2's vocabulary
    v3 = registry.register_candidate(make_candidate(tmp_path / "c3", d2, parent_version=v2, seed=4))
    assert registry.get(v3).tags["draftsmith.vocab_sha256"] == vocabulary_digest(v2_ids)
    assert "vocabulary.json" not in json.loads((artifact_dir(registry, v3) / "manifest.json").read_text())
    assert read_output_token_ids(registry.materialize(v3)) == v2_ids
    # null: the full vocabulary (the key is removed, the rest of draftsmith.json stays)
    v4 = registry.register_candidate(_with_vocabulary(make_candidate(tmp_path / "c4", base, seed=5), None))
    assert registry.get(v4).tags["draftsmith.vocab_size"] == "full"
    d4 = registry.materialize(v4)
    assert read_output_token_ids(d4) is None
    assert json.loads((d4 / "draftsmith.json").read_text())["built_by"] == "tests"

    # the stored vocabulary is verified like every other artifact
    (stored / "vocabulary.json").write_text(json.dumps({"output_token_ids": list(range(259))}))
    shutil.rmtree(registry.cache_root)
    with pytest.raises(ArtifactError, match="vocabulary.json.* corrupt"):
        registry.materialize(v2)
    with pytest.raises(ArtifactError, match="vocabulary.json.* corrupt"):
        registry.promote(v3)                                              # its parent's is part of its chain


def test_vocabulary_beyond_the_output_layer_is_refused(registry, base, tmp_path):
    registry.register_base(base)
    v = registry.register_candidate(_with_vocabulary(make_candidate(tmp_path / "c", base), [0, 5, 300]))
    with pytest.raises(ArtifactError, match="token id 300, beyond the 259 rows"):
        registry.materialize(v)
    with pytest.raises(ArtifactError, match="token id 300"):
        registry.promote(v)
    assert registry.aliases() == {CANDIDATE: v}


def test_promote_and_rollback_move_aliases_idempotently(registry, base, tmp_path):
    registry.register_base(base)
    assert registry.promote("1").changed
    registry.register_candidate(make_candidate(tmp_path / "c", base, parent_version="1"))
    move = registry.promote("2", reason="test")
    assert move.changed and move.champion == "2" and move.old_champion == "1"
    assert registry.aliases() == {CHAMPION: "2", PREVIOUS: "1"}         # `candidate` is cleared once promoted
    again = registry.promote("2")
    assert not again.changed and registry.aliases() == {CHAMPION: "2", PREVIOUS: "1"}

    back = registry.rollback(reason="bad live acceptance")
    assert back.changed and back.champion == "1" and back.old_champion == "2"
    assert registry.aliases() == {CHAMPION: "1"}
    assert registry.get("2").tags["draftsmith.rolled_back_to"] == "1"
    assert registry.get("2").tags["draftsmith.rollback_reason"] == "bad live acceptance"
    assert registry.champion_since_ms(registry.get("1")) >= registry.champion_since_ms(registry.get("2"))
    again = registry.rollback()
    assert not again.changed and "already rolled back" in again.message
    assert registry.aliases() == {CHAMPION: "1"}

    fwd = registry.rollback(to="2")
    assert fwd.changed and registry.champion() == "2"
    assert not registry.rollback(to="v2").changed and registry.champion() == "2"
    actions = [(h["action"], h.get("version") or h.get("to")) for h in registry.history()]
    assert actions == [("promote", "1"), ("register", "2"), ("promote", "2"), ("rollback", "1"), ("pause", None),
                       ("rollback", "2"), ("pause", None)]


def test_rollback_with_nothing_recorded_says_what_to_do(registry, base):
    registry.register_base(base)
    registry.promote("1")
    with pytest.raises(UsageError, match="--to VERSION"):
        registry.rollback()
    with pytest.raises(UsageError, match="not registered .*registered versions: 1"):
        registry.rollback(to="7")
    assert registry.aliases() == {CHAMPION: "1"}


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupt_or_missing_artifacts_are_refused_and_aliases_unchanged(registry, base, tmp_path):
    registry.register_base(base)
    registry.promote("1")
    registry.register_candidate(make_candidate(tmp_path / "c", base, parent_version="1"))
    weights = artifact_dir(registry, "2") / "adapter" / "adapter_model.safetensors"
    _flip_byte(weights)
    before = registry.aliases()
    with pytest.raises(ArtifactError, match="adapter_model.safetensors.* corrupt"):
        registry.promote("2")
    assert registry.aliases() == before
    weights.unlink()
    with pytest.raises(ArtifactError, match="missing"):
        registry.materialize("2")

    # a cached, previously good version whose stored artifacts rot is refused too (other
    # machines materialise from the store, not from this cache)
    registry.register_candidate(make_candidate(tmp_path / "c3", base, parent_version="1", seed=5))
    registry.promote("3")
    assert registry.aliases()[PREVIOUS] == "1"
    _flip_byte(artifact_dir(registry, "1") / "draft" / "model.safetensors")
    state = registry.aliases()
    with pytest.raises(ArtifactError, match="version 1 .*model.safetensors.* corrupt"):
        registry.rollback()
    assert registry.aliases() == state
    with pytest.raises(ArtifactError, match="version 1"):
        registry.rollback(to="1")
    assert registry.aliases() == state


def test_candidate_folder_errors_are_usage_errors(registry, base, tmp_path):
    registry.register_base(base)
    with pytest.raises(UsageError, match="does not exist"):
        registry.register_candidate(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UsageError, match="no candidate.json"):
        registry.register_candidate(empty)
    with pytest.raises(UsageError, match="neither a distillation candidate"):
        registry.register(empty)
    cand = make_candidate(tmp_path / "c", base, parent_version="1")
    meta = json.loads((cand / "candidate.json").read_text())

    (cand / "candidate.json").write_text("{not json")
    with pytest.raises(UsageError, match="not valid JSON"):
        registry.register_candidate(cand)
    for patch, pattern in (({"parent_version": None}, "no parent_version"),
                           ({"parent_version": "5"}, "version 5 is not registered"),
                           ({"target": "/x/other-model"}, "trained for target"),
                           ({"metrics": [1, 2]}, "'metrics' must be a JSON object")):
        (cand / "candidate.json").write_text(json.dumps({**meta, **patch}))
        with pytest.raises(UsageError, match=pattern):
            registry.register_candidate(cand)
    (cand / "candidate.json").write_text(json.dumps(meta))
    for doc, pattern in (("[1, 2", "vocabulary.json is not valid JSON"),
                         (json.dumps({"ids": [1, 2]}), "with output_token_ids"),
                         (json.dumps({"output_token_ids": [1, 2, 2]}), "lists a token id twice"),
                         (json.dumps({"output_token_ids": [1, -2]}), "non-negative integer"),
                         (json.dumps({"output_token_ids": [1, 2.5]}), "non-negative integer"),
                         (json.dumps({"output_token_ids": []}), "non-empty list")):
        (cand / "vocabulary.json").write_text(doc)
        with pytest.raises(UsageError, match=pattern):
            registry.register_candidate(cand)
    (cand / "vocabulary.json").unlink()
    (cand / "adapter" / "adapter_model.safetensors").unlink()
    with pytest.raises(UsageError, match="adapter_model.safetensors is missing"):
        registry.register_candidate(cand)
    with pytest.raises(UsageError, match="positive integer"):
        registry.get("latest")
    assert [v.version for v in registry.versions()] == ["1"]


def test_live_stats_one_run_per_version_over_time(registry):
    clock = [1000.0]
    live = LiveStatsLogger(registry=registry, interval_s=5, clock=lambda: clock[0])
    for accepted, drafted, steps in ((3, 4, 1), (1, 4, 1)):
        live.observe({"draft_version": "1", "accepted_tokens": accepted, "draft_tokens": drafted, "steps": steps,
                      "tokens": accepted + 1, "wall_time_s": 0.5, "energy_j": None})
    live.update("2", LiveAggregate(acceptance_rate=0.8, mean_accepted_length=3.2, tokens_per_s=40.0,
                                   joules_per_token=0.25, requests=3, tokens=90))
    assert live.flush() == 8 + 6                                 # observed sums also log their 3 counts
    assert live.flush() == 0                                     # nothing new since
    clock[0] += 30
    live.observe({"draft_version": "1", "accepted_tokens": 4, "draft_tokens": 4, "steps": 1, "tokens": 5,
                  "wall_time_s": 0.25, "energy_j": 1.0})
    assert live.flush() == 9

    client = registry.client
    exp = client.get_experiment_by_name("draftsmith-live")
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {"live-v1", "live-v2"}
    hist = client.get_metric_history(runs["live-v1"].info.run_id, "acceptance_rate")
    assert [m.value for m in hist] == pytest.approx([4 / 8, 4 / 4])
    assert hist[1].step - hist[0].step == 30                      # step = seconds since the run started
    tps = client.get_metric_history(runs["live-v1"].info.run_id, "tokens_per_s")
    assert tps[0].value == pytest.approx(6 / 1.0)
    jpt = client.get_metric_history(runs["live-v1"].info.run_id, "joules_per_token")
    assert [m.value for m in jpt] == pytest.approx([1.0 / 5])      # first interval had no energy figure
    assert client.get_run(runs["live-v2"].info.run_id).data.metrics["mean_accepted_length"] == pytest.approx(3.2)
    # the counts behind the rates, read back per interval (what the watchdog weighs them by)
    got = registry.live_intervals("1")
    assert [(i["draft_tokens"], i["accepted_tokens"]) for i in got] == [(8, 4), (4, 4)]
    assert [i["time_ms"] for i in got] == [1_000_000, 1_030_000]
    assert registry.live_intervals("1", since_ms=1_010_000) == got[1:]
    assert registry.live_intervals("1", until_ms=1_010_000) == got[:1]
    assert "draft_tokens" not in registry.live_intervals("2")[0]     # a ready aggregate: rates only
    assert registry.live_intervals("9") == []
    # a new logger (e.g. after a restart) keeps using the same run per version
    live2 = LiveStatsLogger(registry=registry, interval_s=5, clock=lambda: clock[0])
    live2.update("2", LiveAggregate(0.7, 3.0, 41.0))
    live2.flush()
    assert len(client.search_runs([exp.experiment_id])) == 2


def test_live_stats_thread_flushes_on_interval(registry):
    live = LiveStatsLogger(registry=registry, interval_s=0.2).start()
    live.update("1", LiveAggregate(0.5, 2.0, 10.0))
    deadline = time.time() + 20
    client = registry.client
    while time.time() < deadline:
        exp = client.get_experiment_by_name("draftsmith-live")
        if exp and client.search_runs([exp.experiment_id]):
            break
        time.sleep(0.1)
    live.stop()
    exp = client.get_experiment_by_name("draftsmith-live")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.data.metrics["acceptance_rate"] == pytest.approx(0.5)


def test_only_registry_imports_mlflow():
    code = ("import sys, deploy.registry, deploy.gate, deploy.scheduler, deploy.cli; "
            "print(sorted(m for m in ('mlflow', 'torch', 'peft', 'ray', 'redis') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_against_mlflow_server_backed_by_postgresql(tmp_path, monkeypatch):
    """The same registry code against `mlflow server` on the local PostgreSQL (proxied artifacts)."""
    import signal
    import urllib.request
    import uuid

    psycopg = pytest.importorskip("psycopg", reason="psycopg is in the test extra")
    admin = "postgresql://postgres@127.0.0.1:5432/postgres"
    try:
        conn = psycopg.connect(admin, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as e:
        pytest.skip(f"no PostgreSQL at 127.0.0.1:5432 ({e})")
    db = f"draftsmith_test_{uuid.uuid4().hex[:10]}"
    conn.execute(f'CREATE DATABASE "{db}"')
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"postgresql://postgres@127.0.0.1:5432/{db}",
         "--artifacts-destination", str(tmp_path / "server-artifacts"), "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "server.log", "wb"), start_new_session=True,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 90
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.time() < deadline, "mlflow server did not come up in 90 s"
            time.sleep(0.3)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
        reg = Registry("tiny-target", cache_root=tmp_path / "cache")        # picks the server up from the env
        assert reg.tracking_uri == url and reg.artifact_root is None
        base = make_base_draft(tmp_path / "base")
        reg.register_base(base)
        reg.promote("1")
        ids = sorted(set(range(0, 256, 5)) | {256, 257, 258})
        reg.register_candidate(_with_vocabulary(make_candidate(tmp_path / "c", base, parent_version="1", seed=2), ids))
        assert reg.promote("2").changed and reg.aliases() == {CHAMPION: "2", PREVIOUS: "1"}
        merged = reg.materialize("2")                                      # downloaded through the server
        assert torch.allclose(_logits(merged, IDS), _logits(lora_model(base, seed=2), IDS), atol=1e-5)
        assert json.loads((merged / "draftsmith.json").read_text())["output_token_ids"] == ids
        assert reg.rollback().changed and reg.champion() == "1"
        assert not reg.rollback().changed
        # the server's artifact store is what promotion checks
        stored = next((tmp_path / "server-artifacts").rglob("adapter/adapter_model.safetensors"))
        _flip_byte(stored)
        with pytest.raises(PromotionsPaused):                              # the rollback paused promotion
            reg.promote("2")
        with pytest.raises(ArtifactError, match="corrupt"):
            reg.promote("2", ignore_pause=True)
        assert reg.aliases() == {CHAMPION: "1"}
        live = LiveStatsLogger(registry=reg, interval_s=1)
        live.update("1", LiveAggregate(0.6, 2.4, 30.0))
        assert live.flush() == 5
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        conn.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
        conn.close()


# ----------------------------------------------------------------------------- issue 17: faults, locks, pins
def _dead_uri() -> str:
    return f"http://127.0.0.1:{_free_port()}"          # nothing listens there


def test_an_outage_is_not_an_answer(registry, base, tmp_path, monkeypatch):
    """A missing model reads as "nothing registered"; an unreachable MLflow raises RegistryUnavailable from
    every read a replica or the scheduler decides on, instead of "no champion" / "not paused"."""
    assert registry.aliases() == {} and registry.champion() is None and registry.promotions_paused() is None
    assert registry.history() == [] and registry.versions() == []
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    dead = Registry("tiny-target", tracking_uri=_dead_uri(), cache_root=tmp_path / "cache",
                    lock_path=tmp_path / "dead.lock")
    for read in (dead.aliases, dead.champion, dead.promotions_paused, dead.history, dead.versions, dead.exists,
                 lambda: dead.get("1"), lambda: dead.live_intervals("1")):
        with pytest.raises(RegistryUnavailable, match="MLflow unavailable"):
            read()
    with pytest.raises(RegistryUnavailable):
        dead.promote("1")                                   # fails closed, no alias written anywhere
    # a SQLite store whose file turned into garbage is an outage too (not "no versions")
    registry.register_base(base)
    registry.promote("1")
    db = Path(registry.tracking_uri[len("sqlite:///"):])
    broken = Registry("tiny-target", tracking_uri=f"sqlite:///{tmp_path / 'garbage.db'}", cache_root=tmp_path / "c2")
    (tmp_path / "garbage.db").write_bytes(b"this is not a database" * 100)
    with pytest.raises(RegistryUnavailable):
        broken.champion()
    assert db.exists() and registry.champion() == "1"


def test_promote_refuses_while_paused_and_when_the_pause_cannot_be_read(registry, base, tmp_path):
    registry.register_base(base)
    registry.promote("1")
    registry.register_candidate(make_candidate(tmp_path / "c", base, parent_version="1"))
    registry.pause_promotions("operator says stop")
    with pytest.raises(PromotionsPaused, match="operator says stop"):
        registry.promote("2")
    assert registry.champion() == "1"
    assert registry.promote("2", ignore_pause=True).changed and registry.champion() == "2"


def test_alias_moves_are_serialised_across_processes(registry, base, tmp_path):
    """While this process holds the alias lock, a promotion in another process waits (and moves nothing);
    released, it goes through. Then two processes promoting at once never lose an update: each recorded
    move starts from the champion the previous one left."""
    registry.register_base(base)
    registry.promote("1")
    for i in (2, 3, 4):
        registry.register_candidate(make_candidate(tmp_path / f"c{i}", base, parent_version="1", seed=i))
    for v in ("2", "3", "4"):
        registry.materialize(v)                              # warm the cache: the children only move aliases
    script = (f"import sys; from deploy.registry import Registry; "
              f"r = Registry('tiny-target', tracking_uri={registry.tracking_uri!r}, "
              f"cache_root={str(registry.cache_root)!r}); "
              f"[print(r.promote(v, reason='proc').message, flush=True) for v in sys.argv[1:]]")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    held = AliasLock(registry.alias_lock.path)
    with held:
        proc = subprocess.Popen([sys.executable, "-c", script, "2"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        time.sleep(8)                                        # it started, imported MLflow, and waits on the lock
        assert proc.poll() is None and registry.champion() == "1"
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "version 2 is now the champion" in out and registry.champion() == "2"

    a = subprocess.Popen([sys.executable, "-c", script, "3", "4", "3"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    b = subprocess.Popen([sys.executable, "-c", script, "4", "3", "4"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    for p in (a, b):
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
    moves = [h for h in registry.history() if h["action"] == "promote"]
    for before, after in zip(moves, moves[1:]):
        assert after["from"] == before["version"], moves          # no move started from a stale champion
    assert registry.alias(PREVIOUS) == moves[-1]["from"] and registry.champion() == moves[-1]["version"]


def test_target_fingerprint_is_computed_once_and_pins_versions(tmp_path, monkeypatch, registry, base):
    import buffer.fingerprint as R
    from tests.tiny_models import save_pair

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache-home"))
    target, _ = save_pair(tmp_path / "pair")
    hashed = []
    real = R._sha256
    monkeypatch.setattr(R, "_sha256", lambda p: (hashed.append(Path(p).name), real(p))[1])
    sha = target_fingerprint(target)
    assert len(sha) == 64 and "model.safetensors" in hashed and "tokenizer.json" in hashed
    hashed.clear()
    assert target_fingerprint(str(target)) == sha and hashed == []          # memory cache: stat() only
    R._FINGERPRINTS.clear()
    assert target_fingerprint(target) == sha and hashed == []               # the on-disk cache
    assert json.loads((tmp_path / "cache-home" / "target-fingerprints.json").read_text())
    cfg = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**cfg, "transformers_version": "9.9.9"}))
    assert target_fingerprint(target) == sha                                # re-saved by another version
    _flip_byte(target / "model.safetensors")
    assert target_fingerprint(target) not in (sha, None)                    # other weights: another target
    assert target_fingerprint(tmp_path / "nowhere") is None

    pinned = Registry(str(target), tracking_uri=registry.tracking_uri, cache_root=registry.cache_root)
    v1 = pinned.register_base(base)
    assert pinned.get(v1).target_sha256 == target_fingerprint(target)      # the registry's target, by default
    v2 = pinned.register_candidate(make_candidate(tmp_path / "c", base, parent_version=v1, target=str(target),
                                                  target_sha256="a" * 64))
    assert pinned.get(v2).target_sha256 == "a" * 64                         # what the job wrote
