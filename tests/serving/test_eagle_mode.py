"""Mode "eagle" served by the engine and the HTTP API: T=0 equal to target greedy for each tree shape, T=1
the same draws as the reference loop (`eagle_generate`, whose distribution test is in test_eagle.py),
rules typical and mjsd on the head's tree, records under the head's version, beside the batch and from a
one-token prompt, a head swapped mid-request, clear errors without a head (engine, HTTP 400) and for a bad
head folder (the replica still serves)."""
from __future__ import annotations

import httpx
import pytest
import torch

from serving.config import SamplingParams, SpecParams
from serving.decoding.eagle import EagleDrafter, eagle_generate
from serving.engine import EAGLE_NEEDS_HEAD, Engine, _RequestState
from serving.metrics import MetricsHub
from serving.models import ModelLoadError
from serving.service import Service, ServiceSettings
from tests import tiny_models
from tests.api_helpers import LiveServer
from tests.serving.test_batching import run_concurrently
from tests.serving.test_eagle import features, random_head, teacher_forced
from tests.serving.test_medusa_mode import assert_records_rebuild_the_sequence
from tests.serving.test_engine_rules import GREEDY, ids, make_engine, one_thread, reference_greedy  # noqa: F401


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_models.save_pair(tmp_path_factory.mktemp("pair"))


def _random_head_dir(pair, tmp_path_factory, name, seed):
    target = Engine.from_paths(str(pair[0]), None, dtype=torch.float32).target.model
    return random_head(target, seed=seed, scale=0.2).save(tmp_path_factory.mktemp(name) / name)


@pytest.fixture(scope="module")
def head_dir(pair, tmp_path_factory):
    """A head trained (training/heads.py build_eagle, a few seconds) on the tiny target's greedy answers to
    the test prompts and a few random ones, so its trees are accepted in part: a random head on a random
    target agrees with it on no token, and a test could not tell drafting from not drafting."""
    from tests.training.test_heads import teacher_examples
    from training.heads import build_eagle

    eng = Engine.from_paths(str(pair[0]), None, dtype=torch.float32)
    p = ids(eng)
    g = torch.Generator().manual_seed(0)
    prompts = [p, p[:7]] + [torch.randint(0, 256, (6,), generator=g).tolist() for _ in range(4)]
    exs = teacher_examples(eng.target.model, prompts, 40)
    out = tmp_path_factory.mktemp("tiny-eagle") / "tiny-eagle"
    build_eagle(eng.target.model, eng.tokenizer, exs, exs[:2], out, vocab_size=259, budget_s=30, batch_size=4,
                lr=3e-3, max_epochs=40, progress=lambda m: None)
    return out


@pytest.fixture(scope="module")
def eagle_engine(pair, head_dir):
    return make_engine(pair[0], pair[1], draft_version="v1", eagle=head_dir)


@pytest.mark.parametrize("gamma,extra", [(3, {}), (2, {"width": 3, "branch": 2}), (5, {"width": 1, "branch": 1})])
def test_temperature_zero_equals_target_greedy(eagle_engine, gamma, extra):
    prompt = ids(eagle_engine)
    expected = reference_greedy(eagle_engine.target.model, prompt, GREEDY.max_tokens)
    res = eagle_engine.generate_all(prompt, GREEDY, SpecParams(mode="eagle", gamma=gamma, extra=extra))
    assert res.token_ids == expected
    assert res.stats.mode == "eagle" and res.stats.draft_version == "eagle:tiny-eagle"
    assert res.stats.draft_tokens > 0 and res.stats.accepted_tokens > 0
    assert res.stats.steps < len(expected)


