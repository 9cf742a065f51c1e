"""Distillation end to end on tiny models: records made by actually serving (Engine + ReplayBufferWriter
into the test run's real Redis under a unique prefix: tests/conftest.py `redis_url`), data rebuilding, packed training,
offline acceptance, the job (consumer group acks, candidate folder, MLflow run on a temp SQLite
store, registry round trip) and the Ray entry point.

Each job test uses its own consumer group, so they share one served buffer.
"""
from __future__ import annotations

import hashlib
import json
import types
import uuid

import numpy as np
import pytest
import torch

from buffer.redis_store import BufferConfig, ReplayBufferReader, ReplayBufferWriter, connect
from tests.deploy_helpers import artifact_dir, fresh_store, template_db
from serving.config import SamplingParams, SpecParams
from serving.controller import CostModel
from serving.engine import Engine
from serving.runner import SequenceRunner
from tests.tiny_models import save_pair
from training import data, distill
from deploy.distill_job import run_job
from training.job import NotEnoughRecords, main, parse_config, pending_records, run_distillation


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine two spinning
    OpenMP threads per process make a tiny forward pass up to 30x slower (measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


FRACTION = 0.25
HELD = {0, 1, 10, 11}                       # request indices that are held out (2 per source)


def pick_id(i: int, heldout: bool) -> str:
    """A request id whose held-out membership is `heldout` (the split is a hash of the id)."""
    return next(rid for salt in range(10_000)
                if data.is_heldout(rid := f"req-{i}-{salt}", FRACTION) == heldout)


@pytest.fixture(scope="module")
def served(tmp_path_factory, redis_url):
    """16 requests served with speculative sampling: source "a" at temperature 1, "b" greedy. The
    draft restricts its output vocabulary (draftsmith.json), as the bootstrap draft does. Fixed gamma: the
    adaptive controller plans seeded greedy requests from the replica's measured step times, which would make
    the records (and every figure the tests below compute from them) depend on the machine's load."""
    root = tmp_path_factory.mktemp("distill")
    target, draft = save_pair(root)
    keep = [i for i in range(259) if i % 7 != 3 or i >= 256]
    (draft / "draftsmith.json").write_text(json.dumps({"output_token_ids": keep}))
    cfg = BufferConfig(prefix=f"test:distill:{uuid.uuid4().hex[:10]}", flush_interval_s=0.002)
    writer = ReplayBufferWriter(redis_url, cfg)
    engine = Engine.from_paths(str(target), str(draft), sink=writer, draft_version="1", dtype=torch.float32)
    ids = {}
    for i in range(16):
        source = "a" if i < 10 else "b"
        ids[i] = pick_id(i, i in HELD)
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{source} prompt {i}: add {i} and {2 * i}"}], add_generation_prompt=True,
            tokenize=True, return_dict=False)
        engine.generate_all(prompt, SamplingParams(temperature=1.0 if source == "a" else 0.0, max_tokens=24, seed=i),
                            SpecParams(mode="speculative", gamma=4, adaptive=False), request_id=ids[i], source=source)
    writer.close()
    reader = ReplayBufferReader(redis_url, cfg)
    steps = reader.newest(10_000)
    seqs = reader.get_sequences({e.record.request_id for e in steps})
    yield types.SimpleNamespace(target=target, draft=draft, engine=engine, url=redis_url, prefix=cfg.prefix,
                                config=cfg, steps=steps, seqs=seqs, keep=keep, root=root,
                                heldout_ids={ids[i] for i in HELD}, train_ids={ids[i] for i in ids if i not in HELD})
    client = connect(redis_url)
    keys = list(client.scan_iter(match=f"{cfg.prefix}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return template_db(tmp_path_factory.mktemp("mlflow-template"))


def job_cfg(served, tmp_path, **over) -> dict:
    cfg = {"base_draft_path": str(served.draft), "parent_version": "1", "target": "tiny-target",
           "redis_url": served.url, "buffer_prefix": served.prefix, "group": f"g-{uuid.uuid4().hex[:8]}",
           "heldout_fraction": FRACTION, "claim_idle_ms": 0, "lr": 2e-2, "steps": 40, "batch_tokens": 1024,
           "min_records": 8, "out_dir": str(tmp_path / "candidate"), "mlflow": False, "log_every": 20}
    return {**cfg, **over}


def train_steps(served):
    return [e for e in served.steps if e.record.request_id in served.train_ids]


@pytest.fixture
def seen(monkeypatch):
    """Request ids of the units each job trains on and evaluates on (spies on training.distill)."""
    got = types.SimpleNamespace(trained=set(), evaluated=set())
    real_train, real_eval = distill.train, distill.offline_acceptance

    def train(draft, units, *a, **k):
        got.trained |= {u.request_id for u in units}
        return real_train(draft, units, *a, **k)

    def offline_acceptance(draft, units, *a, **k):
        got.evaluated |= {u.request_id for u in units}
        return real_eval(draft, units, *a, **k)

    monkeypatch.setattr(distill, "train", train)
    monkeypatch.setattr(distill, "offline_acceptance", offline_acceptance)
    return got


def pending_ids(served, group: str) -> set[str]:
    client = connect(served.url)
    try:
        rows = client.xpending_range(served.config.steps_key, group, min="-", max="+", count=100_000)
    finally:
        client.close()
    return {r["message_id"].decode() if isinstance(r["message_id"], bytes) else r["message_id"] for r in rows}


# ----------------------------------------------------------------------------- data
def test_units_rebuild_every_steps_context_from_its_sequence(served):
    """The tokens each scored row sees (through the tree mask) are exactly seq[:position] + draft[:i]
    (left-truncated to its chunk), at consecutive positions; chunking and branches are exercised."""
    units, skipped = data.build_units(served.steps, served.seqs, max_len=40)
    assert not skipped
    by_id = {e.stream_id: e.record for e in served.steps}
    assert sum(len(u.stream_ids) for u in units) == len(served.steps)
    assert len(units) > len({e.record.request_id for e in served.steps})        # long requests were chunked
    assert any((u.branch >= 0).any() for u in units)                             # rejected suffixes as branches
    rows = 0
    for u in units:
        assert u.num_tokens <= 40
        mask = u.attention_mask()
        seq = served.seqs[u.request_id].token_ids
        for r in range(u.num_rows):
            st = by_id[u.stream_ids[u.row_step[r]]]
            i = int(u.row_offset[r])
            visible = np.flatnonzero(mask[u.row_index[r]])
            expected = list(seq[u.seq_start: st.position]) + list(st.draft_tokens[:i])
            assert u.input_ids[visible].tolist() == [int(t) for t in expected]
            assert u.position_ids[visible].tolist() == list(range(len(expected)))
            np.testing.assert_array_equal(u.target_ids[r], st.target_topk_ids[i])
            np.testing.assert_array_equal(u.target_logprobs[r], st.target_topk_logprobs[i].astype(np.float32))
            assert len(expected) >= min(st.position, 40 // 2)                    # left context kept
        rows += u.num_rows
    assert rows == sum(len(e.record.draft_tokens) + 1 for e in served.steps)    # all gamma + 1 rows


def test_accepted_rows_mode_keeps_rows_up_to_the_first_rejection(served):
    units, _ = data.build_units(served.steps, served.seqs, rows="accepted")
    by_id = {e.stream_id: e.record for e in served.steps}
    counts = {}
    for u in units:
        for s in u.row_step:
            counts[u.stream_ids[s]] = counts.get(u.stream_ids[s], 0) + 1
    for sid, n in counts.items():
        st = by_id[sid]
        assert n == st.num_accepted + 1
    with pytest.raises(ValueError, match="rows must be"):
        data.build_units(served.steps, served.seqs, rows="some")


def test_packed_rows_equal_the_served_drafts_logits(served):
    """One packed forward gives, for every row, the logits the serving engine computes for that
    context (reduced output vocabulary, scattered back with -inf elsewhere)."""
    units, _ = data.build_units(served.steps[:40], served.seqs, max_len=40)
    draft = distill.Draft(served.draft, lora_r=None)
    engine = served.engine
    outside = torch.ones(engine.vocab_size, dtype=torch.bool)
    outside[draft.out_rows] = False
    by_id = {e.stream_id: e.record for e in served.steps}
    worst = 0.0
    for u in units:
        with torch.no_grad():
            logits = draft.row_logits(draft.collate([u]))
        seq = served.seqs[u.request_id].token_ids
        for r in range(u.num_rows):
            st = by_id[u.stream_ids[u.row_step[r]]]
            ctx = [int(t) for t in list(seq[u.seq_start: st.position]) + list(st.draft_tokens[:u.row_offset[r]])]
            full = SequenceRunner(engine.draft, engine.vocab_size).feed(ctx, keep=1)[-1]
            assert torch.isinf(full[outside]).all()
            worst = max(worst, float((full[draft.out_rows] - logits[r]).abs().max()))
    assert worst < 1e-4


def test_heldout_split_is_a_fixed_hash_of_the_request_id():
    for rid in ("a", "req-7", "0f3c"):
        h = int.from_bytes(hashlib.sha256(rid.encode()).digest()[:8], "big") / 2 ** 64
        assert data.is_heldout(rid, 0.3) == (h < 0.3)
    share = np.mean([data.is_heldout(f"r{i}", 0.1) for i in range(20_000)])
    assert 0.09 < share < 0.11                                   # binomial sd 0.002
    with pytest.raises(ValueError, match="heldout_fraction"):
        data.is_heldout("x", 1.0)


def test_windows_separate_training_and_heldout_records(served):
    reader = ReplayBufferReader(served.url, served.config, group=f"g-{uuid.uuid4().hex[:8]}")
    window = data.read_training_window(reader, max_records=10_000, heldout_fraction=FRACTION)
    assert {e.record.request_id for e in window.entries} == served.train_ids
    assert window.skipped["held out"] == len(served.steps) - len(window.entries)
    assert reader.pending() == len(window.entries)             # used records wait for their ack
    summary = window.summary(served.config.steps_key)
    assert summary["steps"] == len(window.entries) and summary["sources"] == {
        "a": sum(served.seqs[e.record.request_id].source == "a" for e in window.entries),
        "b": sum(served.seqs[e.record.request_id].source == "b" for e in window.entries)}

    held, seqs = data.heldout_window(reader, 1000, heldout_fraction=FRACTION)
    assert {e.record.request_id for e in held} == served.heldout_ids
    keys = [data.stream_id_key(e.stream_id) for e in held]
    assert keys == sorted(keys, reverse=True)                  # newest first
    held_b, seqs_b = data.heldout_window(reader, 3, heldout_fraction=FRACTION, source="b")
    assert len(held_b) == 3 and {s.source for s in seqs_b.values()} == {"b"}


def test_gate_sample_reaches_back_for_a_category_the_newest_steps_crowd_out(served):
    """After a traffic shift the newest held-out steps are all the new category; the gate's sample
    (stratified_heldout, EvidenceSource) tops each category met up to `category_floor` requests with older
    held-out steps, whole requests, newest first, so the per-category regression test still sees the old one."""
    from deploy.gate import EvidenceSource

    reader = ReplayBufferReader(served.url, served.config)
    held, seqs = data.heldout_window(reader, 1000, heldout_fraction=FRACTION)
    newest = held[0].record.request_id
    assert seqs[newest].source == "b"                          # "b" was served after "a"
    n = sum(e.record.request_id == newest for e in held)
    plain, plain_seqs = data.heldout_window(reader, n, heldout_fraction=FRACTION)
    assert {s.source for s in plain_seqs.values()} == {"b"}

    same, _ = data.stratified_heldout(reader, n, heldout_fraction=FRACTION, category_floor=0)
    assert [e.stream_id for e in same] == [e.stream_id for e in plain]
    one, one_seqs = data.stratified_heldout(reader, n, heldout_fraction=FRACTION, category_floor=1)
    assert [e.stream_id for e in one[:n]] == [e.stream_id for e in plain]
    a_ids = {r for r, sq in one_seqs.items() if sq.source == "a"}
    assert len(a_ids) == 1                                     # the newest held-out "a" request, whole
    (a_id,) = a_ids
    assert [e.stream_id for e in one if e.record.request_id == a_id] == \
        [e.stream_id for e in held if e.record.request_id == a_id]
    keys = [data.stream_id_key(e.stream_id) for e in one]
    assert keys == sorted(keys, reverse=True) and len(set(keys)) == len(keys)
    two, two_seqs = data.stratified_heldout(reader, n, heldout_fraction=FRACTION, category_floor=2)
    assert {e.record.request_id for e in two} == served.heldout_ids      # both requests of both categories
    with pytest.raises(ValueError, match="category_floor"):
        data.stratified_heldout(reader, n, heldout_fraction=FRACTION, category_floor=-1)

    def sample(floor):
        return EvidenceSource(redis_url=served.url, buffer_prefix=served.prefix, heldout_fraction=FRACTION,
                              records=n, category_floor=floor).collect(served.draft, served.draft)
    assert set(sample(0).categories) == {"b"}
    assert sorted(sample(1).categories) == ["a", "b"]


# ----------------------------------------------------------------------------- acceptance and training
def test_row_acceptance_and_expected_length_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]))     # draft, vocabulary 3
    cols = torch.tensor([[0, 1], [2, -1]])                                    # -1: the draft cannot emit it
    lps = torch.log(torch.tensor([[0.4, 0.4], [0.5, 0.25]]))                 # raw target top-2
    alpha = distill.row_acceptance(logits, cols, lps, 1.0, 0, 1.0)
    # target renormalised over its top-2: [0.5, 0.5] and [2/3, 1/3]
    torch.testing.assert_close(alpha, torch.tensor([0.5 + 0.3, 2 / 3]))
    greedy = distill.row_acceptance(logits, cols, lps, 0.0, 20, 0.9)
    torch.testing.assert_close(greedy, torch.tensor([1.0, 1.0]))             # argmax 0 == 0, 2 == 2
    greedy_miss = distill.row_acceptance(logits, torch.tensor([[1, 0], [0, 1]]), lps, 0.0, 20, 0.9)
    torch.testing.assert_close(greedy_miss, torch.tensor([0.0, 0.0]))
    assert distill.expected_accepted_length([0.5] * 5) == pytest.approx(0.5 + 0.25 + 0.125 + 0.0625)
    assert distill.expected_accepted_length([1.0, 0.0, 1.0]) == 1.0


