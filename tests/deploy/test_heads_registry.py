"""Medusa heads as registered versions (issue 19, step 3): registered in their own model of a real MLflow
store, gated on the gate's own held-out sample from real Redis, hot-swapped into a replica under load and
rolled back; a heads job trained from real served records; a corrupt or foreign version never served."""
from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from deploy.gate import GatePolicy, run_gate
from deploy.heads import HeadsEvidence, heads_smoke_check, run_heads_cycle, score_heads
from deploy.registry import CHAMPION, HEADS_SUFFIX, Registry, UsageError, heads_registry
from serving.config import SamplingParams, SpecParams
from serving.decoding.medusa import HeadsConfig, MedusaHeads
from serving.engine import Engine
from serving.service import Service, ServiceSettings
from tests import tiny_models
from tests.deploy_helpers import (LoadClients, artifact_dir, drop_prefix, fresh_store, serve_records,
                                  template_db)
from tests.serving.test_engine_rules import reference_greedy

PREFIX = "draftsmith:test-heads"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_models.save_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def target_model(pair):
    return Engine.from_paths(str(pair[0]), None, dtype=torch.float32).target.model


def make_heads(target_model, folder, seed: int, scale: float = 0.2):
    torch.manual_seed(seed)
    heads = MedusaHeads.for_target(target_model, HeadsConfig(target_model.config.hidden_size, 3, 1, True),
                                   list(range(259)))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, scale)
    return heads.save(folder, built_by="tests")


