"""Mode medusa's `node_floor` (serving/decoding/medusa.py `grow_tree`): the heads' doubt prunes their tree by path
probability, the root's first child always stays, the full shape at 0; a pruned tree is still verified losslessly;
the controller prices a tree by the nodes its trees verified and counts a pruned depth as not accepted; the knob's
validation; the replay script's core."""
from __future__ import annotations

import math

import pytest
import torch

from serving.config import SpecParams
from serving.decoding.medusa import grow_tree
from serving.decoding.tree import ROOT
from tests.serving.test_medusa_mode import heads_dir, pair  # noqa: F401  (module fixtures: tiny pair, random heads)


def logits_from(probs: list[list[float]]) -> torch.Tensor:
    """Rows of probabilities (each summing to 1) as logits whose softmax gives them back."""
    return torch.log(torch.tensor(probs, dtype=torch.float32))


# head 1: top-2 = col 0 (0.6), col 1 (0.3); head 2: col 2 (0.5); head 3: col 3 (0.2)
PROBS = [[0.6, 0.3, 0.05, 0.05], [0.1, 0.2, 0.5, 0.2], [0.3, 0.25, 0.25, 0.2]]
IDS = [10, 11, 12, 13]


def test_floor_zero_is_the_full_shape():
    tree, _, depths, cols = grow_tree(logits_from(PROBS), (2, 1, 1), IDS, 0.0)
    assert tree.tokens == (10, 11, 12, 12, 10, 10) and tree.parents == (ROOT, ROOT, 0, 1, 2, 3)
    assert depths == [0, 0, 1, 1, 2, 2] and cols == [0, 1, 2, 2, 0, 0]


def test_nodes_below_the_floor_go_with_their_subtrees():
    # paths: 0.6, 0.3 | 0.6*0.5=0.3, 0.3*0.5=0.15 | 0.3*0.3=0.09, 0.15*0.3=0.045
    tree, _, _, _ = grow_tree(logits_from(PROBS), (2, 1, 1), IDS, 0.1)
    assert tree.tokens == (10, 11, 12, 12) and tree.parents == (ROOT, ROOT, 0, 1)
    tree, _, _, _ = grow_tree(logits_from(PROBS), (2, 1, 1), IDS, 0.2)
    assert tree.tokens == (10, 11, 12) and tree.parents == (ROOT, ROOT, 0)
    tree, _, _, _ = grow_tree(logits_from(PROBS), (2, 1, 1), IDS, 0.31)
    assert tree.tokens == (10,) and tree.parents == (ROOT,)
    tree, _, _, _ = grow_tree(logits_from(PROBS), (2, 1, 1), IDS, 0.05)     # only the 0.045 leaf goes
    assert len(tree) == 5 and tree.parents == (ROOT, ROOT, 0, 1, 2)


def test_the_roots_first_child_always_stays():
    flat = [[0.25] * 4] * 3
    tree, _, _, _ = grow_tree(logits_from(flat), (2, 1, 1), IDS, 0.9)
    assert len(tree) == 1 and tree.parents == (ROOT,) and max(tree.depth) == 1


def test_a_pruned_tree_keeps_greedy_output_and_the_target_distribution():
    """medusa_generate's rule on pruned trees: T=0 output equals target greedy (the same check as the full shape)."""
    from serving.decoding.medusa import medusa_generate
    from tests.serving.test_medusa import heads_for, randomise
    from tests.serving.test_tree import plain_greedy
    from tests.tiny_models import make_model

    target = make_model(seed=3, sharp=3.0)
    heads = randomise(heads_for(target, k=3), scale=0.3, seed=2)
    prompt = [5, 17, 33]
    out, stats = medusa_generate(target, heads, prompt, 24, (2, 1, 1), floor=0.2)
    assert out == plain_greedy(target, prompt, 24)
    full, full_stats = medusa_generate(target, heads, prompt, 24, (2, 1, 1))
    assert full == out and stats.nodes < full_stats.nodes


