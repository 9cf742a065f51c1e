"""Rule "mjsd" on the tree (serving/decoding/tree.py `verify_mjsd`): MJSD's joint test on every root-to-node
path. On a chain it is exactly the chain rule `mjsd_verify`; on hand-built trees the deepest passing node wins
(no break), ties by joint target probability then node index, tau extremes, a draft probability of 0; with the
proposer equal to the target every node passes; served by modes tree and medusa (engine, HTTP), and a bad tau
is refused with a clear error."""
from __future__ import annotations

import math

import httpx
import pytest
import torch

from serving.config import SamplingParams, SpecParams
from serving.decoding.medusa import HeadsConfig, MedusaHeads
from serving.decoding.mjsd import mjsd_verify
from serving.decoding.tree import (ROOT, DraftTree, TreeDrafter, feed_masked, tree_forward, tree_node_logq,
                                   verify_mjsd)
from serving.decoding.warp import sample, warp_logprobs, warp_probs
from serving.protocol import APIError, CompletionRequest, spec_params
from tests import tiny_models
from tests.api_helpers import LiveServer, tiny_service
from tests.serving.test_engine_rules import GREEDY, ids, make_engine, one_thread, reference_greedy  # noqa: F401

WARM = SamplingParams(temperature=0.8, max_tokens=24, seed=11)
NEG = float("-inf")


def _rows(*dists, vocab=8) -> torch.Tensor:
    """Probability rows from {token: mass} dicts; the rest of each row's mass spread over the other tokens."""
    out = torch.zeros(len(dists), vocab, dtype=torch.float64)
    for r, d in enumerate(dists):
        rest = [t for t in range(vocab) if t not in d]
        for t, m in d.items():
            out[r, t] = m
        left = 1.0 - sum(d.values())
        for t in rest:
            out[r, t] = left / len(rest)
    return out.float()


# ---------------------------------------------------------------------- (a) a chain is the chain rule
@pytest.mark.parametrize("tau", [-0.5, 0.0, 0.02, 0.1, 0.3, 0.6, 0.95, 1.0, 3.0])
def test_on_a_chain_it_equals_mjsd_verify(tau):
    g = torch.Generator().manual_seed(int(1000 * (tau + 1)))
    gen_tree, gen_chain = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    accepted = set()
    for trial in range(120):
        gamma, vocab = 1 + trial % 5, 6
        target = warp_probs(3 * torch.randn(gamma + 1, vocab, generator=g), 1.0, 0, 1.0)
        # every third trial: a top-3 draft, so a token outside its support (q = 0) occurs
        draft = warp_probs(3 * torch.randn(gamma, vocab, generator=g), 1.0, 3 if trial % 3 == 0 else 0, 1.0)
        toks = torch.randint(0, vocab, (gamma,), generator=g)
        chain = DraftTree(tuple(toks.tolist()), (ROOT,) + tuple(range(gamma - 1)))
        logq = draft.double()[torch.arange(gamma), toks].log()
        a = verify_mjsd(chain, target, logq, tau, gen_tree)
        b = mjsd_verify(toks, draft, target, gen_chain, tau=tau)
        assert (a.num_accepted, a.next_token) == (b.num_accepted, b.next_token), trial
        assert a.path == list(range(a.num_accepted)) and a.tokens == toks[: a.num_accepted].tolist()
        accepted.add(a.num_accepted)
    # the same generator stream on both sides all along: one draw per call, as mjsd_verify
    assert torch.equal(gen_tree.get_state(), gen_chain.get_state())
    if tau <= 0:
        assert accepted == {1, 2, 3, 4, 5}
    elif tau >= 1:
        assert accepted == {0}
    else:
        assert len(accepted) > 1                                      # the test is not vacuous