def test_lora_training_raises_offline_acceptance(served):
    """A 1-layer random draft against a 2-layer random target starts near 0.06 offline acceptance;
    40 LoRA steps on ~450 records reach ~0.1 (measured), so +0.02 is a safe floor for a real gain."""
    units, _ = data.build_units(train_steps(served), served.seqs)
    held = [e for e in served.steps if e.record.request_id in served.heldout_ids]
    eval_units, _ = data.build_units(held, served.seqs)
    draft = distill.Draft(served.draft, lora_r=16)
    frozen = {n: p.detach().clone() for n, p in draft.model.named_parameters() if "lora_" not in n}
    before = distill.offline_acceptance(draft, eval_units)
    report = distill.train(draft, units, distill.TrainConfig(lr=2e-2, steps=40, batch_tokens=1024, log_every=20),
                           progress=lambda s: None)
    after = distill.offline_acceptance(draft, eval_units)
    assert after.acceptance > before.acceptance + 0.02
    assert after.expected_accepted_length > before.expected_accepted_length
    assert set(after.by_source) == {"a", "b"} and after.positions == sum(len(e.record.draft_tokens) for e in held)
    assert report.steps == 40 and report.tokens_per_s > 0 and report.loss_final < report.loss_first
    for n, p in draft.model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), f"{n} changed but only LoRA weights may train"