@pytest.fixture
def regs(pair, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = fresh_store(template_db(tmp_path.parent / "template"), tmp_path / "data")
    kw = dict(tracking_uri=uri, cache_root=tmp_path / "cache", candidates_root=tmp_path / "cands")
    return Registry(str(pair[0]), **kw), heads_registry(str(pair[0]), **kw)


def test_heads_versions_live_in_their_own_model_and_roll_back(regs, target_model, tmp_path):
    drafts, heads = regs
    assert heads.name == drafts.name + HEADS_SUFFIX
    h1 = make_heads(target_model, tmp_path / "h1", seed=1)
    with pytest.raises(UsageError, match="heads registry"):
        drafts.register(h1)                                  # the draft's model refuses heads, saying where
    with pytest.raises(UsageError, match="not a Medusa heads folder"):
        heads.register(tmp_path)
    v1 = heads.register(h1)
    v2 = heads.register(make_heads(target_model, tmp_path / "h2", seed=2))
    info = heads.get(v2)
    assert info.kind == "heads" and info.target_sha256 == Registry.target_fingerprint(regs[0].target)
    folder = heads.materialize(v2, verify=True)
    assert (folder / "medusa_heads.safetensors").is_file()
    assert MedusaHeads.load(folder, target_model).config.num_heads == 3
    heads.promote(v1)
    heads.promote(v2)
    assert heads.champion() == v2 and drafts.champion() is None      # the draft's aliases never move
    move = heads.rollback(reason="test")
    assert move.changed and heads.champion() == v1 and move.old_champion == v2
    assert heads.promotions_paused() is not None and drafts.promotions_paused() is None


def _served_ok(engine, prompt, n=16):
    """T=0 medusa output equals target greedy: a swapped-in version serves losslessly."""
    res = engine.generate_all(prompt, SamplingParams(temperature=0.0, max_tokens=n), SpecParams(mode="medusa", gamma=3))
    assert res.token_ids == reference_greedy(engine.target.model, prompt, n)
    return res


def _replica_on_two_heads_versions(regs, pair, target_model, tmp_path):
    """Two registered heads versions, v1 champion, and a replica (draft and heads source) that has not loaded them."""
    _, heads = regs
    v1 = heads.register(make_heads(target_model, tmp_path / "h1", seed=1))
    v2 = heads.register(make_heads(target_model, tmp_path / "h2", seed=2))
    heads.promote(v1)
    engine = Engine.from_paths(str(pair[0]), str(pair[1]), dtype=torch.float32, draft_version="d1")
    svc = Service(ServiceSettings(target=str(pair[0]), buffer=False, watch_interval_s=3600), engine=engine,
                  heads_source=heads)
    return heads, v1, v2, engine, svc


def test_replica_hot_swaps_registered_heads_under_load_and_refuses_a_corrupt_version(regs, pair, target_model,
                                                                                      tmp_path):
    heads, v1, v2, engine, svc = _replica_on_two_heads_versions(regs, pair, target_model, tmp_path)
    try:
        assert svc.check_heads() == f"medusa-v{v1}" and engine.heads_version == f"medusa-v{v1}"
        prompt = engine.tokenizer("the cat sat on the mat")["input_ids"]
        with LoadClients(lambda: _served_ok(engine, prompt)) as load:
            time.sleep(0.5)
            heads.promote(v2)
            assert svc.check_heads() == f"medusa-v{v2}"
            time.sleep(0.5)
            heads.rollback(reason="test")
            assert svc.check_heads() == f"medusa-v{v1}"
            time.sleep(0.3)
        assert not load.errors, load.errors
        versions = {r.stats.draft_version for r in load.results}
        assert {f"medusa-v{v1}", f"medusa-v{v2}"} <= versions or len(load.results) >= 3, versions
        assert svc.health()[1]["medusa_heads"] == f"medusa-v{v1}"

        # a version whose stored weights were altered after registration is never served
        v3 = heads.register(make_heads(target_model, tmp_path / "h3", seed=3))
        with open(artifact_dir(heads, v3) / "heads" / "medusa_heads.safetensors", "r+b") as f:
            f.seek(200)
            f.write(b"\x00\x01\x02\x03")
        heads.set_alias(CHAMPION, v3)
        assert svc.check_heads() == f"medusa-v{v1}"
        assert f"heads version {v3} not loaded" in svc.heads_error and "retry 1" in svc.heads_error
        assert svc.health()[1]["heads_error"] == svc.heads_error
        _served_ok(engine, prompt)                        # still serving v1, every mode still answers
        assert engine.generate_all(prompt, SamplingParams(temperature=0.0, max_tokens=4),
                                   SpecParams(mode="speculative", gamma=2)).token_ids
    finally:
        svc.close()


def test_a_swapped_in_heads_version_is_measured_afresh_by_the_default_modes_choice(regs, pair, target_model,
                                                                                   tmp_path):
    # serving/mode_choice.py `forget`: figures of the heads measured on the old version are dropped on a swap,
    # the draft's are kept, and the heads warm up again
    from serving.mode_choice import MIN_OBSERVATIONS

    heads, v1, v2, engine, svc = _replica_on_two_heads_versions(regs, pair, target_model, tmp_path)
    try:
        assert svc.chooser is not None and svc.check_heads() == f"medusa-v{v1}"
        for mode, rate in (("medusa", 5.0), ("mjsd", 10.0)):
            assert not svc.chooser.observe(mode, 0.0, "sql", 32, 1.0)      # a replica's cold first request
            for _ in range(MIN_OBSERVATIONS):
                assert svc.chooser.observe(mode, 0.0, "sql", 32, 32 / rate)
        assert svc.chooser.choose(0.0, "sql")[0] == "mjsd" or svc.chooser.explore
        heads.promote(v2)
        assert svc.check_heads() == f"medusa-v{v2}"
        snap = svc.health()[1]["auto_choice"]
        assert snap["greedy"]["medusa"]["tokens_per_s"] is None and snap["greedy"]["mjsd"]["tokens_per_s"] == 10.0
        assert snap["labels"]["greedy"]["sql"]["medusa"]["tokens_per_s"] is None
        assert snap["remeasured_after_swap"] == {"medusa": 1, "mjsd": 0}
        assert [svc.chooser.choose(0.0, "sql") for _ in range(2)] == [("medusa", "warmup")] * 2
    finally:
        svc.close()


def test_heads_pinned_to_another_target_are_refused(regs, pair, target_model, tmp_path):
    _, heads = regs
    v1 = heads.register_heads(make_heads(target_model, tmp_path / "h1", seed=1), target_sha256="f" * 64)
    heads.set_alias(CHAMPION, v1)
    engine = Engine.from_paths(str(pair[0]), None, dtype=torch.float32)
    svc = Service(ServiceSettings(target=str(pair[0]), buffer=False, watch_interval_s=3600), engine=engine,
                  heads_source=heads)
    try:
        assert svc.check_heads() == "none" and engine.heads is None
        assert "another target" in svc.heads_error
    finally:
        svc.close()


def served_buffer_and_champion(heads, pair, target_model, tmp_path, redis_url, prefix, train: int, held: int,
                               max_tokens: int) -> str:
    """Serve `train` training and `held` held-out requests into the buffer under `prefix` (held-out split
    0.25), register near-zero heads and make them champion; returns their version."""
    serve_records(pair[0], pair[1], redis_url, prefix, requests=train, heldout=False, heldout_fraction=0.25,
                  max_tokens=max_tokens, tag="train")
    serve_records(pair[0], pair[1], redis_url, prefix, requests=held, heldout=True, heldout_fraction=0.25,
                  max_tokens=max_tokens, tag="held")
    v1 = heads.register(make_heads(target_model, tmp_path / "h1", seed=1, scale=0.05))
    heads.promote(v1)
    return v1


def test_heads_job_trains_on_served_records_and_the_gate_judges_it(regs, pair, target_model, tmp_path, redis_url):
    """Real records from real serving in real Redis: the job reads them (read-only), starts from the champion
    heads, and its candidate is registered and judged by the gate on its own held-out sample."""
    _, heads = regs
    prefix = f"{PREFIX}:{time.time_ns()}"
    try:
        v1 = served_buffer_and_champion(heads, pair, target_model, tmp_path, redis_url, prefix, 16, 8, 24)
        # patience 0: train to the budget (near-zero heads on a tiny held-out sample can stall for 2 epochs)
        job = {"redis_url": redis_url, "buffer_prefix": prefix, "heldout_fraction": 0.25, "budget_s": 8.0,
               "lr": 3e-3, "min_train_rows": 32, "min_heldout_rows": 8, "out_dir": str(tmp_path / "cand"),
               "patience": 0}
        evidence = HeadsEvidence(str(pair[0]), redis_url=redis_url, buffer_prefix=prefix, heldout_fraction=0.25)
        policy = GatePolicy(min_requests=4, category_min_requests=4, bootstrap=500)
        version, verdict = run_heads_cycle(heads, str(pair[0]), job, policy=policy, evidence=evidence,
                                           smoke_check=heads_smoke_check(str(pair[0]), prompts=("hi",),
                                                                         max_tokens=6))
        info = heads.get(version)
        assert info.kind == "heads" and info.parent_version == v1
        assert ("champion" if verdict.promoted else "candidate") in info.aliases
        m = info.metrics
        assert m["training_rows"] >= 32 and m["heldout_rows"] >= 8
        # the job learnt the target's greedy tokens on held-out requests
        assert m["offline_acceptance_after"] > m["offline_acceptance_before"]
        # the gate scored both heads itself, on its own sample of the 8 held-out requests
        assert 6 <= verdict.requests <= 8 and verdict.champion_version == v1
        assert verdict.candidate_acceptance is not None and verdict.champion_acceptance is not None
        assert verdict.candidate_acceptance > verdict.champion_acceptance
        assert verdict.accepted == (heads.champion() == version)
        assert heads.get(version).tags["draftsmith.gate.verdict"] in ("accepted", "rejected")
    finally:
        drop_prefix(redis_url, prefix)


def test_heads_job_replays_older_requests_beside_its_window_when_asked(pair, target_model, tmp_path, redis_url,
                                                                     monkeypatch):
    """After a shift the window holds only the new requests; replay_ratio r adds r x (window steps) of the
    older training steps (the earlier traffic), never a request twice, and the candidate records both windows.
    The second job reads the hidden states of the requests the first one saw from the cache."""
    import json

    monkeypatch.setenv("DRAFTSMITH_HIDDEN_CACHE_DIR", str(tmp_path / "hidden-cache"))

    from buffer.redis_store import BufferConfig, connect
    from training.heads_job import _config, _replay, read_examples, run_heads_distillation

    prefix = f"{PREFIX}:{time.time_ns()}"
    steps_key = BufferConfig(prefix=prefix).steps_key
    client = connect(redis_url)
    try:
        old = serve_records(pair[0], pair[1], redis_url, prefix, requests=6, heldout=False, heldout_fraction=0.25,
                            max_tokens=16, tag="old")
        serve_records(pair[0], pair[1], redis_url, prefix, requests=4, heldout=True, heldout_fraction=0.25,
                      max_tokens=16, tag="held")
        before = client.xlen(steps_key)
        new = serve_records(pair[0], pair[1], redis_url, prefix, requests=6, heldout=False, heldout_fraction=0.25,
                            max_tokens=16, tag="new")
        n_new = client.xlen(steps_key) - before                 # the window: exactly the new requests' steps
        make_heads(target_model, tmp_path / "parent", seed=1, scale=0.05)
        base = {"redis_url": redis_url, "buffer_prefix": prefix, "heldout_fraction": 0.25, "budget_s": 2.0,
                "max_records": n_new, "min_train_rows": 16, "min_heldout_rows": 4, "target": str(pair[0]),
                "parent_heads": str(tmp_path / "parent")}
        c = _config({**base, "replay_ratio": 2.0})
        window_ex, window = read_examples(redis_url=redis_url, buffer_prefix=prefix, n=n_new, heldout=False,
                                          heldout_fraction=0.25)
        assert {e["request_id"] for e in window_ex} == set(new)
        replayed, rep = _replay(c, window_ex, window)
        assert {e["request_id"] for e in replayed} == set(old)  # older training steps only: no held-out, no new
        assert 0 < rep["steps"] <= 2 * n_new
        assert _replay({**c, "replay_ratio": 0.0}, window_ex, window)[0] == []

        metas = {}
        for r in (0.0, 2.0):
            out = run_heads_distillation({**base, "replay_ratio": r, "out_dir": str(tmp_path / f"cand-{r}")},
                                         progress=lambda m: None)
            metas[r] = json.loads((out / "candidate.json").read_text())
        assert metas[0.0]["data_window"]["replay"]["requests"] == 0 and metas[0.0]["metrics"]["replay_steps"] == 0
        assert metas[2.0]["data_window"]["replay"]["requests"] == len(old)
        assert metas[2.0]["train_config"]["replay_ratio"] == 2.0
        assert metas[2.0]["metrics"]["training_rows"] > metas[0.0]["metrics"]["training_rows"]
        # the first job computed the states (identical served sequences excepted); the second read back every
        # sequence the first one saw and computed at most the replayed (older) requests' states
        first, second = metas[0.0]["metrics"], metas[2.0]["metrics"]
        seen = first["hidden_cache_hits"] + first["hidden_cache_misses"]
        assert first["hidden_cache_misses"] >= 1 and seen >= len(new)
        assert second["hidden_cache_hits"] >= seen and second["hidden_cache_misses"] <= len(old)
        assert metas[2.0]["train_config"]["patience"] == 2 and metas[2.0]["train_config"]["min_gain"] == 0.002
        with pytest.raises(ValueError, match="replay_ratio"):
            _config({**base, "replay_ratio": -1})
        with pytest.raises(ValueError, match="patience"):
            _config({**base, "patience": -1})
        with pytest.raises(ValueError, match="min_gain"):
            _config({**base, "min_gain": 1.5})
    finally:
        client.close()
        drop_prefix(redis_url, prefix)


def test_buffer_examples_and_heads_scores_are_per_request_and_paired(pair, target_model, tmp_path, redis_url):
    """examples_from_buffer rebuilds every served request (one target row per answer token, its top-1 as
    the greedy label); score_heads gives each request accepted / proposed of a greedy chain, the same
    figure for the same heads, weighted by the request's positions."""
    prefix = f"{PREFIX}:{time.time_ns()}"
    try:
        serve_records(pair[0], pair[1], redis_url, prefix, requests=6, heldout=True, heldout_fraction=0.25,
                      max_tokens=16, tag="held")
        from training.heads_job import read_examples

        examples, window = read_examples(redis_url=redis_url, buffer_prefix=prefix, n=1000, heldout=True,
                                         heldout_fraction=0.25)
        assert len(examples) == 6 and window["steps"] > 0
        for e in examples:
            A = len(e["tokens"]) - e["prompt_len"]
            assert A >= 2 and len(e["topk_ids"]) == len(e["hard"]) == A
            assert set(e["hard"].tolist()) <= set(e["topk_ids"].ravel().tolist())
        greedy = [e for e in examples if e["source"] != "chat"]           # served at T=0 (serve_records)
        assert greedy and all((g["hard"] == g["tokens"][g["prompt_len"]:]).all() for g in greedy)
        h = make_heads(target_model, tmp_path / "rand", seed=4, scale=0.3)
        a, hidden = score_heads(target_model, h, examples)
        b, _ = score_heads(target_model, h, examples, hidden)
        assert a == b and set(a) == {e["request_id"] for e in examples}
        for e in examples:
            r = a[e["request_id"]]
            assert 0.0 <= r["acceptance"] <= 1.0
            assert r["positions"] == len(e["tokens"]) - e["prompt_len"] - (0 if e["prompt_len"] >= 2 else 1)
    finally:
        drop_prefix(redis_url, prefix)


def test_cli_registers_promotes_and_rolls_back_heads(regs, pair, target_model, tmp_path, capsys):
    from deploy.cli import main

    drafts, heads = regs
    base = ["--target", str(pair[0]), "--tracking-uri", heads.tracking_uri]
    h1, h2 = make_heads(target_model, tmp_path / "h1", seed=1), make_heads(target_model, tmp_path / "h2", seed=2)
    assert main(["register", str(h1), *base]) == 0
    assert main(["register", str(h2), *base]) == 0
    out = capsys.readouterr().out
    assert f"{heads.name} version 1 (heads" in out and f"{heads.name} version 2 (heads" in out
    assert main(["promote", "1", "--kind", "medusa", "--force", *base]) == 0
    assert main(["promote", "2", "--kind", "medusa", "--force", *base]) == 0
    assert main(["rollback", "--kind", "medusa", "--no-pause", *base]) == 0
    assert heads.champion() == "1"
    assert main(["versions", "--kind", "medusa", *base]) == 0
    assert "heads" in capsys.readouterr().out
    assert drafts.versions() == []
    assert main(["distill", "--kind", "medusa", "--min-records", "5", *base]) == 2
    assert "schedules by time" in capsys.readouterr().err


def test_distill_by_default_distills_the_kind_the_served_default_drafts_with(regs, pair, target_model, tmp_path,
                                                                             capsys):
    """`draftsmith distill` with no --kind: the draft's job while no heads are champion (the served default then
    drafts with the draft), the heads' job once they are (mode `auto` then drafts with them); the draft-only
    schedule flags say so and how to distill the draft instead; --kind draft still names the draft."""
    from deploy.cli import main

    drafts, heads = regs
    base = ["--target", str(pair[0]), "--tracking-uri", heads.tracking_uri]
    capsys.readouterr()
    assert main(["distill", *base]) == 2
    assert "no champion draft" in capsys.readouterr().err            # the draft's job: nothing to start from
    heads.promote(heads.register(make_heads(target_model, tmp_path / "h1", seed=1)))
    assert main(["distill", "--every", "1m", "--pipeline", *base]) == 2
    err = capsys.readouterr().err
    assert "drafts with the Medusa heads" in err and "--pipeline schedules draft jobs" in err and "--kind draft" in err
    assert main(["distill", "--drift", *base]) == 2                   # either kind: drift needs an interval
    assert "pass --every" in capsys.readouterr().err
    assert main(["distill", "--min-records", "5", *base]) == 2       # the heads' schedule runs by --every
    assert "schedules by time" in capsys.readouterr().err
    assert main(["distill", "--kind", "draft", "--every", "1m", "--drift", *base]) == 2
    assert "no champion draft" in capsys.readouterr().err


def _requests(n: int, version: str, answer: int = 20):
    from buffer.records import SequenceRecord

    return [SequenceRecord(f"{version}-{i}-{time.time_ns()}", np.arange(12 + answer), 12, version,
                           timestamp=time.time(), source="unit") for i in range(n)]


def test_drafting_kinds_count_answer_tokens_by_the_drafter_that_served_each_request():
    from deploy.heads import drafting_kinds, kind_of_version

    assert [kind_of_version(v) for v in ("medusa-v3", "medusa:/x", "eagle-v1", "3", "none", "")] == \
        ["medusa", "medusa", "eagle", "draft", None, None]
    counts = drafting_kinds(_requests(5, "medusa-v2") + _requests(2, "eagle-v1", answer=3) + _requests(4, "3")
                            + _requests(3, "none"))
    assert counts == {"medusa": 100, "eagle": 6, "draft": 80}


def test_distill_on_a_schedule_distills_the_kind_that_drafts_the_traffic(regs, pair, target_model, tmp_path,
                                                                         redis_url, capsys):
    """deploy/cli.py `_served_kind`: with a heads champion, `distill --every` reads the buffer's newest requests:
    the draft when it served most of them (the replicas chose it), the heads when they did; a clear majority
    decides at once, an even split by the majority when the interval ends, an empty buffer then takes the heads;
    a single job and --pipeline never read it; an unreachable buffer takes the heads."""
    from buffer.redis_store import BufferConfig, ReplayBufferWriter
    from deploy import cli
    from deploy.heads import CLEAR_SHARE, MIN_SERVED_TOKENS, drafting_kind

    _, heads = regs
    heads.promote(heads.register(make_heads(target_model, tmp_path / "h1", seed=1)))
    prefix = f"{PREFIX}:kind:{time.time_ns()}"
    cfg = tmp_path / "distill.yaml"
    cfg.write_text(f"redis_url: {redis_url}\nbuffer_prefix: {prefix}\n")
    base = ["distill", "--target", str(pair[0]), "--tracking-uri", heads.tracking_uri, "--config", str(cfg)]
    parse = cli.build_parser().parse_args

    def push(records):
        with ReplayBufferWriter(redis_url, BufferConfig(prefix=prefix)) as w:
            for r in records:
                w.push_sequence(r)
            w.flush()

    try:
        t0 = time.monotonic()
        assert cli._served_kind(parse([*base, "--every", "1s", "--poll", "1s"])) == "medusa"   # nothing served yet
        assert time.monotonic() - t0 >= 0.9 and "after one interval" in capsys.readouterr().out
        n = MIN_SERVED_TOKENS // 40 + 1
        # the choice's warm-up: about even, no clear majority yet; the majority decides once the interval ends
        push(_requests(n, "medusa-v1") + _requests(n + 1, "1") + _requests(5, "none"))
        assert drafting_kind(redis_url, prefix)[0] == "draft"
        assert drafting_kind(redis_url, prefix, share=CLEAR_SHARE)[0] is None
        t0 = time.monotonic()
        assert cli._served_kind(parse([*base, "--every", "1s", "--poll", "1s"])) == "draft"
        assert time.monotonic() - t0 >= 0.9
        # then the draft takes most requests: a clear majority decides at once
        push(_requests(6 * n, "1"))
        t0 = time.monotonic()
        assert cli._served_kind(parse([*base, "--every", "1m"])) == "draft" and time.monotonic() - t0 < 30
        out = capsys.readouterr().out
        assert f"draft {20 * (7 * n + 1)}, medusa {20 * n}" in out and "drafted by the draft" in out
        assert cli._served_kind(parse(base)) == "medusa"                          # a single job: the registry's rule
        assert cli._served_kind(parse([*base, "--every", "1m", "--pipeline"])) == "medusa"
        push(_requests(40 * n, "medusa-v2"))                                      # the heads now serve the newest
        assert cli._served_kind(parse([*base, "--every", "1m"])) == "medusa"
        bad = tmp_path / "bad.yaml"                                               # an unreachable buffer: the heads
        bad.write_text(f"redis_url: redis://127.0.0.1:1/0\nbuffer_prefix: {prefix}\n")
        assert cli._served_kind(parse([*base[:-1], str(bad), "--every", "1m"])) == "medusa"
        assert "cannot read the replay buffer" in capsys.readouterr().out
    finally:
        drop_prefix(redis_url, prefix)


def test_follow_served_kind_moves_the_schedule_when_the_replicas_choice_moves():
    """deploy/heads.py `follow_served_kind`: a look that sees another kind drafting stops the running schedule
    (after its job) and starts that kind's; the same kind, no clear majority, a failed look or a refused switch (a
    canary being judged) change nothing; the exit code is the last schedule's."""
    from deploy.heads import follow_served_kind

    looks = iter([(None, {}), ("draft", {"draft": 900}), RuntimeError("redis down"), ("medusa", {"medusa": 800}),
                  ("draft", {"draft": 700})])
    refuse = {"medusa->draft"}
    ran, said = [], []

    def look():
        nxt = next(looks, (None, {}))
        if isinstance(nxt, Exception):
            raise nxt
        return nxt

    def run(kind, stop):
        ran.append(kind)
        if len(ran) == 1:
            assert stop.wait(10), "the watcher never moved the draft's schedule"
            return 0
        stop.wait(0.5)                 # the medusa schedule: its look refuses the switch back, then it ends itself
        return 3

    code = follow_served_kind("draft", run, look, look_s=0.02, progress=said.append,
                              can_switch=lambda cur, new: f"{cur}->{new}" not in refuse)
    assert ran == ["draft", "medusa"] and code == 3
    assert len(said) == 1 and "medusa 800" in said[0] and "distilling --kind medusa" in said[0]


@pytest.mark.parametrize("every", ["1s", "1h"])
def test_distill_schedule_follows_the_drafter_the_replicas_serve(regs, pair, target_model, tmp_path, redis_url,
                                                                  capsys, monkeypatch, every):
    """`draftsmith distill --every` with no --kind and a heads champion (deploy/cli.py `_follow_served_kind`, real
    Redis and MLflow): it starts on the drafter that serves, here the draft, and once the buffer's newest requests
    were drafted by the heads it stops the draft's schedule and runs the heads'. With a long interval the watcher
    still looks every WATCH_S (here shortened), not once per interval."""
    from buffer.redis_store import BufferConfig, ReplayBufferWriter
    from deploy import cli, heads as heads_mod
    from deploy.heads import MIN_SERVED_TOKENS

    monkeypatch.setattr(heads_mod, "WATCH_S", 0.5)

    _, heads = regs
    heads.promote(heads.register(make_heads(target_model, tmp_path / "h1", seed=1)))
    prefix = f"{PREFIX}:follow:{time.time_ns()}"
    cfg = tmp_path / "distill.yaml"
    cfg.write_text(f"redis_url: {redis_url}\nbuffer_prefix: {prefix}\n")
    n = MIN_SERVED_TOKENS // 20 + 1

    def push(records):
        with ReplayBufferWriter(redis_url, BufferConfig(prefix=prefix)) as w:
            for r in records:
                w.push_sequence(r)
            w.flush()

    ran = []

    def fake_kind(args, policy, chosen, stop=None):
        ran.append((args.kind, chosen))
        if args.kind == "draft":
            push(_requests(4 * n, "medusa-v1"))                  # the replicas' choice moves to the heads
            assert stop.wait(30), "the draft's schedule was not stopped"
        return 0

    monkeypatch.setattr(cli, "_distill_kind", fake_kind)
    try:
        push(_requests(n, "1"))
        code = cli.main(["distill", "--target", str(pair[0]), "--tracking-uri", heads.tracking_uri, "--config",
                         str(cfg), "--every", every, "--poll", "1s"])
        assert code == 0 and ran == [("draft", True), ("medusa", True)]
        out = capsys.readouterr().out
        assert "drafted by the draft" in out and "the replicas now draft with the medusa heads" in out
    finally:
        drop_prefix(redis_url, prefix)


def test_heads_schedule_runs_a_job_then_waits_for_new_records(regs, pair, target_model, tmp_path, redis_url):
    """`distill --kind medusa --every`: a tick with new records runs a cycle under the job lock; a tick with
    nothing newer than the last job's window, or while another job holds the lock, skips and the schedule
    goes on."""
    import threading

    from deploy.heads import run_heads_schedule
    from deploy.scheduler import JobLock

    _, heads = regs
    prefix = f"{PREFIX}:{time.time_ns()}"
    try:
        v1 = served_buffer_and_champion(heads, pair, target_model, tmp_path, redis_url, prefix, 12, 6, 16)
        job = {"redis_url": redis_url, "buffer_prefix": prefix, "heldout_fraction": 0.25, "budget_s": 3.0,
               "min_train_rows": 16, "min_heldout_rows": 4}
        kw = dict(policy=GatePolicy(min_requests=3, category_min_requests=10, bootstrap=200),
                  evidence=HeadsEvidence(str(pair[0]), redis_url=redis_url, buffer_prefix=prefix,
                                         heldout_fraction=0.25),
                  smoke_check=lambda p: (True, "skipped in this test"), every_s=0.01)
        stop, lines = threading.Event(), []

        def progress(msg):
            lines.append(msg)
            if sum("[heads-schedule]" in m for m in lines) >= 2:
                stop.set()

        lock = JobLock(tmp_path / "job.lock")
        ticks = run_heads_schedule(heads, str(pair[0]), job, stop=stop, lock=lock, progress=progress, **kw)
        assert [t.status for t in ticks][1:] == ["skipped"] and ticks[0].status in ("promoted", "rejected")
        assert ticks[0].version == "2" and heads.get("2").parent_version == v1
        assert "0 new step records" in ticks[1].message and not lock.held
        other = JobLock(tmp_path / "job.lock")
        assert other.acquire()
        serve_records(pair[0], pair[1], redis_url, prefix, requests=1, heldout=False, heldout_fraction=0.25,
                      max_tokens=8, tag="late")
        try:
            ticks = run_heads_schedule(heads, str(pair[0]), job, lock=lock, max_jobs=0, progress=lambda m: None,
                                       **kw)
        finally:
            other.release()
        assert len(ticks) == 1 and ticks[0].status == "skipped" and "job lock" in ticks[0].message
    finally:
        drop_prefix(redis_url, prefix)


def test_heads_schedule_gates_a_held_candidate_on_requests_that_end_after_its_job(regs, pair, target_model,
                                                                                   tmp_path, redis_url):
    """`distill --kind medusa --every --evidence-wait`, end to end on real serving records, Redis and MLflow: with
    2 of the gate's 4 held-out requests in the buffer the job runs, its candidate is registered and held (the
    gate's verdict: insufficient); two training requests served afterwards make the schedule gate the same
    version again, as fresh evidence (deploy/heads.py: they ended after the job's reads), now on a sample that
    meets the minimum, and no second job ran meanwhile."""
    import json

    from deploy.heads import run_heads_schedule
    from deploy.scheduler import JobLock

    _, heads = regs
    prefix = f"{PREFIX}:{time.time_ns()}"
    try:
        served_buffer_and_champion(heads, pair, target_model, tmp_path, redis_url, prefix, 12, 2, 16)
        job = {"redis_url": redis_url, "buffer_prefix": prefix, "heldout_fraction": 0.25, "budget_s": 3.0,
               "lr": 3e-3, "min_train_rows": 16, "min_heldout_rows": 4}
        evidence = HeadsEvidence(str(pair[0]), redis_url=redis_url, buffer_prefix=prefix, heldout_fraction=0.25)
        held, lines, out = threading.Event(), [], {}

        def progress(msg):
            lines.append(msg)
            if msg.startswith("[heads-schedule] held:"):
                held.set()

        def schedule():
            out["ticks"] = run_heads_schedule(
                heads, str(pair[0]), job, every_s=3600.0, poll_s=0.1, max_jobs=1, evidence_wait_s=300.0,
                policy=GatePolicy(min_requests=4, category_min_requests=10, bootstrap=200), evidence=evidence,
                smoke_check=lambda p: (True, "skipped in this test"), lock=JobLock(tmp_path / "job.lock"),
                progress=progress)

        th = threading.Thread(target=schedule, daemon=True)
        th.start()
        assert held.wait(180), lines
        info = heads.get("2")
        assert info.tags["draftsmith.gate.verdict"] == "rejected" and info.tags["draftsmith.gate.insufficient"] == "1"
        cut = json.loads(info.tags["draftsmith.data_window"])["sequence_cut"]
        assert json.loads(info.tags["draftsmith.gate.evidence"])["window"]["fresh_after"] == cut
        # two training requests: the 2 held-out ones alone are still too few, but these ended after the job's
        # reads, so no version trained on them: fresh evidence
        fresh = serve_records(pair[0], pair[1], redis_url, prefix, requests=2, heldout=False, heldout_fraction=0.25,
                              max_tokens=16, tag="late-fresh")
        th.join(180)
        assert not th.is_alive(), lines
        ticks = out["ticks"]
        assert ticks[0].status == "held" and ticks[0].version == "2"
        assert ticks[-1].status in ("promoted", "rejected") and ticks[-1].version == "2", [t.status for t in ticks]
        assert any(m.startswith("[heads-schedule] gated again: ") for m in lines)
        info = heads.get("2")
        assert info.tags["draftsmith.gate.insufficient"] == "0"
        gate_ev = json.loads(info.tags["draftsmith.gate.evidence"])
        assert gate_ev["requests"] >= 4 and gate_ev["window"]["fresh_requests"] == len(fresh) == 2
        assert gate_ev["window"]["fresh_after"] == cut
        assert sorted(int(v.version) for v in heads.versions()) == [1, 2]          # one job, one candidate
        # an operator's gate by hand, `draftsmith promote 2 --kind medusa`, counts the same fresh requests
        from deploy.cli import main

        if heads.champion() == "2":
            heads.promote("1", reason="this test: gate version 2 again by hand")
        cfg = tmp_path / "gate.yaml"
        cfg.write_text(json.dumps({"redis_url": redis_url, "buffer_prefix": prefix, "heldout_fraction": 0.25}))
        main(["promote", "2", "--kind", "medusa", "--target", str(pair[0]), "--tracking-uri", heads.tracking_uri,
              "--config", str(cfg), "--min-requests", "4", "--category-min-requests", "10"])
        by_hand = json.loads(heads.get("2").tags["draftsmith.gate.evidence"])
        assert by_hand["window"]["fresh_after"] == cut and by_hand["window"]["fresh_requests"] == 2
        assert by_hand["requests"] >= 4 and heads.get("2").tags["draftsmith.gate.insufficient"] == "0"
    finally:
        drop_prefix(redis_url, prefix)


def test_fresh_evidence_starts_after_what_either_version_could_have_trained_on():
    """deploy/heads.py `fresh_cut` (pure logic: stand-ins): the later of the candidate's and the champion's
    sequence cuts; none for a candidate without one, or when the champion was trained by a job that kept none."""
    import json
    from types import SimpleNamespace

    from deploy.heads import fresh_cut

    def registry(windows: dict, champion: str):
        return SimpleNamespace(champion=lambda: champion, get=lambda v: SimpleNamespace(
            tags={"draftsmith.data_window": json.dumps(windows[v])} if windows[v] is not None else {}))

    job = lambda cut: {"steps": 900, "sequence_cut": cut}                       # noqa: E731
    assert fresh_cut(registry({"1": None, "2": job("170-3")}, "1"), "2") == "170-3"      # champion: bootstrap
    assert fresh_cut(registry({"1": job("90-0"), "2": job("170-3")}, "1"), "2") == "170-3"
    assert fresh_cut(registry({"3": job("1000-0"), "2": job("170-3")}, "3"), "2") == "1000-0"   # a later champion
    assert fresh_cut(registry({"3": job("170-10"), "2": job("170-3")}, "3"), "2") == "170-10"  # ids, not strings
    assert fresh_cut(registry({"1": {"steps": 900}, "2": job("170-3")}, "1"), "2") is None   # champion unplaceable
    assert fresh_cut(registry({"1": None, "2": None}, "1"), "2") is None                # registered by hand
    assert fresh_cut(registry({"2": job("170-3")}, "2"), "2") == "170-3"                # the champion itself
    broken = SimpleNamespace(champion=lambda: "1", get=lambda v: SimpleNamespace(tags={"draftsmith.data_window": "{"}))
    assert fresh_cut(broken, "2") is None


def test_heads_schedule_counts_every_from_the_last_start_and_says_a_skip_once(monkeypatch):
    """--every is the interval between job starts, as for the draft's scheduler (a cycle longer than it is
    followed by the next at once, not by a further interval); between jobs the schedule looks every poll_s and
    reports a skipped look once per reason (pure logic: cycle, registry and buffer count are stand-ins)."""
    from types import SimpleNamespace

    import training.job
    from deploy import heads as H
    from deploy.scheduler import JobLock

    starts, looks, lines = [], [], []

    def cycle(registry, target, cfg, **kw):
        starts.append(time.monotonic())
        time.sleep(0.6)
        return str(len(starts) + 1), SimpleNamespace(promoted=True, accepted=True, reason="gate ok", promotion=None)

    def pending(since, **kw):
        looks.append(since)
        return 0 if len(looks) <= 3 else 10

    held = iter([3, 3, 20, 20])                      # the gate's held-out sample: too thin twice, then enough
    monkeypatch.setattr(H, "run_heads_cycle", cycle)
    monkeypatch.setattr(training.job, "pending_records", pending)
    registry = SimpleNamespace(versions=lambda: [], canary=lambda: None)
    ticks = H.run_heads_schedule(registry, None, {}, every_s=1.0, poll_s=0.05, max_jobs=2, min_new_steps=5,
                                 policy=GatePolicy(min_requests=10), evidence=SimpleNamespace(
                                     heldout_requests=lambda: next(held)),
                                 lock=JobLock(Path(tempfile.mkdtemp()) / "job.lock"), progress=lines.append)
    assert [t.status for t in ticks] == ["skipped"] * 5 + ["promoted", "promoted"]
    assert sum("skipped: 0 new step records" in m for m in lines) == 1            # said once, not three times
    assert sum("held-out sample holds 3 requests, it needs 10" in m for m in lines) == 1   # no job it cannot judge
    assert 1.0 <= starts[1] - starts[0] < 1.45, starts                              # not 0.6 + 1.0 after the first
    with pytest.raises(ValueError, match="poll_s"):
        H.run_heads_schedule(registry, None, {}, every_s=1.0, poll_s=0)


def test_heads_schedule_rests_after_a_job_so_jobs_take_at_most_their_share(monkeypatch):
    """`distill --job-share 0.5`: after a cycle of D seconds no job starts for D more seconds, although --every
    has passed and drift says a job is due; the rest is said once and follows the job's real length (pure
    logic: stand-ins)."""
    from types import SimpleNamespace

    import training.job
    from deploy import heads as H
    from deploy import scheduler as S
    from deploy.scheduler import DriftPolicy, JobLock

    spans, lines = [], []
    lengths = iter([0.6, 0.2, 0.2])

    def cycle(registry, target, cfg, **kw):
        t = time.monotonic()
        time.sleep(next(lengths))
        spans.append((t, time.monotonic()))
        return str(len(spans) + 1), SimpleNamespace(promoted=True, accepted=True, reason="gate ok", promotion=None)

    monkeypatch.setattr(H, "run_heads_cycle", cycle)
    monkeypatch.setattr(training.job, "pending_records", lambda since, **kw: 10)
    monkeypatch.setattr(S, "drift_reason", lambda registry, pol, since: "drift: always")
    registry = SimpleNamespace(versions=lambda: [], canary=lambda: None)
    run = lambda **kw: H.run_heads_schedule(registry, None, {}, every_s=0.05, poll_s=0.02,  # noqa: E731
                                            lock=JobLock(Path(tempfile.mkdtemp()) / "job.lock"),
                                            progress=lines.append, drift=DriftPolicy(), **kw)
    ticks = run(job_share=0.5, max_jobs=3)
    assert [t.status for t in ticks if t.status != "skipped"] == ["promoted"] * 3
    gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:])]
    assert 0.6 <= gaps[0] < 0.9 and 0.2 <= gaps[1] < 0.45, gaps          # the rest follows each job's length
    assert sum("resting after the last job: jobs take at most 50%" in m for m in lines) == 2   # once per rest
    assert any("next job in 1 s at the earliest (--job-share 0.5)" in m for m in lines), lines
    spans.clear()
    lengths = iter([0.6, 0.2])                                               # share 1 (the default): no rest
    assert [t.status for t in run(max_jobs=2)] == ["promoted"] * 2 and spans[1][0] - spans[0][1] < 0.2
    with pytest.raises(ValueError, match="--job-share must be a fraction in"):
        run(job_share=0.0)
    with pytest.raises(ValueError, match="--job-share must be a fraction in"):
        S.rest_after_job(10.0, 1.5)
    assert S.rest_after_job(120.0, 1.0) == 0.0 and S.rest_after_job(120.0, 0.25) == 360.0