def test_sampling_draws_as_the_reference_loop(eagle_engine):
    """At T=1 the engine's step is `eagle_generate`'s step: same head, same tree, same rule, same generator,
    so the same tokens for every seed (the reference loop's exact-distribution test is in test_eagle.py)."""
    prompt = ids(eagle_engine)
    sampling = dict(temperature=1.0, top_k=0, top_p=1.0, max_tokens=24)
    agree = 0
    for seed in range(4):
        res = eagle_engine.generate_all(prompt, SamplingParams(seed=seed, **sampling), SpecParams(mode="eagle", gamma=3))
        ref, stats = eagle_generate(eagle_engine.target.model, eagle_engine.eagle, prompt, 24, (2, 1, 1),
                                    temperature=1.0, generator=torch.Generator().manual_seed(seed),
                                    eos_id=tiny_models.EOS_ID)
        assert res.token_ids == ref
        assert res.stats.accepted_tokens == stats.accepted
        agree += stats.accepted
    assert agree > 0


@pytest.mark.parametrize("rule", ["typical", "mjsd"])
def test_lossy_rules_run_on_the_heads_tree(eagle_engine, rule):
    prompt = ids(eagle_engine)
    spec = SpecParams(mode="eagle", gamma=3, extra={"rule": rule})
    assert eagle_engine.generate_all(prompt, GREEDY, spec).token_ids == \
        reference_greedy(eagle_engine.target.model, prompt, GREEDY.max_tokens)
    warm = SamplingParams(temperature=0.7, max_tokens=30, seed=5)
    a = eagle_engine.generate_all(prompt, warm, spec)
    b = eagle_engine.generate_all(prompt, warm, spec)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 30       # deterministic given the seed
    assert a.stats.accepted_tokens > 0


def test_rule_mjsd_threshold_decides_on_the_heads_tree(eagle_engine):
    """tau >= 1 accepts no node (the joint ratio never exceeds 1), tau <= 0 every node of the deepest path
    (every ratio is > 0 when the target's warp keeps every token), T = 0 stays greedy whatever tau."""
    prompt = ids(eagle_engine)
    warm = SamplingParams(temperature=0.8, top_k=0, top_p=1.0, max_tokens=24, seed=3)
    spec = lambda tau: SpecParams(mode="eagle", gamma=3, extra={"rule": "mjsd", "tau": tau})
    none = eagle_engine.generate_all(prompt, warm, spec(1.0))
    assert none.stats.accepted_tokens == 0 and none.stats.steps == len(none.token_ids)
    every = eagle_engine.generate_all(prompt, warm, spec(0.0))
    assert every.stats.accepted_tokens == 3 * every.stats.steps
    assert eagle_engine.generate_all(prompt, GREEDY, spec(1.0)).token_ids == \
        reference_greedy(eagle_engine.target.model, prompt, GREEDY.max_tokens)


def test_mjsd_log_q_is_the_heads_row_over_its_kept_vocabulary(pair):
    """Rule mjsd reads each node's log q from the head's row at its parent over the kept vocabulary (a head
    that keeps a third of the tokens), warped as the request's target rows are: checked against the head run
    teacher-forced over each path (the root's row; a depth-1 node's row from its fed-back feature)."""
    target = Engine.from_paths(str(pair[0]), None, dtype=torch.float32).target.model
    kept = list(range(0, 259, 3))
    head = random_head(target, seed=2, ids=kept)
    prompt = [5, 9, 100, 42, 7, 13]
    feats = features(target, prompt[:-1])
    states = teacher_forced(head, feats, prompt[1:])
    for temperature in (1.0, 0.5):
        warp = lambda x: torch.log_softmax(x / temperature, dim=-1)
        drafter = EagleDrafter(head, (2, 1))
        drafter.push(feats, prompt[1:])
        tree, logq = drafter.propose_with_logq(warp)
        assert len(logq) == len(tree) == 4 and torch.all(torch.isfinite(logq))
        for i, (tok, parent) in enumerate(zip(tree.tokens, tree.parents)):
            if parent == -1:
                row = head.logits(states[-1])
            else:
                st = teacher_forced(head, list(feats) + [states[-1]], list(prompt[1:]) + [tree.tokens[parent]])
                row = head.logits(st[-1])
            assert float(logq[i]) == pytest.approx(float(warp(row)[kept.index(tok)]), abs=1e-5)


