"""Mode "medusa" served by the engine and the HTTP API: T=0 equal to target greedy for each tree shape,
records that rebuild the sequence under the heads' version, beside the batch, hidden state recomputed
when a step left none, clear errors without heads (engine, HTTP 400) and for a bad heads folder (the
replica still serves)."""
from __future__ import annotations

import httpx
import pytest
import torch

from serving.config import SamplingParams, SpecParams
from serving.decoding.medusa import HeadsConfig, MedusaHeads
from serving.engine import MEDUSA_NEEDS_HEADS, Engine
from serving.models import ModelLoadError
from serving.service import Service, ServiceSettings
from tests import tiny_models
from tests.api_helpers import LiveServer
from tests.serving.test_batching import run_concurrently
from tests.serving.test_engine_rules import GREEDY, ids, make_engine, one_thread, reference_greedy  # noqa: F401
from serving.metrics import MetricsHub


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_models.save_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def heads_dir(pair, tmp_path_factory):
    """Heads for the tiny target with random (not zero) weights, so proposals differ from its own argmax."""
    target = Engine.from_paths(str(pair[0]), None, dtype=torch.float32).target.model
    torch.manual_seed(3)
    heads = MedusaHeads.for_target(target, HeadsConfig(target.config.hidden_size, 3, 1, True), list(range(259)))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.2)
    return heads.save(tmp_path_factory.mktemp("heads") / "tiny-heads")


@pytest.fixture(scope="module")
def medusa_engine(pair, heads_dir):
    return make_engine(pair[0], pair[1], draft_version="v1", heads=heads_dir)


@pytest.mark.parametrize("gamma,extra", [(3, {}), (2, {"width": 3, "branch": 2}), (5, {"width": 1, "branch": 1})])
def test_temperature_zero_equals_target_greedy(medusa_engine, gamma, extra):
    prompt = ids(medusa_engine)
    expected = reference_greedy(medusa_engine.target.model, prompt, GREEDY.max_tokens)
    res = medusa_engine.generate_all(prompt, GREEDY, SpecParams(mode="medusa", gamma=gamma, extra=extra,
                                                                adaptive=False))
    assert res.token_ids == expected
    assert res.stats.mode == "medusa" and res.stats.draft_version == "medusa:tiny-heads"
    assert res.stats.steps < len(expected) or res.stats.accepted_tokens == 0
    assert res.stats.draft_tokens > 0


def test_typical_rule_runs_on_the_tree_and_is_greedy_at_t0(medusa_engine):
    prompt = ids(medusa_engine)
    typical = SpecParams(mode="medusa", gamma=3, extra={"rule": "typical", "posterior_threshold": 0.05})
    res = medusa_engine.generate_all(prompt, GREEDY, typical)
    assert res.token_ids == reference_greedy(medusa_engine.target.model, prompt, GREEDY.max_tokens)
    warm = SamplingParams(temperature=0.7, max_tokens=30, seed=5)
    a = medusa_engine.generate_all(prompt, warm, typical)
    b = medusa_engine.generate_all(prompt, warm, typical)
    assert a.token_ids == b.token_ids and len(a.token_ids) > 0        # deterministic given the seed
    assert a.stats.steps <= len(a.token_ids)


def test_records_rebuild_the_sequence_under_the_heads_version(pair, heads_dir):
    sink = tiny_models.ListSink()
    eng = make_engine(pair[0], pair[1], draft_version="v7", sink=sink, record_top_k=5, heads=heads_dir)
    prompt = ids(eng)
    res = eng.generate_all(prompt, SamplingParams(temperature=1.0, max_tokens=30, seed=2),
                           SpecParams(mode="medusa", gamma=3, adaptive=False), request_id="r1", source="unit")
    assert_records_rebuild_the_sequence(sink, prompt, res, "medusa", "medusa:tiny-heads", gamma=3, top_k=5)


def assert_records_rebuild_the_sequence(sink, prompt, res, mode, version, gamma, top_k):
    """One sequence record holding prompt + output, and step records (at most one per step) whose accepted
    draft tokens and next token are the sequence's tokens at their position, under the mode and version; a
    step that drafted nothing (the adaptive controller's plain step) is a target step under no draft version."""
    assert len(sink.seqs) == 1 and 0 < len(sink.steps) <= res.stats.steps
    seq = sink.seqs[0]
    assert list(seq.token_ids) == prompt + res.token_ids
    assert any(len(rec.draft_tokens) for rec in sink.steps)
    for rec in sink.steps:
        g, n = len(rec.draft_tokens), rec.num_accepted
        if g == 0:
            assert rec.algorithm == "target" and rec.draft_version == "none" and n == 0
        else:
            assert rec.algorithm == mode and rec.draft_version == version
        assert g <= gamma and rec.target_topk_ids.shape == (g + 1, top_k)
        got = list(seq.token_ids[rec.position: rec.position + n + 1])
        want = list(rec.draft_tokens[:n]) + [rec.next_token]
        assert got[: len(want)] == want[: len(got)]