def test_heads_schedule_starts_a_job_early_when_live_acceptance_drifts(monkeypatch):
    """`distill --drift` for the heads: within --every, a job starts as soon as the champion's live acceptance
    has drifted (deploy/scheduler.py `drift_reason`, the draft scheduler's trigger, asked with the time since
    the last start), and says why; without drift the interval decides (pure logic: stand-ins)."""
    from types import SimpleNamespace

    import training.job
    from deploy import heads as H
    from deploy import scheduler as S
    from deploy.scheduler import DriftPolicy, JobLock

    starts, asked, lines = [], [], []

    def cycle(registry, target, cfg, **kw):
        starts.append(time.monotonic())
        return str(len(starts) + 1), SimpleNamespace(promoted=True, accepted=True, reason="gate ok", promotion=None)

    def drifted(registry, pol, since):
        asked.append((pol, since))
        return "drift: version 2's live acceptance 0.200 +- 0.010 ..." if since > 0.3 else None

    monkeypatch.setattr(H, "run_heads_cycle", cycle)
    monkeypatch.setattr(training.job, "pending_records", lambda since, **kw: 10)
    monkeypatch.setattr(S, "drift_reason", drifted)
    registry = SimpleNamespace(versions=lambda: [], canary=lambda: None)
    pol = DriftPolicy()
    run = lambda **kw: H.run_heads_schedule(registry, None, {}, every_s=60.0, poll_s=0.05, max_jobs=2,  # noqa: E731
                                            lock=JobLock(Path(tempfile.mkdtemp()) / "job.lock"),
                                            progress=lines.append, **kw)
    t0 = time.monotonic()
    ticks = run(drift=pol)
    assert [t.status for t in ticks] == ["promoted", "promoted"] and time.monotonic() - t0 < 5   # not 60 s
    assert 0.3 < starts[1] - starts[0] < 1.0 and all(p is pol for p, _ in asked)
    assert sum("a job before the interval: drift" in m for m in lines) == 1
    stop = threading.Event()
    threading.Timer(0.8, stop.set).start()
    starts.clear()
    assert [t.status for t in run(stop=stop)] == ["promoted"] and len(starts) == 1    # no drift: the interval