def test_records_rebuild_the_sequence_under_the_heads_version(pair, head_dir):
    sink = tiny_models.ListSink()
    eng = make_engine(pair[0], pair[1], draft_version="v7", sink=sink, record_top_k=5, eagle=head_dir)
    prompt = ids(eng)
    res = eng.generate_all(prompt, SamplingParams(temperature=1.0, max_tokens=30, seed=2),
                           SpecParams(mode="eagle", gamma=3), request_id="r1", source="unit")
    assert_records_rebuild_the_sequence(sink, prompt, res, "eagle", "eagle:tiny-eagle", gamma=3, top_k=5)


def test_runs_beside_the_batch_and_from_a_one_token_prompt(eagle_engine):
    sampling = SamplingParams(temperature=0.0, max_tokens=20)
    p = ids(eagle_engine)
    jobs = [(p, sampling, SpecParams(mode="speculative", gamma=3, adaptive=False)),
            (p[:7], sampling, SpecParams(mode="eagle", gamma=3)),
            (p[:1], sampling, SpecParams(mode="eagle", gamma=2, extra={"width": 2, "branch": 2}))]
    want = [reference_greedy(eagle_engine.target.model, prompt, 20) for prompt, _, _ in jobs]
    got = run_concurrently(eagle_engine, jobs)
    assert [r.token_ids for r in got] == want


def test_a_head_swapped_mid_request_rebuilds_its_cache(pair, head_dir, tmp_path_factory):
    """A request's next step after a hot-swap drafts with the new head from the target's features of the
    whole sequence (not the old head's cache); the output stays the target's greedy tokens."""
    eng = make_engine(pair[0], pair[1], eagle=head_dir)
    other = _random_head_dir(pair, tmp_path_factory, "other-eagle", 5)
    prompt = ids(eng)
    state = _RequestState(eng, prompt)
    gen = torch.Generator().manual_seed(0)
    spec = SpecParams(mode="eagle", gamma=3)
    stats = eng.generate_all(prompt, GREEDY, spec).stats
    out = []
    for _ in range(3):
        out += state.spec_step(GREEDY, spec, gen, stats, "r", None)
    first = state.eagle_drafter
    assert eng.load_eagle(other) == "eagle:other-eagle"
    for _ in range(3):
        out += state.spec_step(GREEDY, spec, gen, stats, "r", None)
    assert state.eagle_drafter is not first and state.eagle_drafter.head is eng.eagle
    d = state.eagle_drafter                                    # inputs (f_t, x_t+1) for t < len(seq) - 1, fed or queued
    assert d.committed + len(d.pending_tokens) == len(state.seq) - 1
    assert out == reference_greedy(eng.target.model, prompt, len(out))


def test_plain_target_steps_between_head_steps_are_fed_to_the_head(eagle_engine):
    """Near the context limit the engine takes plain target steps; the next eagle step first feeds the head
    the features of those positions (one target pass), so its inputs stay aligned with the sequence."""
    prompt = ids(eagle_engine)
    state = _RequestState(eagle_engine, prompt)
    gen = torch.Generator().manual_seed(0)
    spec = SpecParams(mode="eagle", gamma=3)
    stats = eagle_engine.generate_all(prompt, GREEDY, spec).stats
    out = state.spec_step(GREEDY, spec, gen, stats, "r", None)
    out += state.target_step(GREEDY, gen, stats) + state.target_step(GREEDY, gen, stats)
    d = state.eagle_drafter
    assert d.committed + len(d.pending_tokens) == len(state.seq) - 3
    accepted = stats.accepted_tokens
    for _ in range(4):
        out += state.spec_step(GREEDY, spec, gen, stats, "r", None)
        assert d.committed + len(d.pending_tokens) == len(state.seq) - 1
    assert out == reference_greedy(eagle_engine.target.model, prompt, len(out))
    assert stats.accepted_tokens > accepted