def test_sampling_through_pruned_trees_is_distributed_as_the_target():
    """The exact-distribution test of the full shape (tests/serving/test_medusa.py) on trees the floor prunes:
    which nodes stay depends on the heads alone, so the lossless rule stays lossless."""
    from serving.decoding.medusa import medusa_generate
    from tests.serving.test_medusa import V, assert_distributed_as_target, heads_for, randomise
    from tests.tiny_models import make_model

    target = make_model(seed=4, vocab_size=V, sharp=1.5)
    heads = randomise(heads_for(target, k=2), scale=0.4, seed=7)
    pruned = []

    def generate(p, g):
        out, stats = medusa_generate(target, heads, p, 2, (2, 1), temperature=1.0, generator=g, floor=0.1)
        pruned.append(stats.nodes < 4 * stats.steps)
        return out, stats

    assert_distributed_as_target(target, generate)
    assert any(pruned)                                   # the floor did prune trees in this test


def test_node_floor_is_a_medusa_knob_in_zero_one():
    assert SpecParams(mode="medusa", extra={"node_floor": 0.05}).extra["node_floor"] == 0.05
    assert 0.0 <= SpecParams(mode="medusa").extra["node_floor"] < 1.0
    for bad in (-0.1, 1.0, "0.1", True, math.nan):
        with pytest.raises(ValueError, match="node_floor must be a number in"):
            SpecParams(mode="medusa", extra={"node_floor": bad})
    with pytest.raises(ValueError, match="unknown parameter"):
        SpecParams(mode="tree", extra={"node_floor": 0.1})


def test_replay_counts_what_the_engine_records():
    from scripts.bench_tree_floor import calibration_table, replay_step

    lg = logits_from(PROBS)
    # the target's greedy columns: depth 1 the second candidate (col 1), depth 2 col 2, depth 3 col 3 (not drafted)
    s = replay_step(lg, [1, 2, 3], (2, 1, 1), IDS, 0.0)
    assert (s["nodes"], s["accepted"], s["chain"]) == (6, 2, 3)
    assert [a for _, a in s["calibration"]] == [False, True, False, True, False, False]
    assert s["calibration"][0][0] == pytest.approx(0.6) and s["calibration"][3][0] == pytest.approx(0.15)
    s = replay_step(lg, [1, 2, 3], (2, 1, 1), IDS, 0.2)            # the accepted node's child was pruned
    assert (s["nodes"], s["accepted"], s["chain"]) == (3, 1, 1)
    s = replay_step(lg, [-1, 2, 3], (2, 1, 1), IDS, 0.0)            # greedy token outside the kept vocabulary
    assert s["accepted"] == 0
    table = calibration_table([(0.7, True), (0.65, False), (0.01, False)])
    assert {r["bin"]: r["accepted"] for r in table if r["nodes"]} == {"[0.60, 0.80)": 0.5, "[0.00, 0.02)": 0.0}


def test_the_engine_prunes_by_the_floor_and_stays_greedy(pair, heads_dir):
    """Served mode medusa (adaptive and fixed depth) with a floor: output equal to target greedy, fewer drafted
    tokens per step than the full shape, and at a floor of 0.99 at most the root's first child per step."""
    from tests.serving.test_engine_rules import GREEDY, ids, make_engine, reference_greedy

    eng = make_engine(pair[0], pair[1], draft_version="v1", heads=heads_dir)
    prompt = ids(eng)
    expected = reference_greedy(eng.target.model, prompt, GREEDY.max_tokens)
    drafted = {}
    for floor in (0.0, 0.3):
        res = eng.generate_all(prompt, GREEDY, SpecParams(mode="medusa", gamma=3, adaptive=False,
                                                          extra={"node_floor": floor, "suffix": 0}))
        assert res.token_ids == expected
        drafted[floor] = res.stats.draft_tokens / res.stats.steps
    assert drafted[0.3] < drafted[0.0] == 3.0
    # the store's branch off: it learned this prompt's answer from the requests above
    res = eng.generate_all(prompt, GREEDY, SpecParams(mode="medusa", gamma=3, extra={"node_floor": 0.99, "suffix": 0}))
    assert res.token_ids == expected
    assert res.stats.draft_tokens <= res.stats.steps          # at most the root's first child per step


# ---------------------------------------------------------------------------- the controller on pruned trees
def _tree_ctrl(costs, priors, category: str = ""):
    from serving.controller import RequestController
    from serving.decoding.tree import tree_branching, tree_size

    return RequestController(gamma=3, costs=costs, priors=priors, version="h", greedy=True, draft_key="medusa",
                             category=category, catches_up=False,
                             verify_tokens=lambda k: 1 + tree_size(tree_branching(k, 2, 1)))