# ---------------------------------------------------------------------- (b) hand-built trees
def test_deepest_passing_node_wins_even_when_a_shallower_one_fails():
    # nodes: 0 = 1 (root child), 1 = 2 under 0, 2 = 3 under 1, 3 = 4 (root child)
    tree = DraftTree((1, 2, 3, 4), (ROOT, 0, 1, ROOT))
    target = _rows({1: 0.2, 4: 0.5}, {2: 0.9}, {3: 0.05}, {7: 1.0}, {5: 1.0})
    logq = torch.tensor([0.8, 0.1, 0.5, 0.5]).log()
    # tau 0.5: node 0 alone 0.25 (fails), 0-1 jointly 0.18 / 0.08 = 2.25 (passes), 0-1-2 0.009 / 0.04 (fails),
    # node 3 1.0 (passes, but shallower)
    res = verify_mjsd(tree, target, logq, 0.5, torch.Generator().manual_seed(0))
    assert res.path == [0, 1] and res.tokens == [1, 2]
    assert res.next_token == int(sample(target[2], torch.Generator().manual_seed(0)))   # the row after node 1
    # tau 0.2: the depth-3 node passes too (0.225 > 0.2): deepest
    res = verify_mjsd(tree, target, logq, 0.2, torch.Generator().manual_seed(0))
    assert res.path == [0, 1, 2] and res.tokens == [1, 2, 3]


def test_ties_go_to_the_larger_joint_target_probability_then_the_lower_index():
    # nodes: 0 = 1, 1 = 2 under 0, 2 = 3 under 0, 3 = 4, 4 = 5 under 3: three depth-2 nodes
    tree = DraftTree.from_paths([[1, 2], [1, 3], [4, 5]])
    assert tree.parents == (ROOT, 0, 0, ROOT, 3)
    target = _rows({1: 0.4, 4: 0.4}, {2: 0.3, 3: 0.5}, {6: 1.0}, {7: 1.0}, {5: 0.3}, {0: 1.0})
    p = target.double()
    logq = torch.stack([p[0, 1], p[1, 2], p[1, 3], p[0, 4], p[4, 5]]).log()     # q = p: every ratio is 1
    res = verify_mjsd(tree, target, logq, 0.5)
    assert res.path == [0, 2] and res.next_token == 7                 # 0.4 * 0.5 beats 0.4 * 0.3 (twice)
    target2 = _rows({1: 0.4, 4: 0.4}, {2: 0.5, 3: 0.5}, {6: 1.0}, {7: 1.0}, {5: 0.5}, {0: 1.0})
    p2 = target2.double()
    logq2 = torch.stack([p2[0, 1], p2[1, 2], p2[1, 3], p2[0, 4], p2[4, 5]]).log()
    res = verify_mjsd(tree, target2, logq2, 0.5)
    assert res.path == [0, 1] and res.next_token == 6                 # equal joint p: the lowest node index
    # tau <= 0: the deepest node with the same tie-break, whatever the ratios (q far above p here)
    res = verify_mjsd(tree, target, torch.zeros(5), 0.0)
    assert res.path == [0, 2]
    res = verify_mjsd(tree, target, [NEG] * 5, -1.0)                  # even with q = 0 everywhere
    assert res.path == [0, 2]


def test_tau_at_least_one_accepts_nothing_and_samples_the_root_row():
    tree = DraftTree.from_paths([[1, 2], [3]])
    target = _rows({1: 0.5, 3: 0.5}, {2: 1.0}, {0: 1.0}, {0: 1.0})
    logq = torch.tensor([-5.0, -5.0, -5.0])                           # ratios far above 1
    for tau, seed in ((1.0, 0), (1.5, 1), (1.0, 2), (1.0, 5)):
        res = verify_mjsd(tree, target, logq, tau, torch.Generator().manual_seed(seed))
        assert res.path == [] and res.tokens == []
        assert res.next_token == int(sample(target[0], torch.Generator().manual_seed(seed))) in (1, 3)
    assert verify_mjsd(tree, target, logq, 0.99).path == [0, 1]