def test_runs_beside_the_batch_and_from_a_one_token_prompt(medusa_engine):
    sampling = SamplingParams(temperature=0.0, max_tokens=20)
    p = ids(medusa_engine)
    jobs = [(p, sampling, SpecParams(mode="speculative", gamma=3, adaptive=False)),
            (p[:7], sampling, SpecParams(mode="medusa", gamma=3)),
            (p[:1], sampling, SpecParams(mode="medusa", gamma=2, extra={"width": 2, "branch": 2}))]
    want = [reference_greedy(medusa_engine.target.model, prompt, 20) for prompt, _, _ in jobs]
    got = run_concurrently(medusa_engine, jobs)
    assert [r.token_ids for r in got] == want


def test_hidden_state_is_recomputed_after_a_step_that_left_none(medusa_engine):
    """Near the context limit the engine takes plain target steps; a medusa step after one re-feeds a token
    for the hidden state instead of reading a stale one (output still equal to greedy)."""
    from serving.engine import _RequestState

    prompt = ids(medusa_engine)
    state = _RequestState(medusa_engine, prompt)
    gen = torch.Generator().manual_seed(0)
    stats = medusa_engine.generate_all(prompt, GREEDY, SpecParams(mode="medusa", gamma=3)).stats
    out = []
    out += state.spec_step(GREEDY, SpecParams(mode="medusa", gamma=3), gen, stats, "r", None)
    out += state.target_step(GREEDY, gen, stats)
    assert state.hidden_for != len(state.seq)
    out += state.spec_step(GREEDY, SpecParams(mode="medusa", gamma=3), gen, stats, "r", None)
    assert state.hidden_for == len(state.seq)
    assert out == reference_greedy(medusa_engine.target.model, prompt, len(out))


def test_without_heads_the_engine_refuses_and_a_bad_folder_keeps_the_old_heads(medusa_engine, pair, tmp_path):
    lonely = make_engine(pair[0], pair[1])
    assert lonely.heads is None and lonely.heads_version == "none"
    with pytest.raises(ValueError, match="needs Medusa heads"):
        lonely.generate_all(ids(lonely), GREEDY, SpecParams(mode="medusa"))
    with pytest.raises(ModelLoadError, match="not a Medusa heads folder"):
        medusa_engine.load_heads(tmp_path)
    other = MedusaHeads.for_target(tiny_models.make_model(hidden=64), HeadsConfig(64, 2), [1, 2])
    other.save(tmp_path / "wide")
    with pytest.raises(ModelLoadError, match="hidden size 64"):
        medusa_engine.load_heads(tmp_path / "wide")
    assert medusa_engine.heads_version == "medusa:tiny-heads"
    # a request's footprint counts the tree's nodes, as mode tree's does, and the lookup's and store's branches
    # (gamma each)
    spec = SpecParams(mode="medusa", gamma=3, extra={"width": 2, "branch": 2})
    assert medusa_engine.footprint(10, GREEDY, spec) == 10 + 40 + 3 + 1 + (2 + 4 + 4) + 3 + 3


def _service(target, **settings) -> Service:
    s = ServiceSettings(target=str(target), buffer=False, served_model_name="tiny", **settings)
    return Service(s, hub=MetricsHub(live_stats=False))