# ----------------------------------------------------------------------------- the job
def test_job_candidate_registers_and_materializes_to_a_loadable_draft(served, template, tmp_path, monkeypatch, seen):
    from mlflow.tracking import MlflowClient

    from deploy.registry import Registry, read_candidate

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = fresh_store(template, tmp_path / "data")
    registry = Registry("tiny-target", tracking_uri=uri, cache_root=tmp_path / "cache")
    assert registry.register_base(served.draft) == "1"
    cfg = job_cfg(served, tmp_path, mlflow=True, tracking_uri=uri)
    out = run_job(cfg, progress=lambda s: None)                   # the job with its MLflow run, as deploy runs it
    assert seen.trained == served.train_ids and seen.evaluated == served.heldout_ids   # held out: never trained on

    assert sorted(p.name for p in out.iterdir()) == ["adapter", "candidate.json", "vocabulary.json"]
    chosen = json.loads((out / "vocabulary.json").read_text())["output_token_ids"]
    assert len(chosen) == len(served.keep) and {256, 257, 258} <= set(chosen)   # parent's size, specials kept
    adapter = out / "adapter" / "adapter_model.safetensors"
    assert (out / "adapter" / "adapter_config.json").is_file() and 0 < adapter.stat().st_size < 5e6
    meta = read_candidate(out)
    assert meta["loss"] == "jsd" and meta["parent_version"] == "1" and meta["train_config"]["lora_r"] == 64
    m = meta["metrics"]
    assert m["offline_acceptance_after"] > m["offline_acceptance_before"]
    assert m["heldout_records"] == sum(e.record.request_id in served.heldout_ids for e in served.steps)
    assert m["train_tokens_per_s"] > 0 and m["peak_rss_mb"] > 100
    used = train_steps(served)
    assert meta["data_window"]["steps"] == len(used)
    assert meta["data_window"]["last_id"] == max((e.stream_id for e in used), key=data.stream_id_key)
    reader = ReplayBufferReader(served.url, served.config, group=cfg["group"])
    assert reader.pending() == 0                                   # every trained record acked

    version = registry.register_candidate(out)
    assert registry.last_data_window()["last_id"] == meta["data_window"]["last_id"]
    from deploy.gate import GatePolicy, judge_acceptance               # the gate reads the job's metric names
    ok, reason, cand, champ = judge_acceptance(registry.get(version), "1", GatePolicy(margin=1e-3))
    assert ok, reason
    assert (cand, champ) == pytest.approx((m["offline_acceptance_after"], m["offline_acceptance_before"]))
    merged = registry.materialize(version)
    engine = Engine.from_paths(str(served.target), str(merged), dtype=torch.float32)
    res = engine.generate_all([72, 105], SamplingParams(temperature=0.0, max_tokens=8), SpecParams(gamma=4))
    assert len(res.token_ids) == 8
    # the merged folder computes what the trained adapter computed
    units, _ = data.build_units(used[:10], served.seqs)
    tuned = distill.Draft(served.draft, lora_r=None, adapter=out / "adapter", output_token_ids=chosen)
    plain = distill.Draft(merged, lora_r=None)
    assert plain.output_token_ids == chosen                            # the candidate's rows, not the parent's
    with torch.no_grad():
        torch.testing.assert_close(plain.row_logits(plain.collate(units)), tuned.row_logits(tuned.collate(units)),
                                   rtol=1e-4, atol=1e-4)

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("draftsmith-distill").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.metrics["offline_acceptance_after"] == pytest.approx(m["offline_acceptance_after"])
    assert runs[0].data.params["loss"] == "jsd"
    history = client.get_metric_history(runs[0].info.run_id, "loss")
    assert [h.step for h in history][:2] == [20, 40]