def test_a_draft_probability_of_zero_fails_the_node_and_its_subtree():
    tree = DraftTree((1, 2, 3), (ROOT, 0, ROOT))                       # 1 -> 2, and 3
    target = _rows({1: 0.9, 3: 0.05}, {2: 0.9}, {4: 1.0}, {6: 1.0})
    res = verify_mjsd(tree, target, [NEG, math.log(0.5), math.log(0.05)], 0.1)
    assert res.path == [2] and res.next_token == 6                    # 1 (q = 0) and 2 below it fail
    res = verify_mjsd(tree, target, [math.log(0.5), math.log(0.5), math.log(0.05)], 0.1)
    assert res.path == [0, 1] and res.next_token == 4
    # a target probability of 0 fails too (ratio 0) but for tau <= 0
    zero = _rows({3: 1.0}, {2: 1.0}, {4: 1.0}, {6: 1.0})
    assert verify_mjsd(tree, zero, [0.0, 0.0, 0.0], 0.01).path == [2]
    assert verify_mjsd(tree, zero, [0.0, 0.0, 0.0], 0.0).path == [0, 1]


def test_an_empty_tree_samples_the_root_row():
    res = verify_mjsd(DraftTree((), ()), _rows({3: 1.0}), torch.zeros(0), 0.1)
    assert res.path == [] and res.next_token == 3


@pytest.mark.parametrize("kw,match", [
    ({"node_logq": [0.0, 0.0]}, "one log-probability per node"),
    ({"node_logq": torch.zeros(3, 1)}, "one log-probability per node"),
    ({"node_logq": [0.0, float("nan"), 0.0]}, "NaN"),
    ({"node_logq": [0.0, float("inf"), 0.0]}, "NaN or \\+inf"),
    ({"node_logq": ["a", "b", "c"]}, "sequence of 3 log-probabilities"),
    ({"tau": float("nan")}, "tau must be a finite number"),
    ({"tau": float("inf")}, "tau must be a finite number"),
    ({"tau": "0.3"}, "tau must be a finite number"),
    ({"tau": True}, "tau must be a finite number"),
    ({"target_probs": torch.full((3, 8), 0.125)}, "N \\+ 1"),
    ({"target_probs": torch.full((4, 2), 0.5)}, "outside the vocabulary"),
])
def test_bad_inputs_are_refused(kw, match):
    tree = DraftTree.from_paths([[1, 2], [3]])
    args = {"target_probs": torch.full((4, 8), 0.125), "node_logq": [0.0, 0.0, 0.0], "tau": 0.1, **kw}
    with pytest.raises(ValueError, match=match):
        verify_mjsd(tree, args["target_probs"], args["node_logq"], args["tau"])


def test_tree_node_logq_reads_each_node_at_its_parents_row():
    tree = DraftTree.from_paths([[1, 2], [3, 4, 5]])                  # nodes 1, 2, 3, 4, 5
    rows = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)     # rows: root, then nodes 0..4
    got = tree_node_logq(tree, rows)
    assert got.tolist() == [rows[r, c].item() for r, c in ((0, 1), (1, 2), (0, 3), (3, 4), (4, 5))]
    assert tree_node_logq(tree, rows[:5]).shape == (5,)               # a leaf's row is not needed
    with pytest.raises(ValueError, match="parents need 5"):
        tree_node_logq(tree, rows[:4])


# ---------------------------------------------------------------------- (c) proposer == target: all pass
WARPS = [(0.8, 0, 1.0), (0.8, 5, 1.0), (1.3, 0, 0.9)]


@pytest.mark.parametrize("temperature,top_k,top_p", WARPS)
def test_a_draft_tree_of_the_target_itself_passes_every_node(temperature, top_k, top_p):
    target = tiny_models.make_model(seed=2, sharp=3.0)
    warp = lambda lg: warp_logprobs(lg, temperature, top_k, top_p)   # noqa: E731
    prompt = [5, 6, 7, 8]
    drafter = TreeDrafter(target, (3, 2, 1))
    tree, rows = drafter.propose(prompt)
    logq = tree_node_logq(tree, warp(rows))
    prefix = len(prompt) - 1
    n = prefix
    _, cache = feed_masked(target, prompt[:-1], torch.ones(n, n, dtype=torch.bool).tril(), torch.arange(n), None)
    logits, _ = tree_forward(target, tree, prompt[-1], cache, prefix)
    probs = warp(logits).exp()
    logp = probs.double()[[p + 1 for p in tree.parents], list(tree.tokens)].log()
    # ratio 1 at every node (a child outside the warped support has p = q = 0 there: -inf on both sides)
    torch.testing.assert_close(logp.float(), logq, atol=1e-4, rtol=0)
    assert torch.isfinite(logq).sum() >= 3                            # the first-child chain is always inside
    alive = [i for i in range(len(tree)) if all(math.isfinite(logq[j]) for j in tree.path_to(i))]
    deepest = max(alive, key=lambda i: (tree.depth[i], float(logp[tree.path_to(i)].sum()), -i))
    for tau in (0.05, 0.5, 0.99):
        res = verify_mjsd(tree, probs, logq, tau, torch.Generator().manual_seed(1))
        assert res.path == tree.path_to(deepest) and len(res.path) == 3


