"""Mode medusa's prompt-lookup branch (knob `lookup_ngram`, serving/engine.py `medusa_tree`): the continuation of the
context's longest earlier suffix n-gram joins the heads' tree as one more branch (serving/decoding/tree.py
`DraftTree.graft`); the lossless rules stay exact on the grafted tree; under MJSD's tree test the branch's nodes
carry log q 0 (a deterministic proposer); the knob's validation and the KV reservation."""
from __future__ import annotations

import pytest
import torch

import serving.decoding.tree as tree_module
from serving.config import SamplingParams, SpecParams
from serving.decoding.tree import ROOT, DraftTree, verify_deterministic
from serving.engine import medusa_tree
from tests.serving.test_medusa import heads_for, randomise
from tests.serving.test_medusa_mode import heads_dir, pair  # noqa: F401  (module fixtures: tiny pair, random heads)
from tests.serving.test_tree import N_SAMPLES, TV_BOUND, _dist, _empirical, _exact_two_token, _tv
from tests.tiny_models import make_model


def paths(tree: DraftTree) -> set[tuple[int, ...]]:
    """Every root-to-node token path of the tree."""
    out = set()
    for i in range(len(tree)):
        path, node = [], i
        while node != ROOT:
            path.append(tree.tokens[node])
            node = tree.parents[node]
        out.add(tuple(reversed(path)))
    return out


def test_graft_follows_matching_nodes_and_appends_the_rest_as_one_branch():
    t = DraftTree.from_paths([[1, 2, 3], [4, 5]])          # nodes 0..4: 1, 2, 3, 4, 5
    g = t.graft([1, 2, 7, 8])
    assert g.tokens[:5] == t.tokens and g.parents[:5] == t.parents     # existing nodes keep index and order
    assert g.tokens[5:] == (7, 8) and g.parents[5:] == (1, 5) and g.depth[5:] == (3, 4)
    assert g.children(1) == [2, 5]                         # the new node is its parent's last child
    assert paths(g) == paths(t) | {(1, 2, 7), (1, 2, 7, 8)}
    assert t.graft([1, 2]) is t and t.graft([4, 5]) is t and t.graft([]) is t     # nothing new: the same tree
    new = t.graft([9, 1])
    assert new.parents[5:] == (ROOT, 5) and new.children(ROOT) == [0, 3, 5]
    assert DraftTree((), ()).graft([3, 4]).tokens == (3, 4)


def _heads_and_hidden():
    target = make_model(seed=3, sharp=3.0)
    heads = randomise(heads_for(target, k=3), scale=0.3, seed=2)
    return heads, torch.randn(target.config.hidden_size, generator=torch.Generator().manual_seed(0))


def test_medusa_tree_grafts_the_lookup_continuation_cut_to_the_depth():
    heads, h = _heads_and_hidden()
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    context = [5, 6, 7, 8, 9, 5, 6]                         # suffix (5, 6) occurred before, followed by 7, 8, 9
    spec = SpecParams(mode="medusa", gamma=3)
    alone, _ = medusa_tree(heads, h, 6, 3, SpecParams(mode="medusa", gamma=3, extra={"lookup_ngram": 0}), greedy,
                           None, context=context)
    both, q = medusa_tree(heads, h, 6, 3, spec, greedy, None, context=context)
    assert q is None and spec.extra["lookup_ngram"] >= 1
    assert (7, 8, 9) in paths(both) and paths(both) == paths(alone) | {(7,), (7, 8), (7, 8, 9)}
    assert both.tokens[: len(alone)] == alone.tokens       # the heads' nodes first, unchanged
    two, _ = medusa_tree(heads, h, 6, 2, spec, greedy, None, context=context)
    assert max(two.depth) == 2 and (7, 8) in paths(two)
    # no match of 2+ tokens (the knob's shortest n-gram), no context, depth 0: no branch
    assert medusa_tree(heads, h, 6, 3, spec, greedy, None, context=[1, 2, 3, 4, 5, 6])[0] == alone
    assert medusa_tree(heads, h, 6, 3, spec, greedy, None)[0] == alone
    assert len(medusa_tree(heads, h, 6, 0, spec, greedy, None, context=context)[0]) == 0
    # the lookup of single tokens (lookup_ngram 1) matches the last token alone
    one, _ = medusa_tree(heads, h, 6, 3, SpecParams(mode="medusa", gamma=3, extra={"lookup_ngram": 1}), greedy,
                         None, context=[1, 6, 4, 2, 3, 6])
    assert (4, 2, 3) in paths(one)