def test_a_pruned_tree_is_priced_by_the_nodes_its_trees_verified():
    """The (2,1,1) shape puts 3, 5, 7 tokens in the pass at depths 1..3; trees that verified one node per depth
    and nothing at depth 3 are priced near 2, 3 and 3 tokens (per depth, shrunk towards the shape), per traffic
    category (a category without trees takes the pooled figures), and never above the shape."""
    from serving.controller import CostModel, Plan, ReplicaPriors

    priors = ReplicaPriors(prior=0.6)
    sql, other = _tree_ctrl(CostModel(), priors, "sql"), _tree_ctrl(CostModel(), priors, "chat")
    assert [sql.tree_nodes(k) for k in (0, 1, 2, 3)] == [1.0, 3.0, 5.0, 7.0]      # nothing seen: the shape
    for _ in range(60):
        sql.observe(Plan("draft", 3), 1, 3, nodes=[1, 1])                        # depth 3 pruned whole
    assert sql.tree_nodes(1) == pytest.approx(2.0, abs=0.1)
    assert sql.tree_nodes(3) == pytest.approx(3.0, abs=0.2)
    assert sql.verified(3) == 3 and sql.verified(0) == 1
    assert other.tree_nodes(3) == pytest.approx(3.0, abs=0.3)                    # pooled, as no chat tree ran
    for _ in range(60):
        other.observe(Plan("draft", 2), 0, 2, nodes=[2, 2])                      # the full shape at depth 2
    assert other.tree_nodes(2) == pytest.approx(5.0, abs=0.15) and other.tree_nodes(3) <= 7.0
    assert sql.tree_nodes(3) < other.tree_nodes(3)
    big = ReplicaPriors()
    c = _tree_ctrl(CostModel(), big)
    c.observe(Plan("draft", 1), 1, 1, nodes=[9])                                 # more than the shape: capped
    assert c.tree_nodes(1) == 3.0


def test_a_depth_the_floor_cut_counts_as_not_accepted():
    """Pricing depth k by what trees planned k deep verified, the acceptance curve must be what such a plan gets:
    a depth 3 the floor pruned whole is a depth 3 that was not accepted, even where depths 1 and 2 were."""
    from serving.controller import CostModel, Plan, ReplicaPriors

    c = _tree_ctrl(CostModel(), ReplicaPriors(prior=0.5))
    for _ in range(80):
        c.observe(Plan("draft", 3), 2, 3, nodes=[1, 1])
    curve = c.curve("draft")
    assert curve[0] > 0.8 and curve[1] > 0.8 and curve[2] < 0.2          # 0.86, 0.86, 0.14 (decayed counts)


def test_the_controller_drafts_deeper_once_it_sees_the_floor_prune_the_tree():
    """Where verification turns dear past 3 tokens, the full (2,1,1) shape prices a two-deep tree at 5 tokens and
    the controller keeps to one level; once the replica's trees are seen verifying one node per depth (3 tokens
    two deep), the same acceptance plans two deep."""
    from serving.controller import CostModel, Plan, ReplicaPriors

    costs = CostModel(weight=1.0)
    for n in range(1, 8):
        costs.observe_target(n, 0.05 * (1 + 0.6 * max(0, n - 3)))
    costs.observe_draft("medusa", 1, 0.0005)
    priors = ReplicaPriors(prior=0.6)
    teach = _tree_ctrl(costs, priors)
    for _ in range(40):                               # depth 1 accepted 0.75, depth 2 given depth 1: 0.67
        for accepted in (2, 2, 1, 0):
            teach.observe(Plan("draft", 2), accepted, 2)

    def planned() -> tuple[int, float]:
        c = _tree_ctrl(costs, priors)
        c._estimate("draft")
        c.evidence["draft"] = 100                     # the replica's traffic stands behind the prior: no caution
        return c.plan().k, c.tree_nodes(2)

    assert planned() == (1, 5.0)                      # no node counts yet: the full shape
    for _ in range(40):                               # the same acceptance, from trees of one node per depth
        for accepted in (2, 2, 1, 0):
            teach.observe(Plan("draft", 2), accepted, 2, nodes=[1, 1])
    k, nodes = planned()
    assert nodes == pytest.approx(3.0, abs=0.1) and k >= 2