@pytest.mark.parametrize("temperature,top_k,top_p", WARPS)
def test_medusa_heads_warp_their_rows_as_the_target_rows_are_warped(temperature, top_k, top_p):
    """A target whose rows are the heads' own distributions (over the full vocabulary, tokens outside the
    kept vocabulary impossible), warped the same way: every ratio is 1, every node passes."""
    target = tiny_models.make_model(seed=1, sharp=4.0)
    keep = sorted(set(range(0, 259, 3)) | {258})
    heads = MedusaHeads.for_target(target, HeadsConfig(target.config.hidden_size, 3, 1, True), keep)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for prm in heads.parameters():
            prm.copy_(0.3 * torch.randn(prm.shape, generator=gen))
    warp = lambda lg: warp_logprobs(lg, temperature, top_k, top_p)   # noqa: E731
    h = torch.randn(target.config.hidden_size, generator=gen)
    tree, logq = heads.propose_with_logq(h, 9, (2, 2, 1), warp)
    assert tree == heads.propose(h, 9, (2, 2, 1)) and logq.shape == (len(tree),)
    assert set(tree.tokens) <= set(keep)
    with torch.no_grad():
        head_logits = heads(h[None], torch.tensor([9]))[:, 0].float()     # [3, V_keep]
    full = torch.full((3, 259), NEG)
    full[:, keep] = head_logits
    # the target's row after each node = the head of the next depth (row 0: head 1)
    rows = torch.stack([full[0]] + [full[min(d, 2)] for d in tree.depth])
    probs = warp(rows).exp()
    logp = probs.double()[[p + 1 for p in tree.parents], list(tree.tokens)].log()
    torch.testing.assert_close(logp.float(), logq, atol=1e-5, rtol=0)
    res = verify_mjsd(tree, probs, logq, 0.999, torch.Generator().manual_seed(0))
    assert len(res.path) == 3
    # without the warp the heads' plain log-softmax differs from the warped target rows
    _, plain = heads.propose_with_logq(h, 9, (2, 2, 1))
    assert not torch.allclose(plain, logq, atol=1e-3)


# ---------------------------------------------------------------------- (d) served: engine and HTTP
@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_models.save_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def tree_engine(pair):
    return make_engine(pair[0], pair[1], draft_version="v1")


@pytest.fixture(scope="module")
def self_engine(pair):
    return make_engine(pair[0], pair[0], draft_version="same")


@pytest.fixture(scope="module")
def medusa_engine(pair, tmp_path_factory):
    target = tiny_models.make_model(0, layers=2, sharp=8.0)            # the saved target's weights
    torch.manual_seed(3)
    heads = MedusaHeads.for_target(target, HeadsConfig(target.config.hidden_size, 3, 1, True), list(range(259)))
    with torch.no_grad():
        for prm in heads.parameters():
            prm.normal_(0, 0.2)
    path = heads.save(tmp_path_factory.mktemp("heads") / "tiny-heads")
    return make_engine(pair[0], pair[1], draft_version="v1", heads=path)


def mjsd(mode, tau=0.3, gamma=3, **extra):
    """The rule at a fixed depth (adaptive medusa would choose the depth per step)."""
    return SpecParams(mode=mode, gamma=gamma, extra={"rule": "mjsd", "tau": tau, **extra}, adaptive=False)