def test_job_reports_its_run_through_the_tracker_it_is_given(served, tmp_path):
    """training/ has no MLflow client: the job starts, logs and finishes its run through the JobTracker factory
    it is handed (deploy/distill_job.py hands it the MLflow one). A failed job finishes its run FAILED with the
    error; `mlflow: false` starts no run."""
    calls = []

    class Recorder:
        run_id = "run-1"

        def log(self, step, metrics):
            calls.append(("log", step))

        def finish(self, status, tags=None):
            calls.append(("finish", status, dict(tags or {})))

    def factory(name, params, tags):
        calls.append(("start", name, params["loss"], tags["draftsmith.parent_version"]))
        return Recorder()

    cfg = job_cfg(served, tmp_path, mlflow=True, min_records=10 ** 6)
    with pytest.raises(NotEnoughRecords):
        run_distillation(cfg, progress=lambda s: None, tracker=factory)
    assert calls[0] == ("start", "distill-from-v1", "jsd", "1")
    assert calls[-1][:2] == ("finish", "FAILED") and "NotEnoughRecords" in calls[-1][2]["draftsmith.error"]
    calls.clear()
    with pytest.raises(NotEnoughRecords):
        run_distillation({**cfg, "mlflow": False, "group": f"g-{uuid.uuid4().hex[:8]}"}, progress=lambda s: None,
                         tracker=factory)
    assert calls == []