def _waiting_stand_ins(monkeypatch, held_counts, gate_verdicts, champion="1"):
    """run_heads_schedule with stand-ins: every cycle registers a candidate the gate finds insufficient,
    `held_counts` is what the gate's sample holds at each look (the last repeated), `gate_verdicts` what each
    later gate says. Returns (registry, starts, gated)."""
    from types import SimpleNamespace

    import training.job
    from deploy import heads as H

    starts, gated, held = [], [], list(held_counts)

    def cycle(registry, target, cfg, **kw):
        starts.append(time.monotonic())
        return "2", SimpleNamespace(promoted=False, accepted=False, insufficient=True, promotion=None,
                                    reason="2 held-out requests in the gate's sample, the gate needs at least 4")

    def gate(registry, version, target, **kw):
        gated.append(version)
        return gate_verdicts[len(gated) - 1]

    monkeypatch.setattr(H, "run_heads_cycle", cycle)
    monkeypatch.setattr(H, "gate_heads", gate)
    monkeypatch.setattr(training.job, "pending_records", lambda since, **kw: 10)
    registry = SimpleNamespace(versions=lambda: [], canary=lambda: None, champion=lambda: champion,
                               get=lambda v: SimpleNamespace(parent_version="1", tags={}))
    evidence = SimpleNamespace(heldout_requests=lambda fresh_after=None: held.pop(0) if len(held) > 1 else held[0])
    return registry, evidence, starts, gated


