"""Mode medusa's suffix-store branch (knob `suffix`, serving/engine.py `medusa_tree`, serving/decoding/suffix.py):
the continuation the replica's earlier answers propose joins the heads' tree; T=0 output stays target greedy
whatever the store holds; a finished answer joins the store; the store can be off; its KV reservation."""
from __future__ import annotations

import pytest
import torch

from serving.config import SamplingParams, SpecParams
from serving.decoding.suffix import SuffixStore, suffix_store_enabled, teacher_answers
from serving.engine import medusa_tree
from tests.serving.test_medusa_lookup import _heads_and_hidden, paths
from tests.serving.test_medusa_mode import heads_dir, pair  # noqa: F401  (module fixtures: tiny pair, random heads)

NO_LOOKUP = {"lookup_ngram": 0}


def test_medusa_tree_grafts_the_store_continuation():
    heads, h = _heads_and_hidden()
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    store = SuffixStore()
    store.add([1, 2], [40, 41, 42, 43, 44])
    context = [9, 9, 40, 41]                                # ends like the stored answer's opening
    alone, _ = medusa_tree(heads, h, 41, 3, SpecParams(mode="medusa", gamma=3, extra={**NO_LOOKUP, "suffix": 0}),
                           greedy, None, context=context, store=store)
    both, _ = medusa_tree(heads, h, 41, 3, SpecParams(mode="medusa", gamma=3, extra=NO_LOOKUP), greedy, None,
                          context=context, store=store)
    assert paths(both) == paths(alone) | {(42,), (42, 43), (42, 43, 44)}
    assert both.tokens[: len(alone)] == alone.tokens        # the heads' nodes first, unchanged
    # no store, no match: the heads' tree alone
    assert medusa_tree(heads, h, 41, 3, SpecParams(mode="medusa", gamma=3, extra=NO_LOOKUP), greedy, None,
                       context=context)[0] == alone
    assert medusa_tree(heads, h, 41, 3, SpecParams(mode="medusa", gamma=3, extra=NO_LOOKUP), greedy, None,
                       context=[7, 8], store=store)[0] == alone
    # under MJSD the store's nodes carry log q 0, as the lookup's
    warp = lambda x: torch.log_softmax(x, -1)
    sampled = SamplingParams(temperature=0.8, max_tokens=8)
    t0, q0 = medusa_tree(heads, h, 41, 3, SpecParams(mode="medusa", gamma=3, extra={"rule": "mjsd", **NO_LOOKUP,
                                                                                     "suffix": 0}),
                         sampled, warp, context=context, store=store)
    t1, q1 = medusa_tree(heads, h, 41, 3, SpecParams(mode="medusa", gamma=3, extra={"rule": "mjsd", **NO_LOOKUP}),
                         sampled, warp, context=context, store=store)
    assert len(q1) == len(t1) > len(t0) and torch.equal(q1[: len(t0)], q0) and torch.all(q1[len(t0):] == 0)


def test_served_greedy_output_whatever_the_store_holds_and_answers_join_it(pair, heads_dir):  # noqa: F811
    """T=0 medusa equals target greedy with an empty store, a store holding a wrong continuation and one
    holding the right answer; with the right answer the request takes far fewer target passes. A finished
    request's answer joins the store, unless learning is off."""
    from tests.serving.test_engine_rules import GREEDY, ids, make_engine, reference_greedy

    eng = make_engine(pair[0], None, heads=heads_dir)
    assert isinstance(eng.suffix_store, SuffixStore) and eng.suffix_learn
    prompt = ids(eng, "one two three four five")
    expected = reference_greedy(eng.target.model, prompt, GREEDY.max_tokens)
    spec = SpecParams(mode="medusa", gamma=3, adaptive=False, extra=NO_LOOKUP)

    eng.suffix_learn = False
    eng.suffix_store = SuffixStore()
    cold = eng.generate_all(prompt, GREEDY, spec)
    assert cold.token_ids == expected and len(eng.suffix_store) == 0       # learning off: nothing stored
    wrong = SuffixStore()
    wrong.add(prompt, [(t + 1) % 250 for t in expected])
    eng.suffix_store = wrong
    assert eng.generate_all(prompt, GREEDY, spec).token_ids == expected
    eng.suffix_learn = True
    eng.suffix_store = SuffixStore()
    first = eng.generate_all(prompt, GREEDY, spec)
    assert first.token_ids == expected
    assert eng.suffix_store.answers == 1 and len(eng.suffix_store) > len(expected)   # the answer was learned
    again = eng.generate_all(prompt, GREEDY, spec)
    assert again.token_ids == expected
    assert again.stats.steps < cold.stats.steps / 2        # the stored answer is proposed and accepted
    assert again.stats.accepted_tokens > cold.stats.accepted_tokens
    # the knob off: the store is not read
    off = eng.generate_all(prompt, GREEDY, SpecParams(mode="medusa", gamma=3, adaptive=False,
                                                      extra={**NO_LOOKUP, "suffix": 0}))
    assert off.token_ids == expected and off.stats.steps == cold.stats.steps


