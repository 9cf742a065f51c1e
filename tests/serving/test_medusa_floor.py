"""Mode medusa's `node_floor` (serving/decoding/medusa.py `grow_tree`): the heads' doubt prunes their tree by path
probability, the root's first child always stays, the full shape at 0; a pruned tree is still verified losslessly;
the controller learns from the depth the tree reached; the knob's validation; the replay script's core."""
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
                                                          extra={"node_floor": floor}))
        assert res.token_ids == expected
        drafted[floor] = res.stats.draft_tokens / res.stats.steps
    assert drafted[0.3] < drafted[0.0] == 3.0
    res = eng.generate_all(prompt, GREEDY, SpecParams(mode="medusa", gamma=3, extra={"node_floor": 0.99}))
    assert res.token_ids == expected
    assert res.stats.draft_tokens <= res.stats.steps          # at most the root's first child per step