def test_heads_schedule_starts_before_the_evidence_is_in_and_gates_the_candidate_when_it_is(monkeypatch):
    """`distill --evidence-wait` for the heads: the job starts once the gate's sample holds half its minimum;
    a candidate the gate finds insufficient is "held", gated again once the sample holds the minimum (again
    only when it has grown since), and no second job starts meanwhile (pure logic: stand-ins)."""
    from types import SimpleNamespace

    from deploy import heads as H
    from deploy.scheduler import JobLock

    verdicts = [SimpleNamespace(insufficient=True, accepted=False, promoted=False, promotion=None,
                                reason="3 held-out requests scored, the gate needs at least 4"),
                SimpleNamespace(insufficient=False, accepted=True, promoted=True, promotion=None,
                                reason="delta +0.1, significant")]
    # at the job's start 2 (half of 4); then 3, 4 (gated: still too few scored), 4 (no new evidence), 5 (gated)
    registry, evidence, starts, gated = _waiting_stand_ins(monkeypatch, [1, 2, 3, 4, 4, 4, 5], verdicts)
    lines = []
    ticks = H.run_heads_schedule(registry, None, {}, every_s=0.01, poll_s=0.02, max_jobs=1, evidence_wait_s=60.0,
                                 policy=GatePolicy(min_requests=4), evidence=evidence,
                                 lock=JobLock(Path(tempfile.mkdtemp()) / "job.lock"), progress=lines.append)
    assert len(starts) == 1 and gated == ["2", "2"], (starts, gated)     # one job; gated twice, not every look
    statuses = [t.status for t in ticks]
    assert statuses[0] == "skipped" and "no job until it holds 2" in ticks[0].message
    assert statuses[1] == "held" and ticks[1].version == "2" and statuses[-1] == "promoted", statuses
    assert set(statuses[2:-1]) == {"skipped"} and all("waits for held-out evidence" in t.message
                                                      for t in ticks[2:-1])
    assert any(m.startswith("[heads-schedule] held: waits up to 60 s") for m in lines)
    assert lines[-1].startswith("[heads-schedule] gated again: promoted: delta +0.1")
    # without --evidence-wait no job starts before the sample holds the whole minimum
    registry, evidence, starts, gated = _waiting_stand_ins(monkeypatch, [2, 3], verdicts)
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    ticks = H.run_heads_schedule(registry, None, {}, every_s=0.01, poll_s=0.02, policy=GatePolicy(min_requests=4),
                                 evidence=evidence, stop=stop, lock=JobLock(Path(tempfile.mkdtemp()) / "job.lock"),
                                 progress=lambda m: None)
    assert not starts and {t.status for t in ticks} == {"skipped"}
    assert "no job until traffic brings them" in ticks[-1].message
    with pytest.raises(ValueError, match="evidence_wait_s"):
        H.run_heads_schedule(registry, None, {}, every_s=1.0, evidence_wait_s=-1)