def test_job_vocabulary_round_trips_through_registry_engine_trainer_and_gate(served, template, tmp_path,
                                                                            monkeypatch):
    """A job re-chooses the output vocabulary from its window: the tokens the window's target top-k
    uses most, all outside the parent's vocabulary, enter; the candidate carries the chosen ids; the
    registry stores them with the version and materialises them into draftsmith.json; the engine,
    the trainer (training.distill.Draft) and the gate then all use exactly those rows; "before" was
    measured on the parent's rows as served, "after" on the new ones. A next job with vocab_size=0
    keeps the version's vocabulary as it is."""
    from mlflow.tracking import MlflowClient

    from deploy.gate import GatePolicy, engine_smoke_check, run_gate
    from deploy.registry import Registry
    from serving.models import read_output_token_ids
    from training.vocab import token_mass

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    # the parent: the served draft without the 6 tokens the training window's target top-k weighs most
    units, _ = data.build_units(train_steps(served), served.seqs)
    mass = sum(token_mass(u.target_ids, u.target_logprobs, 259) for u in units)
    heavy = [int(i) for i in np.argsort(-mass, kind="stable") if i < 256][:6]
    parent_ids = [i for i in range(259) if i not in heavy][:200] + [256, 257, 258]
    parent_ids = sorted(set(parent_ids))
    parent = tmp_path / "parent"
    import shutil
    shutil.copytree(served.draft, parent)
    (parent / "draftsmith.json").write_text(json.dumps({"output_token_ids": parent_ids}))

    uri = fresh_store(template, tmp_path / "data")
    registry = Registry("tiny-target", tracking_uri=uri, cache_root=tmp_path / "cache")
    assert registry.register_base(parent) == "1"
    registry.promote("1")
    v1_dir = registry.materialize("1")                                    # what the scheduler hands the job
    assert read_output_token_ids(v1_dir) == parent_ids
    cfg = job_cfg(served, tmp_path, base_draft_path=str(v1_dir), mlflow=True, tracking_uri=uri)
    out = run_job(cfg, progress=lambda s: None)

    vocab_file = json.loads((out / "vocabulary.json").read_text())
    chosen = vocab_file["output_token_ids"]
    assert chosen == sorted(chosen) and len(chosen) == len(parent_ids)     # default size: the parent's
    assert set(heavy) <= set(chosen) and {256, 257, 258} <= set(chosen)    # heavy window tokens entered
    entered, left = sorted(set(chosen) - set(parent_ids)), sorted(set(parent_ids) - set(chosen))
    assert vocab_file["entered"] == entered and vocab_file["left"] == left and len(entered) == len(left) >= 6
    assert vocab_file["parent_version"] == "1" and vocab_file["chosen_by"] == "window"
    meta = json.loads((out / "candidate.json").read_text())
    m = meta["metrics"]
    assert (m["vocab_size"], m["vocab_parent_size"], m["vocab_entered"], m["vocab_left"]) == \
        (len(chosen), len(parent_ids), len(entered), len(left))
    assert meta["vocabulary"]["chosen_by"] == "window" and meta["vocabulary"]["entered"] == len(entered)
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("draftsmith-distill").experiment_id])
    assert run.data.metrics["vocab_entered"] == len(entered) and run.data.metrics["vocab_left"] == len(left)
    assert run.data.metrics["vocab_size"] == len(chosen)

    # registry: stored with the version (manifest), materialised into draftsmith.json
    version = registry.register_candidate(out)
    stored = json.loads((artifact_dir(registry, version) / "manifest.json").read_text())
    assert "vocabulary.json" in stored
    info = registry.get(version)
    assert info.tags["draftsmith.vocab_size"] == str(len(chosen))
    merged = registry.materialize(version)
    assert read_output_token_ids(merged) == chosen
    assert read_output_token_ids(registry.materialize("1")) == parent_ids    # the parent keeps its own

    # engine and trainer load version 2 with version 2's rows
    engine = Engine.from_paths(str(served.target), str(merged), dtype=torch.float32)
    assert engine.draft.output_token_ids.tolist() == chosen
    plain = distill.Draft(merged, lora_r=None)
    assert plain.output_token_ids == chosen
    # "before" = the parent on its rows, as served; "after" = the candidate on the chosen rows
    reader = ReplayBufferReader(served.url, served.config, group=cfg["group"])
    held, held_seqs = data.heldout_window(reader, 1000, heldout_fraction=FRACTION)
    eval_units, _ = data.build_units(held, held_seqs)
    before = distill.offline_acceptance(distill.Draft(v1_dir, lora_r=None), eval_units)
    after = distill.offline_acceptance(plain, eval_units)
    assert before.acceptance == pytest.approx(m["offline_acceptance_before"], abs=1e-6)
    assert after.acceptance == pytest.approx(m["offline_acceptance_after"], abs=1e-3)   # merged vs adapter rounding
    parent_rows = distill.offline_acceptance(distill.Draft(merged, lora_r=None, output_token_ids=parent_ids),
                                             eval_units)
    assert parent_rows.acceptance != pytest.approx(after.acceptance, abs=1e-6)  # the rows matter to the figure

    # the gate: checks the materialised vocabulary, smoke-decodes on it, promotes
    seen_rows = []
    real_check = engine_smoke_check(str(served.target), prompts=("hello there",), max_tokens=8)

    def smoke(path):
        seen_rows.append(read_output_token_ids(path))
        return real_check(path)

    # the gate scores both drafts itself on held-out records of this buffer; both are pinned to the target
    from deploy.gate import EvidenceSource
    from deploy.registry import target_fingerprint

    pin = target_fingerprint(served.target)
    for v in ("1", version):
        registry.set_version_tags(v, {"draftsmith.target_sha256": pin})
    verdict = run_gate(registry, version, smoke,
                       # confidence 0.5: over 4 held-out requests a 0.95 bound can touch 0 (it did in one run);
                       # the gate's statistics are tested in tests/deploy/test_gate.py, here only which rows it reads
                       policy=GatePolicy(margin=1e-3, min_requests=2, category_min_requests=2, confidence=0.5),
                       evidence=EvidenceSource(redis_url=served.url, buffer_prefix=served.prefix,
                                               heldout_fraction=FRACTION),
                       target_sha256=pin)
    assert verdict.accepted and verdict.promoted, verdict.reason
    assert seen_rows == [chosen] and verdict.vocabulary == f"{len(chosen)} rows"
    assert f"draft output vocabulary {len(chosen)} rows" in verdict.smoke_detail
    assert registry.get(version).tags["draftsmith.gate.vocabulary"] == f"{len(chosen)} rows"

    # the next job from version 2 with vocab_size=0 keeps version 2's vocabulary unchanged
    out2 = run_distillation(job_cfg(served, tmp_path, base_draft_path=str(merged), parent_version=version,
                                    vocab_size=0, steps=2, out_dir=str(tmp_path / "candidate2")),
                            progress=lambda s: None)
    kept = json.loads((out2 / "vocabulary.json").read_text())
    assert kept["output_token_ids"] == chosen and kept["chosen_by"] == "parent"
    assert kept["entered"] == [] and kept["left"] == []
    v3 = registry.register_candidate(out2)
    assert read_output_token_ids(registry.materialize(v3)) == chosen