def test_without_a_head_the_engine_refuses_and_a_bad_folder_keeps_the_old_head(eagle_engine, pair, tmp_path):
    lonely = make_engine(pair[0], pair[1])
    assert lonely.eagle is None and lonely.eagle_version == "none"
    with pytest.raises(ValueError, match="needs an EAGLE-style head"):
        lonely.generate_all(ids(lonely), GREEDY, SpecParams(mode="eagle"))
    with pytest.raises(ModelLoadError, match="not an EAGLE head folder"):
        eagle_engine.load_eagle(tmp_path)
    random_head(tiny_models.make_model(hidden=64)).save(tmp_path / "wide")
    with pytest.raises(ModelLoadError, match="hidden size 64"):
        eagle_engine.load_eagle(tmp_path / "wide")
    assert eagle_engine.eagle_version == "eagle:tiny-eagle"
    spec = SpecParams(mode="eagle", gamma=3, extra={"width": 2, "branch": 2})
    assert eagle_engine.footprint(10, GREEDY, spec) == 10 + 40 + 3 + 1 + (2 + 4 + 4)


def test_http_eagle_with_a_head_and_a_clear_400_without(pair, head_dir, tmp_path):
    """A head configured in the settings is loaded by the replica and named in /health; a replica without
    one (or whose head failed to load) answers mode eagle with an OpenAI-style 400 naming the fix, and
    still serves."""
    bad = tmp_path / "broken"
    bad.mkdir()
    (bad / "eagle_head.json").write_text("{not json")
    (bad / "eagle_head.safetensors").write_bytes(b"junk")
    body = {"prompt": "the cat sat", "max_tokens": 8, "temperature": 0, "speculative": {"mode": "eagle"}}
    for head, ok in ((str(head_dir), True), (None, False), (str(bad), False)):
        s = ServiceSettings(target=str(pair[0]), buffer=False, served_model_name="tiny", eagle_head=head)
        srv = LiveServer(Service(s, hub=MetricsHub(live_stats=False))).start()
        try:
            with httpx.Client(base_url=srv.url, timeout=60) as c:
                r = c.post("/v1/completions", json=body)
                health = c.get("/health").json()
                if ok:
                    assert r.status_code == 200, r.text
                    assert r.json()["usage"]["completion_tokens"] == 8
                    assert health["eagle_head"] == "eagle:tiny-eagle" and health["eagle_error"] is None
                else:
                    assert r.status_code == 400, r.text
                    err = r.json()["error"]
                    assert err["code"] == "eagle_head_unavailable" and err["param"] == "speculative.mode"
                    assert EAGLE_NEEDS_HEAD in err["message"]
                    assert ("loading it failed" in err["message"]) == (head is not None)
                    assert health["eagle_head"] == "none" and (health["eagle_error"] is not None) == (head is not None)
                    r2 = c.post("/v1/completions", json={**body, "speculative": {"mode": "target"}})
                    assert r2.status_code == 200
        finally:
            srv.stop()


def test_a_bf16_target_runs_its_eagle_head_in_bf16_and_its_proposals_follow_the_fp32_head(pair, head_dir):
    """On a bf16 target the head is loaded in bf16 (Engine._load_kind: the fp32 head's layer and rows were
    most of its drafting time on a bf16 CPU); mode eagle then drafts and decodes in bf16, and at T=0 it
    proposes (nearly) the trees the fp32 head proposes for the same committed inputs."""
    eng = Engine.from_paths(str(pair[0]), None, dtype=torch.bfloat16, device="cpu", eagle=head_dir)
    assert eng.eagle.fc.weight.dtype == torch.bfloat16 and eng.eagle.out_rows.dtype == torch.bfloat16
    prompt = ids(eng)
    res = eng.generate_all(prompt, SamplingParams(temperature=0.0, max_tokens=12), SpecParams(mode="eagle", gamma=3))
    assert len(res.token_ids) == 12 and res.stats.draft_tokens > 0 and res.stats.accepted_tokens > 0
    fp32 = Engine.from_paths(str(pair[0]), None, dtype=torch.float32, device="cpu", eagle=head_dir)
    assert fp32.eagle.fc.weight.dtype == torch.float32
    feats = features(fp32.target.model, prompt)
    trees = []
    for head in (fp32.eagle, eng.eagle):
        d = EagleDrafter(head, [2, 1, 1])
        d.push(feats[:-1], prompt[1:])
        trees.append(d.propose().tokens)
    assert trees[0][:2] == trees[1][:2]                   # the root's two children agree across precisions