def test_http_medusa_with_heads_and_a_clear_400_without(pair, heads_dir, tmp_path):
    """Heads configured in the settings are loaded by the replica; a replica without heads (or whose heads
    failed to load) answers mode medusa with an OpenAI-style 400 naming the fix, and still serves."""
    bad = tmp_path / "broken"
    bad.mkdir()
    (bad / "medusa_heads.json").write_text("{not json")
    (bad / "medusa_heads.safetensors").write_bytes(b"junk")
    body = {"prompt": "the cat sat", "max_tokens": 8, "temperature": 0, "speculative": {"mode": "medusa"}}
    for heads, ok in ((str(heads_dir), True), (None, False), (str(bad), False)):
        srv = LiveServer(_service(pair[0], medusa_heads=heads)).start()
        try:
            with httpx.Client(base_url=srv.url, timeout=60) as c:
                r = c.post("/v1/completions", json=body)
                if ok:
                    assert r.status_code == 200, r.text
                    assert r.json()["usage"]["completion_tokens"] == 8
                else:
                    assert r.status_code == 400, r.text
                    err = r.json()["error"]
                    assert err["code"] == "medusa_heads_unavailable" and err["param"] == "speculative.mode"
                    assert MEDUSA_NEEDS_HEADS in err["message"]
                    assert ("loading them failed" in err["message"]) == (heads is not None)
                    r2 = c.post("/v1/completions", json={**body, "speculative": {"mode": "target"}})
                    assert r2.status_code == 200
        finally:
            srv.stop()