def test_job_killed_mid_way_leaves_unused_records_pending_for_the_next_job(served, tmp_path, monkeypatch):
    """Records are acked right after the optimizer step that used them: a job that dies at its third
    step leaves exactly the records the first two steps did not use pending in Redis (a SIGKILL
    leaves the same state: `release` only forgets them locally). A job started while the dead one's
    entries are younger than `claim_idle_ms` does not take them; once idle they are re-claimed and
    trained on, and nothing is trained on twice."""
    cfg = job_cfg(served, tmp_path, steps=10, batch_tokens=128)        # ~1-2 requests per batch
    acked: set[str] = set()
    real_ack, real_step, calls = ReplayBufferReader.ack, torch.optim.AdamW.step, [0]

    def spy_ack(self, ids):
        ids = list(ids)
        acked.update(ids)
        return real_ack(self, ids)

    def die_at_third_step(self, *a, **k):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("killed mid-way")
        return real_step(self, *a, **k)

    with monkeypatch.context() as mp:
        mp.setattr(ReplayBufferReader, "ack", spy_ack)
        mp.setattr(torch.optim.AdamW, "step", die_at_third_step)
        with pytest.raises(RuntimeError, match="killed mid-way"):
            run_distillation(cfg, progress=lambda s: None)
    train_ids = {e.stream_id for e in train_steps(served)}
    used = acked & train_ids
    left = pending_ids(served, cfg["group"])
    assert 0 < len(used) < len(train_ids) and left == train_ids - used
    assert not (tmp_path / "candidate").exists()

    with pytest.raises(NotEnoughRecords, match="only 0 usable"):           # the dead job's entries are not idle yet
        run_distillation({**cfg, "claim_idle_ms": 60_000}, progress=lambda s: None)
    assert pending_ids(served, cfg["group"]) == left

    out = run_distillation(cfg, progress=lambda s: None)                 # claim_idle_ms=0: re-claims them
    assert json.loads((out / "candidate.json").read_text())["data_window"]["steps"] == len(left)
    assert pending_ids(served, cfg["group"]) == set()