def test_the_store_can_be_switched_off(pair, monkeypatch):  # noqa: F811
    from tests.serving.test_engine_rules import make_engine

    for value, on in (("0", False), ("off", False), ("1", True), ("", True)):
        monkeypatch.setenv("DRAFTSMITH_SUFFIX_STORE", value)
        assert suffix_store_enabled() is on
    monkeypatch.setenv("DRAFTSMITH_SUFFIX_STORE", "0")
    eng = make_engine(pair[0], None)
    assert eng.suffix_store is None
    eng.learn_answer([1, 2], [3, 4])                        # a no-op, never an error


def test_suffix_is_a_medusa_knob_and_reserves_its_branch(pair):  # noqa: F811
    from tests.serving.test_engine_rules import make_engine

    assert SpecParams(mode="medusa").extra["suffix"] == 1
    for bad in (-1, 2, 0.5, True, "1"):
        with pytest.raises(ValueError, match="suffix must be an integer in"):
            SpecParams(mode="medusa", extra={"suffix": bad})
    with pytest.raises(ValueError, match="unknown parameter"):
        SpecParams(mode="eagle", extra={"suffix": 1})
    eng = make_engine(pair[0], None)
    s = SamplingParams(temperature=0.0, max_tokens=10)
    on = eng.footprint(20, s, SpecParams(mode="medusa", gamma=3))
    off = eng.footprint(20, s, SpecParams(mode="medusa", gamma=3, extra={"suffix": 0}))
    assert on - off == 3


def test_seeding_from_teacher_data(tmp_path):
    from training.teacher import save_examples

    examples = [{"tokens": [1, 2, 3, 10, 11, 12], "prompt_len": 3, "topk_ids": torch.zeros(3, 2, dtype=torch.int32)
                 .numpy(), "topk_logprobs": torch.zeros(3, 2, dtype=torch.float16).numpy(), "source": "chat"},
                {"tokens": [4, 5, 20, 21], "prompt_len": 2, "topk_ids": torch.zeros(2, 2, dtype=torch.int32).numpy(),
                 "topk_logprobs": torch.zeros(2, 2, dtype=torch.float16).numpy(), "source": "gsm8k"}]
    path = tmp_path / "teacher.safetensors"
    save_examples(examples, path)
    assert teacher_answers(path) == [([1, 2, 3], [10, 11, 12]), ([4, 5], [20, 21])]
    store = SuffixStore()
    assert store.seed(path) == 2 and store.propose([0, 10, 11], 2) == [12]
    assert SuffixStore().seed(tmp_path / "missing.safetensors") == 0          # logged, not raised
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    assert SuffixStore().seed(tmp_path / "bad.safetensors") == 0


def test_an_engine_refuses_seed_data_of_another_vocabulary(pair, tmp_path):  # noqa: F811
    from tests.serving.test_engine_rules import make_engine
    from training.teacher import save_examples

    z = lambda n: (torch.zeros(n, 2, dtype=torch.int32).numpy(), torch.zeros(n, 2, dtype=torch.float16).numpy())
    eng = make_engine(pair[0], None)
    for name, tokens, took in (("fits", [1, 2, 3, 10, 11, 12], 1), ("foreign", [1, 2, 3, 10, 40000, 12], 0)):
        ids_, lps = z(3)
        save_examples([{"tokens": tokens, "prompt_len": 3, "topk_ids": ids_, "topk_logprobs": lps}],
                      tmp_path / f"{name}.safetensors")
        eng.suffix_store = SuffixStore()
        assert eng.seed_suffix_store(tmp_path / f"{name}.safetensors") == took
        assert (len(eng.suffix_store) > 0) == bool(took)