def test_a_deployment_default_mode_serves_requests_that_name_none(pair, heads_dir):
    """`default_mode` (draftsmith serve --default-mode) decides the mode of requests without
    `speculative.mode`; an explicit mode still wins; while what the default needs is not loaded (no heads),
    such requests decode with mjsd instead of failing; a mode that does not exist is refused at start."""
    def mode_of(c, **extra) -> str:
        r = c.post("/v1/completions", json={"prompt": "the cat sat", "max_tokens": 6, "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        return r.json()["metrics"]["speculative_decoding"]["mode"]

    for heads, served, default in ((str(heads_dir), "medusa", "medusa"), (None, "mjsd", "medusa"),
                                   (str(heads_dir), "medusa", None), (None, "mjsd", None)):
        kw = {"default_mode": default} if default else {}               # None: the product's default, auto
        srv = LiveServer(_service(pair[0], draft=str(pair[1]), medusa_heads=heads, **kw)).start()
        try:
            with httpx.Client(base_url=srv.url, timeout=60) as c:
                assert c.get("/health").json()["default_mode"] == served
                assert mode_of(c) == served
                assert mode_of(c, speculative={"gamma": 2}) == served          # knobs without a mode
                assert mode_of(c, speculative={"mode": "target"}) == "target"
        finally:
            srv.stop()
    with pytest.raises(ValueError, match="default_mode must be one of mjsd"):
        ServiceSettings(default_mode="fastest")


def test_a_request_naming_no_mode_gets_mjsds_joint_test_on_the_heads_tree():
    """The served default on a tree verifies with rule mjsd (the product's rule) unless the request sets a rule;
    a request that names the mode gets the mode's own default rule (lossless)."""
    from serving.config import AUTO_MODE, served_mode
    from serving.protocol import CompletionRequest, spec_params

    def spec(**speculative):
        body = {"prompt": "x", **({"speculative": speculative} if speculative else {})}
        return spec_params(CompletionRequest(**body), True, "medusa")

    assert spec().mode == "medusa" and spec().extra["rule"] == "mjsd"
    assert spec(gamma=2).extra["rule"] == "mjsd" and spec(gamma=2).gamma == 2
    assert spec(params={"rule": "typical"}).extra["rule"] == "typical"
    assert spec(mode="medusa").extra["rule"] == "exact"
    assert spec(mode="mjsd").extra == {}
    assert spec_params(CompletionRequest(prompt="x"), True, "mjsd").extra == {}
    assert served_mode(AUTO_MODE, has_draft=True, has_heads=True, has_eagle=False) == "medusa"
    assert served_mode(AUTO_MODE, has_draft=True, has_heads=False, has_eagle=True) == "mjsd"
    assert served_mode(AUTO_MODE, has_draft=False, has_heads=False, has_eagle=False) == "target"
    assert served_mode("eagle", has_draft=False, has_heads=True, has_eagle=False) == "target"


def test_a_bf16_target_runs_its_heads_in_bf16_and_they_propose_what_the_fp32_heads_propose(pair, heads_dir):
    """On a bf16 target the heads are loaded in bf16 (Engine._load_kind), mode medusa drafts and decodes in
    bf16, and for the same hidden state the bf16 heads' top candidates are the fp32 heads'."""
    eng = Engine.from_paths(str(pair[0]), None, dtype=torch.bfloat16, device="cpu", heads=heads_dir)
    assert all(p.dtype == torch.bfloat16 for p in eng.heads.parameters()) and eng.heads.out_rows.dtype == torch.bfloat16
    prompt = ids(eng)
    res = eng.generate_all(prompt, SamplingParams(temperature=0.0, max_tokens=12), SpecParams(mode="medusa", gamma=3))
    assert len(res.token_ids) == 12 and res.stats.draft_tokens > 0
    fp32 = Engine.from_paths(str(pair[0]), None, dtype=torch.float32, device="cpu", heads=heads_dir)
    assert fp32.heads.out_rows.dtype == torch.float32
    torch.manual_seed(0)
    h = torch.randn(fp32.target.model.config.hidden_size)
    trees = [heads.propose(h, prompt[-1], [2, 1]).tokens for heads in (fp32.heads, eng.heads)]
    assert trees[0][:2] == trees[1][:2]                   # the first head's top two agree across precisions


# ---------------------------------------------------------------------------- the adaptive controller on the heads
def test_the_controller_prices_a_heads_tree_by_its_nodes():
    """An adaptive medusa request plans its tree's depth with the cost of verifying every node of the tree's
    shape, not a chain of that depth: where verification gets dear past a few tokens, the (2,1,1) tree stops
    at a shallower depth than a chain (4 tokens for depth 3) at the same acceptance, and where verification is flat it goes deep."""
    from serving.controller import CostModel, Plan, ReplicaPriors, RequestController
    from serving.decoding.tree import tree_branching, tree_size

    def model(per_token: float, free: int = 4) -> CostModel:
        """A target pass costs 50 ms up to `free` tokens, then `per_token` of that per extra token."""
        c = CostModel(weight=1.0)
        for n in range(1, 10):
            c.observe_target(n, 0.05 * (1 + per_token * max(0, n - free)))
        c.observe_draft("medusa", 1, 0.001)
        return c

    nodes = lambda k: 1 + tree_size(tree_branching(k, 2, 1))      # noqa: E731
    assert [nodes(k) for k in (1, 2, 3)] == [3, 5, 7]

    def ctrl(c, verify):
        r = RequestController(gamma=3, costs=c, priors=ReplicaPriors(prior=0.6), version="h", greedy=True,
                              draft_key="medusa", verify_tokens=verify)
        r._estimate("draft")
        r.evidence["draft"] = 100          # as if the replica's traffic stood behind the prior: no caution
        return r

    steep = model(0.5)
    tree, chain = ctrl(steep, nodes), ctrl(steep, None)
    assert tree.step_s(3) == pytest.approx(3 * 0.001 + steep.target_s(7) + steep.overhead_s(True))
    assert tree.step_s(0) == chain.step_s(0)
    assert 0 < tree.plan().k < chain.plan().k == 3
    assert ctrl(model(0.0), nodes).plan().k == 3
    hopeless = ctrl(model(0.3, free=1), nodes)     # a one-token tree (3 tokens) costs 1.6 steps
    for _ in range(20):                    # twenty rejected one-token trees
        hopeless.observe(Plan("draft", 1), 0, 1)
    assert hopeless.plan().k == 0


def random_depths(monkeypatch, seed: int):
    """Replace the controller's choice by a random depth (0..gamma) every step."""
    import random

    from serving import engine as engine_module
    from serving.controller import Plan

    rng = random.Random(seed)
    monkeypatch.setattr(engine_module.RequestController, "plan",
                        lambda self, ngram_available=0: Plan("draft", k) if (k := rng.randint(0, self.gamma))
                        else Plan("none", 0))


@pytest.mark.parametrize("plans", ["controller", "random"])
def test_adaptive_medusa_is_target_greedy_at_t0_under_any_depths(pair, heads_dir, monkeypatch, plans):
    if plans == "random":
        random_depths(monkeypatch, seed=4)
    sink = tiny_models.ListSink()
    eng = make_engine(pair[0], pair[1], draft_version="v1", heads=heads_dir, sink=sink, record_top_k=5)
    prompt = ids(eng)
    res = eng.generate_all(prompt, GREEDY, SpecParams(mode="medusa", gamma=3), request_id="r1")
    assert res.token_ids == reference_greedy(eng.target.model, prompt, GREEDY.max_tokens)
    st = res.stats
    assert st.adaptive and st.draft_tokens <= 3 * st.steps
    assert len(sink.steps) == st.steps                       # every step recorded, plain ones too
    if plans == "random":
        assert 0 < st.zero_draft_steps < st.steps and st.draft_tokens > 0
        plain = [r for r in sink.steps if len(r.draft_tokens) == 0]
        assert plain and all(r.algorithm == "target" and r.draft_version == "none" for r in plain)
        assert st.draft_versions["none"]["steps"] >= st.zero_draft_steps


HEADS_ONLY = {"lookup_ngram": 0, "suffix": 0}   # the heads' tree alone, without the lookup's or the store's branch


def test_hopeless_heads_stop_drafting_and_a_seed_reproduces_the_output(pair, heads_dir, monkeypatch):
    """Random heads are almost never right: on a real pair's costs the controller soon takes plain steps
    (probing now and then), and a seeded sampled request under the controller repeats its output. (Without the
    prompt lookup's branch, which on the tiny target's repetitive greedy text is right most of the time.)"""
    from serving.controller import CostModel, ReplicaPriors

    eng = make_engine(pair[0], pair[1], draft_version="v1", heads=heads_dir)
    fixed = CostModel(weight=1.0)
    for n in range(1, 10):
        fixed.observe_target(n, 0.03 * (1 + 0.03 * (n - 1)))
    fixed.observe_target = fixed.observe_draft = lambda *a: None
    monkeypatch.setattr(eng, "costs", fixed)
    monkeypatch.setattr(eng, "priors", ReplicaPriors())
    prompt = ids(eng)
    sampling = SamplingParams(temperature=0.0, max_tokens=60)
    eng.generate_all(prompt, sampling, SpecParams(mode="medusa", gamma=3, extra=HEADS_ONLY))
    st = eng.generate_all(prompt, sampling, SpecParams(mode="medusa", gamma=3, extra=HEADS_ONLY)).stats
    assert st.zero_draft_steps >= 0.6 * st.steps, st
    warm = SamplingParams(temperature=0.8, max_tokens=30, seed=9)
    a = eng.generate_all(prompt, warm, SpecParams(mode="medusa", gamma=3, extra={"rule": "mjsd", **HEADS_ONLY}))
    b = eng.generate_all(prompt, warm, SpecParams(mode="medusa", gamma=3, extra={"rule": "mjsd", **HEADS_ONLY}))
    assert a.token_ids == b.token_ids and a.stats.adaptive


@pytest.mark.parametrize("mode", ["tree", "bild", "staged", "medusa"])
def test_a_step_of_a_mode_that_runs_alone_is_counted_once_under_its_version(medusa_engine, mode):
    """Per-version statistics (responses, MLflow's live figures) count every step once, under the version that
    proposed it: the steps of the modes that run alone add up to the request's steps."""
    spec = SpecParams(mode=mode, gamma=3, adaptive=False)
    st = medusa_engine.generate_all(ids(medusa_engine), GREEDY, spec).stats
    assert sum(v["steps"] for v in st.draft_versions.values()) == st.steps > 0
    assert sum(v["draft_tokens"] for v in st.draft_versions.values()) == st.draft_tokens
    want = "medusa:tiny-heads" if mode == "medusa" else "v1"
    assert st.draft_versions[want]["draft_tokens"] == st.draft_tokens


@pytest.mark.parametrize("batch_trees", [True, False])
def test_concurrent_medusa_requests_share_one_tree_pass_and_stay_target_greedy(medusa_engine, monkeypatch,
                                                                               batch_trees):
    """Concurrent medusa requests (different prompt lengths, a one-token prompt, different tree shapes, beside a
    batched chain request) verify their trees in ONE target pass per round (serving/scheduler.py `_tree_step`):
    T=0 output equal to target greedy, and after every round each tree row's cache holds exactly its accepted
    sequence. `Engine.batch_trees = False` (the benchmark's A/B arm) steps each alone, with the same output."""
    from tests.serving.test_engine_rules import assert_rows_hold

    monkeypatch.setattr(medusa_engine, "batch_trees", batch_trees)
    p = ids(medusa_engine)
    sampling = SamplingParams(temperature=0.0, max_tokens=24)
    jobs = [(p, sampling, SpecParams(mode="medusa", gamma=3, adaptive=False)),
            (p[:7], sampling, SpecParams(mode="medusa", gamma=3)),
            (p[:1], sampling, SpecParams(mode="medusa", gamma=2, extra={"width": 2, "branch": 2})),
            (p[:9], sampling, SpecParams(mode="speculative", gamma=3, adaptive=False))]
    want = [reference_greedy(medusa_engine.target.model, prompt, 24) for prompt, _, _ in jobs]
    rows, errors = [], []

    def check(sched):
        try:
            rows.append(len(sched.trees))
            for r, req in enumerate(sched.trees):
                assert_rows_hold(sched.tree_kv, r, req.seq[:-1], f"tree row {r}")
        except BaseException as exc:  # noqa: BLE001 - raised on the scheduler thread: hand it to the test
            errors.append(exc)

    medusa_engine.scheduler.on_round = check
    try:
        got = run_concurrently(medusa_engine, jobs)
    finally:
        medusa_engine.scheduler.on_round = None
    assert not errors, errors[0]
    assert [r.token_ids for r in got] == want
    assert all(r.stats.steps > 0 for r in got)
    assert (max(rows) >= 2) if batch_trees else (max(rows) == 0)


def test_a_request_counts_the_passes_of_other_requests_it_waited_through(medusa_engine):
    """serving/scheduler.py `_round`: a heads request and a draft request in flight together each wait through the
    other's pass (`GenerationStats.other_steps_s`, left out of the drafter choice's measurement); two chain rows
    share one pass and wait through none of each other's."""
    p = ids(medusa_engine)
    sampling = SamplingParams(temperature=0.0, max_tokens=24)
    mixed = run_concurrently(medusa_engine, [(p, sampling, SpecParams(mode="medusa", gamma=3)),
                                             (p[:9], sampling, SpecParams(mode="mjsd", gamma=3))])
    assert all(0 < r.stats.other_steps_s < r.stats.wall_time_s for r in mixed), [r.stats for r in mixed]
    chains = run_concurrently(medusa_engine, [(p, sampling, SpecParams(mode="mjsd", gamma=3)),
                                              (p[:9], sampling, SpecParams(mode="speculative", gamma=3))])
    assert [r.stats.other_steps_s for r in chains] == [0.0, 0.0]
    assert all(r.stats.beside_jobs_s == 0.0 for r in mixed + chains)      # no job beside serving: nothing counted
    # the company of each step (`shared_steps`, `shared_steps_s`): the mixed pair stepped alone in its pass
    # throughout; the two chains shared one pass while both were in flight, and only within their own pass time
    assert all(r.stats.shared_steps == 0 and r.stats.shared_steps_s == 0.0 for r in mixed), [r.stats for r in mixed]
    assert all(0 < r.stats.shared_steps <= r.stats.steps for r in chains), [r.stats for r in chains]
    assert all(0 < r.stats.shared_steps_s <= r.stats.own_steps_s <= r.stats.wall_time_s for r in chains)
    assert all(0 < r.stats.own_steps_s < r.stats.wall_time_s for r in mixed)


class _Contended:
    """A ContentionWatch whose jobs beside serving hold `cores` (serving/contention.py)."""

    def __init__(self, cores: int) -> None:
        self.cores = cores

    def busy_cores(self) -> int:
        return self.cores


def test_a_request_counts_the_rounds_it_ran_beside_a_job(medusa_engine):
    """serving/scheduler.py `_round`: the rounds the replica ran on fewer threads because a job beside serving
    held cores count in `GenerationStats.beside_jobs_s` (the drafter choice keeps such figures apart), and the
    text is the target's greedy text all the same."""
    p = ids(medusa_engine)
    sampling = SamplingParams(temperature=0.0, max_tokens=24)
    jobs = [(p, sampling, SpecParams(mode="medusa", gamma=3)), (p[:9], sampling, SpecParams(mode="mjsd", gamma=3))]
    sched = medusa_engine.scheduler
    sched.contention = _Contended(1)
    try:
        got = run_concurrently(medusa_engine, jobs)
    finally:
        sched.contention = None
    assert all(0.5 * r.stats.wall_time_s < r.stats.beside_jobs_s <= r.stats.wall_time_s for r in got), \
        [r.stats for r in got]
    assert [r.token_ids for r in got] == [reference_greedy(medusa_engine.target.model, q, 24) for q, _, _ in jobs]


@pytest.mark.parametrize("rule", ["exact", "mjsd"])
def test_seeded_sampled_medusa_in_a_tree_batch_equals_alone(medusa_engine, rule):
    """A seeded sampled medusa request draws from its own generator on its own tree: run beside another tree
    row it gives the tokens it gives alone."""
    p = ids(medusa_engine)
    spec = SpecParams(mode="medusa", gamma=3, adaptive=False, extra={"rule": rule})
    jobs = [(p, SamplingParams(temperature=0.9, max_tokens=24, seed=11), spec),
            (p[:6], SamplingParams(temperature=0.7, max_tokens=24, seed=12), spec)]
    alone = [medusa_engine.generate_all(*job).token_ids for job in jobs]
    together = [r.token_ids for r in run_concurrently(medusa_engine, jobs)]
    assert together == alone and all(len(t) == 24 or t[-1] == tiny_models.EOS_ID for t in alone)