def test_under_mjsd_the_lookup_nodes_carry_log_q_zero():
    """MJSD's joint test reads each node's proposer log q: the heads' nodes keep theirs, the lookup's new nodes
    get 0 (a deterministic proposer's point mass)."""
    heads, h = _heads_and_hidden()
    sampled = SamplingParams(temperature=0.8, max_tokens=8)
    warp = lambda x: torch.log_softmax(x, -1)
    context = [5, 6, 7, 8, 9, 5, 6]
    alone, q0 = medusa_tree(heads, h, 6, 3, SpecParams(mode="medusa", gamma=3, extra={"rule": "mjsd",
                                                                                        "lookup_ngram": 0}),
                            sampled, warp, context=context)
    tree, q = medusa_tree(heads, h, 6, 3, SpecParams(mode="medusa", gamma=3, extra={"rule": "mjsd"}), sampled, warp,
                          context=context)
    assert (7, 8, 9) in paths(tree) and len(q) == len(tree) > len(alone) == len(q0)
    assert torch.equal(q[: len(alone)], q0) and torch.all(q[len(alone):] == 0)


def test_the_deterministic_rule_is_exact_on_a_grafted_tree():
    """The lossless rule at T > 0 on a heads-like tree with a lookup branch that merges into it and one that
    starts a new root child: the first two emitted tokens follow the target's distribution."""
    heads_tree = DraftTree((1, 3, 2), (ROOT, ROOT, 0))
    tree = heads_tree.graft([3, 4]).graft([0, 2])            # under node 1 (token 3); a new root child 0 -> 2
    assert tree.parents == (ROOT, ROOT, 0, 1, ROOT, 4)
    rows = {ROOT: _dist(1), **{i: _dist(2 + i) for i in range(len(tree))},
            "off": {a: _dist(10 + a) for a in range(5)}}
    target = torch.stack([rows[ROOT]] + [rows[i] for i in range(len(tree))])
    emp = _empirical(tree, rows, lambda g: verify_deterministic(tree, target, g), N_SAMPLES, seed=1)
    assert _tv(emp, _exact_two_token(rows, tree)) < TV_BOUND


def test_served_medusa_with_the_lookup_branch_stays_target_greedy(pair, heads_dir, monkeypatch):  # noqa: F811
    """Adaptive and fixed-depth medusa at T=0 on a prompt that repeats itself: the lookup branch is grafted on
    (counted through DraftTree.graft) and the output equals target greedy, in the tree batch and alone."""
    from tests.serving.test_batching import run_concurrently
    from tests.serving.test_engine_rules import GREEDY, ids, make_engine, reference_greedy

    grafted = []
    real = tree_module.DraftTree.graft

    def spy(self, path):
        out = real(self, path)
        grafted.append(len(out) - len(self))
        return out

    monkeypatch.setattr(tree_module.DraftTree, "graft", spy)
    eng = make_engine(pair[0], pair[1], draft_version="v1", heads=heads_dir)
    prompt = ids(eng)
    expected = reference_greedy(eng.target.model, prompt, GREEDY.max_tokens)
    for spec in (SpecParams(mode="medusa", gamma=3), SpecParams(mode="medusa", gamma=3, adaptive=False)):
        assert eng.generate_all(prompt, GREEDY, spec).token_ids == expected
    assert grafted and max(grafted) >= 1                      # the branch added nodes on some steps
    jobs = [(prompt, GREEDY, SpecParams(mode="medusa", gamma=3, adaptive=False)),
            (prompt[:8], GREEDY, SpecParams(mode="medusa", gamma=2))]
    got = run_concurrently(eng, jobs)
    assert [r.token_ids for r in got] == [expected, reference_greedy(eng.target.model, prompt[:8], GREEDY.max_tokens)]


def test_lookup_ngram_is_a_medusa_knob_and_reserves_its_branch():
    from serving.config import MAX_NGRAM

    assert SpecParams(mode="medusa", extra={"lookup_ngram": 0}).extra["lookup_ngram"] == 0
    for bad in (-1, MAX_NGRAM + 1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="lookup_ngram must be an integer in"):
            SpecParams(mode="medusa", extra={"lookup_ngram": bad})
    with pytest.raises(ValueError, match="unknown parameter"):
        SpecParams(mode="tree", extra={"lookup_ngram": 2})


def test_the_kv_reservation_counts_the_lookup_branch(pair):  # noqa: F811
    from tests.serving.test_engine_rules import make_engine

    eng = make_engine(pair[0], None)
    s = SamplingParams(temperature=0.0, max_tokens=10)
    on = eng.footprint(20, s, SpecParams(mode="medusa", gamma=3, extra={"lookup_ngram": 2}))
    off = eng.footprint(20, s, SpecParams(mode="medusa", gamma=3, extra={"lookup_ngram": 0}))
    assert on - off == 3