def test_the_service_seeds_its_store_from_the_bootstrap(tmp_path, monkeypatch):
    from serving.service import settings_from_env

    monkeypatch.setenv("DRAFTSMITH_DATA", str(tmp_path))
    monkeypatch.delenv("DRAFTSMITH_SUFFIX_SEED", raising=False)
    assert settings_from_env().suffix_seed is None                   # no bootstrap yet
    (tmp_path / "bootstrap").mkdir()
    (tmp_path / "bootstrap" / "teacher.safetensors").write_bytes(b"x")
    assert settings_from_env().suffix_seed == str(tmp_path / "bootstrap" / "teacher.safetensors")
    monkeypatch.setenv("DRAFTSMITH_SUFFIX_SEED", "/elsewhere/t.safetensors")
    assert settings_from_env().suffix_seed == "/elsewhere/t.safetensors"
    monkeypatch.setenv("DRAFTSMITH_SUFFIX_SEED", "none")
    assert settings_from_env().suffix_seed is None


def test_a_seeded_sampled_request_does_not_read_the_store(pair, heads_dir):  # noqa: F811
    """A seeded request at T > 0 reproduces its output whatever the store learned in between (the store would
    change the tree, and with it which random draws the rule makes); unseeded and greedy requests read it."""
    from tests.serving.test_engine_rules import ids, make_engine

    eng = make_engine(pair[0], None, heads=heads_dir)
    seeded = SamplingParams(temperature=0.9, max_tokens=24, seed=5)
    assert eng.store_for(seeded) is None
    assert eng.store_for(SamplingParams(temperature=0.9, max_tokens=24)) is eng.suffix_store
    assert eng.store_for(SamplingParams(temperature=0.0, max_tokens=24, seed=5)) is eng.suffix_store
    prompt = ids(eng, "one two three four five")
    spec = SpecParams(mode="medusa", gamma=3, adaptive=False, extra=NO_LOOKUP)
    eng.suffix_store = SuffixStore()
    first = eng.generate_all(prompt, seeded, spec).token_ids
    for i in range(3):                                   # the store now holds answers to this very prompt
        eng.generate_all(prompt, SamplingParams(temperature=0.9, max_tokens=24, seed=100 + i), spec)
    assert eng.suffix_store.answers == 4
    assert eng.generate_all(prompt, seeded, spec).token_ids == first


def test_http_replica_seeds_learns_and_reports_its_store(pair, heads_dir, tmp_path):  # noqa: F811
    """Over HTTP: a replica seeded from teacher data reports its store in /health, every finished completion
    adds an answer (not one whose `log_mode` is "none", nor the replica's own calibration requests), the knob
    travels in `speculative.params`, and a bad value is a 400 naming it."""
    import httpx

    from tests.api_helpers import LiveServer
    from tests.serving.test_medusa_mode import _service
    from training.teacher import save_examples

    ids_, lps = torch.zeros(3, 2, dtype=torch.int32).numpy(), torch.zeros(3, 2, dtype=torch.float16).numpy()
    seed = tmp_path / "teacher.safetensors"
    save_examples([{"tokens": [5, 6, 7, 10, 11, 12], "prompt_len": 3, "topk_ids": ids_, "topk_logprobs": lps}], seed)
    srv = LiveServer(_service(pair[0], medusa_heads=str(heads_dir), suffix_seed=str(seed))).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            store = c.get("/health").json()["suffix_store"]
            assert store["answers"] == 1 and store["tokens"] == 7 and store["seed"] == str(seed)
            for params in ({}, {"suffix": 0}):
                r = c.post("/v1/completions", json={"prompt": "the cat sat", "max_tokens": 6, "temperature": 0,
                                                    "speculative": {"mode": "medusa", "params": params}})
                assert r.status_code == 200, r.text
            assert c.get("/health").json()["suffix_store"]["answers"] == 3
            r = c.post("/v1/completions", json={"prompt": "the dog ran", "max_tokens": 6, "log_mode": "none"})
            assert r.status_code == 200, r.text
            assert c.get("/health").json()["suffix_store"]["answers"] == 3     # kept nowhere: not in the store
            r = c.post("/v1/completions", json={"prompt": "the cat sat", "max_tokens": 6,
                                                "speculative": {"mode": "medusa", "params": {"suffix": 2}}})
            assert r.status_code == 400 and "suffix must be an integer in [0, 1]" in r.json()["error"]["message"]
    finally:
        srv.stop()