def test_a_held_heads_candidate_is_dropped_when_its_wait_runs_out_or_its_parent_is_replaced(monkeypatch):
    """The wait is bounded: a candidate whose evidence never comes is rejected after `evidence_wait_s`, and one
    whose parent is no longer the champion (a rollback meanwhile) is dropped without a gate; the schedule then
    goes on to the next job (pure logic: stand-ins)."""
    from deploy import heads as H
    from deploy.scheduler import JobLock

    def run(**kw):
        return H.run_heads_schedule(registry, None, {}, every_s=0.01, poll_s=0.02, max_jobs=1,
                                    policy=GatePolicy(min_requests=4), evidence=evidence,
                                    lock=JobLock(Path(tempfile.mkdtemp()) / "job.lock"), progress=lambda m: None,
                                    **kw)

    registry, evidence, starts, gated = _waiting_stand_ins(monkeypatch, [2], [])
    t0 = time.monotonic()
    ticks = run(evidence_wait_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 5 and len(starts) == 1 and not gated
    assert ticks[0].status == "held" and ticks[-1].status == "rejected" and ticks[-1].version == "2"
    assert "did not reach 4 requests within 0 s; the candidate stays rejected" in ticks[-1].message
    registry, evidence, starts, gated = _waiting_stand_ins(monkeypatch, [2, 9], [], champion="3")
    ticks = run(evidence_wait_s=60.0)
    assert [t.status for t in ticks] == ["held", "rejected"] and not gated
    assert "no longer the champion (version 3 is)" in ticks[-1].message


def test_heads_schedule_with_a_canary_share_waits_for_the_judge(regs, pair, target_model, tmp_path, redis_url):
    """`distill --kind medusa --every ... --canary-share S`: a candidate that passes the gate becomes the canary,
    not the champion; no job starts while it is judged; the judge (here: no live traffic, so its timeout) ends
    it and the champion stays."""
    import threading

    from deploy.heads import run_heads_schedule
    from deploy.scheduler import CanaryJudge, CanaryPolicy, JobLock

    _, heads = regs
    prefix = f"{PREFIX}:{time.time_ns()}"
    try:
        v1 = served_buffer_and_champion(heads, pair, target_model, tmp_path, redis_url, prefix, 16, 8, 24)
        # patience 0: the candidate must learn enough to pass (tiny near-zero heads can stall for 2 epochs)
        job = {"redis_url": redis_url, "buffer_prefix": prefix, "heldout_fraction": 0.25, "budget_s": 8.0,
               "lr": 3e-3, "min_train_rows": 32, "min_heldout_rows": 8, "patience": 0}
        stop, lines = threading.Event(), []

        def clock():
            # the judge's clock stands still (elapsed 0) until the schedule has said the canary is being judged, so
            # its 1.5-s timeout cannot end the canary before that look however slow the host (CI saw a loaded host
            # drop it at the first look after the job); from then on it is the real clock and the timeout ends it
            return time.time() if any("is still being judged" in m for m in lines) else 0.0

        judge = CanaryJudge(heads, CanaryPolicy(min_duration_s=0.0, timeout_s=1.5), progress=lambda m: None,
                            clock=clock)

        def progress(msg):
            lines.append(msg)
            if any("[heads-canary] dropped" in m for m in lines) and "0 new step records" in msg:
                stop.set()

        # a candidate that fails its gate never becomes a canary, so the line above never comes: the schedule then
        # stops at this deadline and the assertions below say what happened, instead of the test hanging
        timer = threading.Timer(120.0, stop.set)
        timer.start()
        try:
            ticks = run_heads_schedule(
                heads, str(pair[0]), job, every_s=0.4, stop=stop, lock=JobLock(tmp_path / "job.lock"),
                canary_share=0.5, canary=judge,
                policy=GatePolicy(margin=0.0, confidence=0.5, min_requests=4, category_min_requests=10, bootstrap=200),
                evidence=HeadsEvidence(str(pair[0]), redis_url=redis_url, buffer_prefix=prefix, heldout_fraction=0.25),
                smoke_check=lambda p: (True, "skipped in this test"), progress=progress)
        finally:
            timer.cancel()
        assert ticks and ticks[0].status == "canary", [(t.status, t.message) for t in ticks[:3]]
        assert ticks[0].status == "canary" and ticks[0].version == "2"
        assert any(t.status == "skipped" and "canary version 2 is still being judged" in t.message for t in ticks)
        assert ticks[-1].status == "skipped" and "0 new step records" in ticks[-1].message
        assert heads.canary() is None and heads.champion() == v1
    finally:
        drop_prefix(redis_url, prefix)


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_bench_heads_online_smoke(kind, tmp_path, redis_url, monkeypatch):
    """scripts/bench_heads_online.py end to end on tiny models: before / traffic / job + gate / after, with the
    earlier category measured in the same phases."""
    import json

    from scripts import bench_heads_online

    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    replay = ["--earlier-requests", "4", "--replay-ratio", "1"] if kind == "eagle" else []   # one run of each path
    assert bench_heads_online.main(["--tiny", "--kind", kind, "--out", str(tmp_path / "out"),
                                    "--work", str(tmp_path / "w"), *replay]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    if replay:
        assert summary["earlier_traffic"]["prompts"] == 4
        assert summary["job"]["job_metrics"]["replay_requests"] >= 1     # the earlier requests, replayed
    else:
        assert "earlier_traffic" not in summary and summary["job"]["job_metrics"]["replay_requests"] == 0
    assert summary["traffic"]["prompts"] == 16 and summary["traffic"]["drafted"] > 0
    assert summary["job"]["version"] == "2" and summary["job"]["gate_requests"] >= 1
    for phase in ("before", "after"):
        assert summary[phase][kind]["tokens"] > 0 and summary[phase]["speedup"] > 0
        assert summary[phase][kind]["prompts"] == summary[phase]["target"]["prompts"] == 4
        assert summary[phase]["earlier"][kind]["prompts"] == 2 and summary[phase]["earlier"]["speedup"] > 0
    assert "| v1 (bootstrap) |" in (tmp_path / "out" / "summary.md").read_text()
    assert (tmp_path / "out" / "heads_online.png").stat().st_size > 1000


def test_bench_heads_window_smoke(pair, target_model, tmp_path):
    """scripts/bench_heads_window.py on a served buffer saved by an embedded Redis (as bench_online leaves one):
    two arms from one parent on a copy of it, each candidate and the parent scored per traffic category on
    the same held-out sample, the table, JSON and PNG written, the original snapshot untouched."""
    import json

    from buffer.embedded import EmbeddedRedis
    from scripts import bench_heads_window

    rdir = tmp_path / "redis"
    server = EmbeddedRedis(rdir, persist=True)
    url = server.start()
    try:
        serve_records(pair[0], pair[1], url, "draftsmith:buf", requests=12, heldout=False, heldout_fraction=0.25,
                      max_tokens=16, tag="train")
        serve_records(pair[0], pair[1], url, "draftsmith:buf", requests=4, heldout=True, heldout_fraction=0.25,
                      max_tokens=16, tag="held")
    finally:
        server.stop()
    snapshot = (rdir / "dump.rdb").read_bytes()
    parent = make_heads(target_model, tmp_path / "h1", seed=1, scale=0.05)
    out = tmp_path / "out"
    assert bench_heads_window.main(["--redis-dir", str(rdir), "--parent", str(parent), "--target", str(pair[0]),
                                    "--arm", "max_records=40", "--arm", "max_records=1000,lr=0.003",
                                    "--set", "budget_s=2,heldout_fraction=0.25,min_train_rows=16,min_heldout_rows=4",
                                    "--eval-records", "500", "--out", str(out)]) == 0
    res = json.loads((out / "heads-window.json").read_text())
    assert [r["arm"] for r in res["rows"]] == ["max_records=40", "max_records=1000,lr=0.003"]
    small, large = res["rows"]
    assert small["train_steps"] <= 40 < large["train_steps"]              # the window the arm asked for
    cats = set(res["before"][str(parent)])
    assert {"chat", "code", "all"} <= cats and all(set(r["after"]) == cats for r in res["rows"])
    assert all(0.0 <= v <= 1.0 for r in res["rows"] for v in r["after"].values())
    assert "| h1 | max_records=40 |" in (out / "heads-window.md").read_text()
    assert (out / "heads-window.png").stat().st_size > 1000
    assert (rdir / "dump.rdb").read_bytes() == snapshot                     # worked on a copy