def test_replay_trains_on_older_records_without_consuming_them(served, tmp_path, seen):
    """The group starts at the cursor; replay_ratio 1 adds as many older training records (read-only)."""
    ordered = sorted(served.steps, key=lambda e: data.stream_id_key(e.stream_id))
    cursor = ordered[len(ordered) // 2].stream_id
    new = [e for e in train_steps(served) if data.stream_id_key(e.stream_id) > data.stream_id_key(cursor)]
    first_new = min(data.stream_id_key(e.stream_id) for e in new)
    old = [e for e in train_steps(served) if data.stream_id_key(e.stream_id) < first_new]
    cfg = job_cfg(served, tmp_path, since_id=cursor, replay_ratio=1.0, steps=5)
    meta = json.loads((run_distillation(cfg, progress=lambda s: None) / "candidate.json").read_text())
    window, replay = meta["data_window"], meta["data_window"]["replay"]
    assert window["steps"] == len(new)
    assert data.stream_id_key(window["first_id"]) > data.stream_id_key(cursor)
    assert replay["steps"] == min(len(new), len(old))
    assert data.stream_id_key(replay["last_id"]) < data.stream_id_key(window["first_id"])
    assert meta["train_config"]["steps"] == 5
    assert seen.trained <= served.train_ids                    # replay never reaches held-out requests
    reader = ReplayBufferReader(served.url, served.config, group=cfg["group"])
    assert reader.pending() == 0


def test_pending_records_counts_step_records_after_the_cursor(served):
    ids = [e.stream_id for e in sorted(served.steps, key=lambda e: data.stream_id_key(e.stream_id))]
    count = lambda since: pending_records(since, redis_url=served.url, buffer_prefix=served.prefix, page=7)
    assert count(None) == len(ids)
    assert count(ids[10]) == len(ids) - 11
    assert count(ids[-1]) == 0
    with pytest.raises(ValueError, match="stream id"):
        count("yesterday")


def test_too_few_records_is_a_clear_error_and_acks_nothing(served, tmp_path, capsys):
    empty = job_cfg(served, tmp_path, buffer_prefix=f"test:empty:{uuid.uuid4().hex[:8]}")
    with pytest.raises(NotEnoughRecords, match="only 0 usable step records"):
        run_distillation(empty, progress=lambda s: None)
    no_heldout = job_cfg(served, tmp_path, eval_source="nowhere")
    with pytest.raises(NotEnoughRecords, match="held-out"):
        run_distillation(no_heldout, progress=lambda s: None)
    reader = ReplayBufferReader(served.url, served.config, group=no_heldout["group"])
    assert reader.pending() == len(train_steps(served))
    argv = ["--base-draft-path", str(served.draft), "--set", f"redis_url={served.url}",
            "--set", f"buffer_prefix={empty['buffer_prefix']}", "--set", "mlflow=false"]
    assert main(argv) == 2
    assert "usable step records" in capsys.readouterr().err
    client = connect(served.url)
    client.delete(f"{empty['buffer_prefix']}:steps")          # the empty stream the group was created on
    client.close()


def test_held_out_steps_without_drafted_tokens_are_a_clear_error(served, tmp_path, redis_url):
    """Steps on which serving drafted nothing (plain target steps) still carry the target's top-k, but hold no
    drafted position to measure offline acceptance on: a job whose held-out steps are all such steps stops
    with NotEnoughRecords (the scheduler keeps the champion), not a crash."""
    cfg = BufferConfig(prefix=f"test:distill:plain:{uuid.uuid4().hex[:10]}", flush_interval_s=0.002)
    writer = ReplayBufferWriter(redis_url, cfg)
    engine = Engine.from_paths(str(served.target), str(served.draft), sink=writer, draft_version="1",
                               dtype=torch.float32)
    dear = CostModel(weight=1.0)                  # verifying a second token costs 1.7x a step: drafting never pays
    for n in range(1, 18):
        dear.observe_target(n, 0.07 * (1 + 0.7 * (n - 1)))
    dear.observe_draft("chain", 1, 0.01)
    dear.observe_target = dear.observe_draft = dear.observe_draft_forward = dear.observe_overhead = lambda *a, **k: None
    engine.costs = dear
    for i in range(16):
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": f"plain {i}"}],
                                                      add_generation_prompt=True, tokenize=True, return_dict=False)
        engine.generate_all(prompt, SamplingParams(temperature=0.0, max_tokens=6), SpecParams(mode="speculative"),
                            request_id=pick_id(i, i in HELD), source="a")
    writer.close()
    try:
        reader = ReplayBufferReader(redis_url, cfg)
        steps = reader.newest(10_000)
        assert steps and all(len(e.record.draft_tokens) == 0 for e in steps)
        with pytest.raises(NotEnoughRecords, match="no drafted token"):
            run_distillation(job_cfg(served, tmp_path, buffer_prefix=cfg.prefix), progress=lambda s: None)
    finally:
        client = connect(redis_url)
        keys = list(client.scan_iter(match=f"{cfg.prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()


def test_config_is_validated(served):
    base = {"base_draft_path": str(served.draft)}
    with pytest.raises(ValueError, match="unknown distillation setting.*learning_rate"):
        parse_config({**base, "learning_rate": 1e-3})
    with pytest.raises(ValueError, match="loss must be one of"):
        parse_config({**base, "loss": "osd_jsd"})
    with pytest.raises(ValueError, match="heldout_fraction"):
        parse_config({**base, "heldout_fraction": 0.0})
    with pytest.raises(ValueError, match="not a model folder"):
        parse_config({"base_draft_path": "/nonexistent"})
    with pytest.raises(ValueError, match="stream id"):
        parse_config({**base, "since_id": "latest"})
    with pytest.raises(ValueError, match="min_heldout must be an integer >= 1"):   # the gate needs a before/after
        parse_config({**base, "min_heldout": 0})
    for bad in (-1, 2.5, True, "8192"):
        with pytest.raises(ValueError, match="vocab_size must be an integer >= 0"):
            parse_config({**base, "vocab_size": bad})
    with pytest.raises(ValueError, match="vocab_prior_weight"):
        parse_config({**base, "vocab_prior_weight": -0.5})
    job, _ = parse_config({**base, "vocab_size": 0})
    assert job.vocab_size == 0 and parse_config(base)[0].vocab_size is None     # None: the parent's size
    from deploy.cli import job_config                                  # what `draftsmith distill` hands the job
    from deploy.scheduler import JobRequest
    job, tcfg = parse_config(job_config(JobRequest("3", served.draft, "t", "5-0"), "t", {"loss": "reverse_kl"}))
    assert (job.parent_version, job.since_id, tcfg.loss) == ("3", "5-0", "reverse_kl")


def test_cli_trains_through_a_local_ray_task(served, tmp_path, capsys):
    """`python -m deploy.distill_job --ray`: the job runs as a Ray task (local Ray, 1 CPU)."""
    from deploy.distill_job import main as job_main

    ray = pytest.importorskip("ray")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        cfg = job_cfg(served, tmp_path, steps=5)
        argv = ["--base-draft-path", cfg["base_draft_path"], "--parent-version", "1", "--ray", "--num-cpus", "1"]
        for key in ("redis_url", "buffer_prefix", "group", "heldout_fraction", "steps", "batch_tokens", "out_dir",
                    "mlflow", "min_records"):
            argv += ["--set", f"{key}={cfg[key]}"]
        assert job_main(argv) == 0
    finally:
        ray.shutdown()
    out = capsys.readouterr().out.strip().splitlines()[-1]
    meta = json.loads((tmp_path / "candidate" / "candidate.json").read_text())
    assert out == str(tmp_path / "candidate") and meta["train_config"]["steps"] == 5


# ----------------------------------------------------------------------------- issue 15: acceptance weighting
def test_acceptance_weighting_leans_towards_the_requests_the_parent_misses(served, tmp_path):
    """request_weights: w = (1 - s) + s * miss / mean miss per request, from the parent's acceptance on every
    scored row (checked by hand from `row_alphas`); mean weight 1; s = 0 weighs all alike; a job with the
    setting records it in candidate.json and its metrics; a setting outside [0, 1] is refused."""
    units, _ = data.build_units(train_steps(served), served.seqs)
    draft = distill.Draft(served.draft, lora_r=16)
    weights, summary = distill.request_weights(draft, units, 1.0, batch_tokens=1024)
    tot: dict[str, list[float]] = {}
    for u, a in distill.row_alphas(draft, units, batch_tokens=1024):
        acc = tot.setdefault(u.request_id, [0.0, 0])
        acc[0] += float(a.sum())
        acc[1] += len(a)
    miss = {r: 1 - s / n for r, (s, n) in tot.items()}
    mean = float(np.mean(list(miss.values())))
    assert set(weights) == served.train_ids
    for r, w in weights.items():
        assert w == pytest.approx(miss[r] / mean, rel=1e-6)
    assert float(np.mean(list(weights.values()))) == pytest.approx(1.0, abs=1e-9)
    assert max(weights.values()) > min(weights.values())
    assert set(summary["by_source"]) == {"a", "b"} and summary["requests"] == len(served.train_ids)
    half, _ = distill.request_weights(draft, units, 0.5, batch_tokens=1024)
    assert all(half[r] == pytest.approx(0.5 + 0.5 * weights[r]) for r in weights)
    flat, _ = distill.request_weights(draft, units, 0.0, batch_tokens=1024)
    assert set(flat.values()) == {1.0}

    meta = json.loads((run_distillation(job_cfg(served, tmp_path, acceptance_weight=1.0, steps=5),
                                        progress=lambda s: None) / "candidate.json").read_text())
    assert meta["train_config"]["acceptance_weight"] == 1.0
    assert meta["weighting"]["requests"] == len(served.train_ids) and meta["weighting"]["seconds"] >= 0
    assert meta["metrics"]["weighting_mean_miss"] == pytest.approx(meta["weighting"]["mean_miss"])
    with pytest.raises(ValueError, match="acceptance_weight"):
        parse_config(job_cfg(served, tmp_path, acceptance_weight=1.5))


def test_lora_targets_choose_which_layers_an_adapter_trains(served, tmp_path):
    """`lora_targets`: "attention" puts LoRA on q/k/v/o only, "mlp" on gate/up/down only, a list on exactly
    those; the job's adapter records the choice (peft's adapter_config.json) and loads back; unknown names are
    refused with the valid ones listed."""
    def wrapped(d: distill.Draft) -> set[str]:
        return {n.rsplit(".", 1)[-1] for n, m in d.model.named_modules() if hasattr(m, "lora_A")}

    attention, mlp = {"q_proj", "k_proj", "v_proj", "o_proj"}, {"gate_proj", "up_proj", "down_proj"}
    assert wrapped(distill.Draft(served.draft, lora_r=4, lora_targets="attention")) == attention
    assert wrapped(distill.Draft(served.draft, lora_r=4, lora_targets="mlp")) == mlp
    assert wrapped(distill.Draft(served.draft, lora_r=4, lora_targets="q_proj, v_proj")) == {"q_proj", "v_proj"}
    assert wrapped(distill.Draft(served.draft, lora_r=4)) == set(distill.LORA_TARGETS)

    cand = run_distillation(job_cfg(served, tmp_path, lora_targets="mlp", steps=3), progress=lambda s: None)
    meta = json.loads((cand / "candidate.json").read_text())
    assert set(meta["train_config"]["lora_targets"]) == mlp          # the modules it resolved to
    saved = json.loads((cand / "adapter" / "adapter_config.json").read_text())
    assert set(saved["target_modules"]) == mlp
    assert wrapped(distill.Draft(served.draft, lora_r=None, adapter=cand / "adapter")) == set(saved["target_modules"])
    for bad in ("everything", "q_proj,lm_head", ""):
        with pytest.raises(ValueError, match="lora_targets"):
            parse_config(job_cfg(served, tmp_path, lora_targets=bad))