@pytest.mark.parametrize("mode", ["tree", "medusa"])
def test_modes_tree_and_medusa_serve_rule_mjsd(request, mode):
    eng = request.getfixturevalue("tree_engine" if mode == "tree" else "medusa_engine")
    prompt = ids(eng)
    a = eng.generate_all(prompt, WARM, mjsd(mode))
    b = eng.generate_all(prompt, WARM, mjsd(mode))
    assert 0 < len(a.token_ids) <= WARM.max_tokens and all(0 <= t < eng.vocab_size for t in a.token_ids)
    assert a.token_ids == b.token_ids                                 # seeded: reproducible
    assert a.stats.mode == mode and a.stats.steps <= len(a.token_ids)
    assert a.stats.draft_tokens > 0 and a.stats.accepted_tokens <= 3 * a.stats.steps
    # the threshold really decides: tau >= 1 accepts nothing, tau <= 0 the full depth every step
    none = eng.generate_all(prompt, WARM, mjsd(mode, tau=1.0))
    assert none.stats.accepted_tokens == 0 and none.stats.steps == len(none.token_ids)
    full = {"node_floor": 0.0} if mode == "medusa" else {}          # the full shape: no node left out
    every = eng.generate_all(prompt, WARM, mjsd(mode, tau=0.0, **full))
    assert every.stats.accepted_tokens == 3 * every.stats.steps
    assert every.stats.steps < len(every.token_ids) or every.token_ids[-1] == tiny_models.EOS_ID
    # T = 0 stays greedy (verify_greedy), whatever tau
    assert eng.generate_all(prompt, GREEDY, mjsd(mode, tau=1.0)).token_ids == \
        reference_greedy(eng.target.model, prompt, GREEDY.max_tokens)


def test_a_draft_equal_to_the_target_passes_every_node_in_the_engine(self_engine):
    prompt = ids(self_engine)
    for tau in (0.3, 0.9):
        res = self_engine.generate_all(prompt, WARM, mjsd("tree", tau=tau, width=3, branch=2))
        assert res.stats.steps > 1 and res.stats.accepted_tokens == 3 * res.stats.steps


def test_knob_tau_default_and_validation():
    for mode in ("tree", "medusa", "eagle"):
        assert SpecParams(mode=mode).extra["tau"] == SpecParams().tau == 0.1    # mode mjsd's default tau
        assert SpecParams(mode=mode, extra={"rule": "mjsd", "tau": 2}).extra["tau"] == 2.0
        for bad in ("0.3", float("nan"), float("inf"), None, True):
            with pytest.raises(ValueError, match="tau must be a finite number"):
                SpecParams(mode=mode, extra={"rule": "mjsd", "tau": bad})
    with pytest.raises(ValueError, match="rule must be one of exact, typical, mjsd"):
        SpecParams(mode="tree", extra={"rule": "joint"})
    with pytest.raises(ValueError, match="unknown parameter"):
        SpecParams(mode="speculative", extra={"tau": 0.3})           # a tree knob only
    req = CompletionRequest(prompt="x", speculative={"mode": "medusa", "params": {"rule": "mjsd", "tau": "high"}})
    with pytest.raises(APIError) as err:
        spec_params(req, draft_loaded=True)
    assert err.value.status == 400 and err.value.param == "speculative"
    assert "tau must be a finite number, got 'high'" in err.value.message


def test_http_tree_rule_mjsd_and_a_clear_400_for_a_bad_tau(pair):
    srv = LiveServer(tiny_service(*pair, buffer=False)).start()
    body = {"prompt": "the cat sat", "max_tokens": 8, "temperature": 0.8, "seed": 3,
            "speculative": {"mode": "tree", "params": {"rule": "mjsd", "tau": 0.3}}}
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 8
            bad = {**body, "speculative": {"mode": "tree", "params": {"rule": "mjsd", "tau": "abc"}}}
            r = c.post("/v1/completions", json=bad)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["param"] == "speculative"
            assert "tau must be a finite number" in err["message"]
    finally:
        srv.stop()
