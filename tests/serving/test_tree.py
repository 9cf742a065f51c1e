"""Tree verification (serving/decoding/tree.py): structure, tree attention against per-path chains, the KV
cache after acceptance, greedy equality with the target, and the exact output distribution of both
lossless rules on a tiny vocabulary."""
from __future__ import annotations

import itertools

import pytest
import torch

from serving.decoding.tree import (
    ROOT,
    DraftTree,
    TreeDrafter,
    feed_masked,
    inner_rows,
    keep_path,
    tree_forward,
    tree_generate,
    verdict_on_demand,
    verify_deterministic,
    verify_greedy,
    verify_mjsd,
    verify_sampled,
    verify_typical,
)
from tests.tiny_models import make_model


def causal(model, ids, cache=None, start=0):
    n = len(ids)
    mask = torch.ones(n, start + n, dtype=torch.bool).tril(start)
    return feed_masked(model, ids, mask, torch.arange(start, start + n), cache)


def plain_greedy(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


# ---------------------------------------------------------------------- structure
def test_from_paths_merges_prefixes_in_topological_order():
    tree = DraftTree.from_paths([[5, 6, 7], [5, 8], [9], [5, 6, 3]])
    assert tree.tokens == (5, 6, 7, 8, 9, 3)
    assert tree.parents == (ROOT, 0, 1, 0, ROOT, 1)
    assert tree.depth == (1, 2, 3, 2, 1, 3)
    assert tree.children(ROOT) == [0, 4] and tree.children(1) == [2, 5]
    assert tree.path_to(5) == [0, 1, 5]
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0],
        [0, 0, 0, 0, 1, 0],
        [1, 1, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(tree.ancestor_mask(), expected)
    mask, pos = tree.attention_inputs(prefix_len=3)
    assert pos.tolist() == [3, 4, 5, 6, 5, 4, 6]
    assert mask.shape == (7, 10) and mask[:, :4].all() and not mask[0, 4:].any()
    assert torch.equal(mask[1:, 4:], expected)


@pytest.mark.parametrize("tokens,parents,msg", [
    ((1, 2), (ROOT,), "parents"),
    ((1, 2), (ROOT, 1), "earlier node"),
    ((1, -2), (ROOT, 0), "non-negative"),
])
def test_invalid_trees_are_refused(tokens, parents, msg):
    with pytest.raises(ValueError, match=msg):
        DraftTree(tokens, parents)


def test_rules_refuse_rows_that_do_not_match_the_tree():
    tree = DraftTree.from_paths([[1, 2]])
    with pytest.raises(ValueError, match="N \\+ 1"):
        verify_greedy(tree, torch.zeros(2, 5))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        verify_greedy(DraftTree.from_paths([[7]]), torch.zeros(2, 5))


# ---------------------------------------------------------------------- tree attention
def test_tree_logits_equal_each_path_run_as_a_chain():
    model = make_model(seed=3, sharp=4.0)
    prompt = [10, 20, 30, 40, 50]
    paths = [[60, 61, 62], [60, 63], [64, 65, 66, 67], [60, 61, 68]]
    tree = DraftTree.from_paths(paths)
    _, cache = causal(model, prompt[:-1])
    logits, _ = tree_forward(model, tree, prompt[-1], cache, len(prompt) - 1)
    assert logits.shape[0] == len(tree) + 1
    for path in paths:
        chain, _ = causal(model, prompt + path)
        ref = chain[len(prompt) - 1:]                               # root, then each path token
        nodes = tree.path_to(_node_of(tree, path))
        got = logits[[0] + [1 + i for i in nodes]]
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    # a wrong mask (plain causal over the flattened tree) gives different logits: the check has power
    flat, _ = causal(model, prompt + list(tree.tokens))
    assert not torch.allclose(flat[len(prompt) - 1:], logits, atol=1e-3)


def _node_of(tree: DraftTree, path: list[int]) -> int:
    node = ROOT
    for t in path:
        node = next(c for c in tree.children(node) if tree.tokens[c] == t)
    return node


@pytest.mark.parametrize("kind", ["growable", "dynamic"])
@pytest.mark.parametrize("accept", [[], [0], [0, 1, 2], [4, 5]])
def test_cache_after_keep_path_equals_a_fresh_forward(accept, kind):
    """Both cache kinds: the growable layers feed_masked creates (only the path's slots move, in place) and
    a plain transformers DynamicCache (every layer re-indexed)."""
    from transformers import DynamicCache

    from serving.kvcache import GrowableLayer

    model = make_model(seed=5, sharp=4.0)
    prompt = [11, 12, 13, 14]
    tree = DraftTree.from_paths([[60, 61, 62], [60, 63], [64, 65]])
    _, cache = causal(model, prompt[:-1], DynamicCache() if kind == "dynamic" else None)
    assert isinstance(cache.layers[0], GrowableLayer) == (kind == "growable")
    tree_forward(model, tree, prompt[-1], cache, len(prompt) - 1)
    keep_path(cache, len(prompt) - 1, accept)
    seq = prompt + [tree.tokens[i] for i in accept]
    assert cache.get_seq_length() == len(seq)
    _, fresh = causal(model, seq)
    for a, b in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)
    nxt, _ = causal(model, [99], cache, start=len(seq))
    ref, _ = causal(model, seq + [99])
    torch.testing.assert_close(nxt[-1], ref[-1], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------- greedy decoding
@pytest.mark.parametrize("branching", [(1, 1, 1), (2, 2, 1), (3, 2), (4,)])
def test_tree_generate_at_t0_equals_target_greedy(branching):
    target = make_model(seed=0, sharp=3.0)
    draft = make_model(seed=0, layers=1, sharp=3.0)        # shares the first layer's init: agrees sometimes
    for prompt in ([1, 2, 3], [100, 101, 102, 103, 104, 105], [7]):
        out, stats = tree_generate(target, draft, prompt, 24, branching)
        assert out == plain_greedy(target, prompt, 24)
        assert stats.steps <= 24 and stats.nodes > 0


def test_tree_generate_accepts_whole_paths_when_the_draft_is_the_target():
    target = make_model(seed=2, sharp=3.0)
    out, stats = tree_generate(target, target, [5, 6, 7], 30, (2, 2, 1))
    assert out == plain_greedy(target, [5, 6, 7], 30)
    assert stats.tokens_per_step > 3.5                     # depth 3 accepted + 1 target token nearly always


def test_drafter_refuses_bad_branching():
    with pytest.raises(ValueError, match="branching"):
        TreeDrafter(make_model(), [2, 0])


# ---------------------------------------------------------------------- typical acceptance (lossy)
def test_typical_rule_takes_the_deepest_typical_path_then_the_target_argmax():
    from serving.decoding.typical import typical_thresholds

    tree = DraftTree.from_paths([[1, 2, 3], [1, 4], [0, 2]])  # nodes: 1, 2, 3, 4, 0, 2'
    rows = torch.full((len(tree) + 1, 5), 0.01)
    rows[0, 1], rows[0, 0] = 0.6, 0.36                       # root: both children typical, 1 first
    rows[1, 2], rows[1, 4] = 0.5, 0.46                        # under 1: 2 and 4 typical
    rows[2, 3] = 0.96                                         # under 1-2: 3 typical -> depth 3 wins
    rows[3, 4] = 0.96                                         # after 1-2-3: the target's argmax is 4
    rows = rows / rows.sum(-1, keepdim=True)
    res = verify_typical(tree, rows)
    assert res.tokens == [1, 2, 3] and res.next_token == 4
    rows2 = rows.clone()
    rows2[2, 3], rows2[2, 0] = 0.01, 0.96                     # 3 no longer typical: depth 2, first in order
    rows2 = rows2 / rows2.sum(-1, keepdim=True)
    assert rows2[2, 3] < typical_thresholds(rows2, 0.09, 0.3)[2]
    res2 = verify_typical(tree, rows2)
    assert res2.tokens == [1, 2] and res2.next_token == 0
    none = verify_typical(tree, rows, posterior_threshold=1.0, posterior_alpha=1e9)   # nothing passes
    assert none.path == [] and none.next_token == 1


def test_typical_rule_on_a_chain_equals_the_chain_rule():
    from serving.decoding.typical import typical_verify

    g = torch.Generator().manual_seed(3)
    for _ in range(50):
        toks = torch.randint(0, 6, (4,), generator=g).tolist()
        rows = torch.softmax(2 * torch.randn(5, 6, generator=g), -1)
        chain = DraftTree(tuple(toks), (ROOT, 0, 1, 2))
        a = verify_typical(chain, rows)
        b = typical_verify(torch.tensor(toks), torch.zeros(4, 6), rows)
        assert (a.num_accepted, a.next_token) == (b.num_accepted, b.next_token)


# ---------------------------------------------------------------------- exact distribution
V = 5


def _dist(seed, sharp=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharp * torch.randn(V, generator=g), dim=-1)


def _exact_two_token(target_rows, tree: DraftTree) -> dict:
    """Target's exact distribution of the first two emitted tokens. target_rows: node (ROOT for the root) ->
    the target distribution after that node; a token sequence outside the tree uses `fallback`."""
    out = {}
    for a, b in itertools.product(range(V), repeat=2):
        node = next((c for c in tree.children(ROOT) if tree.tokens[c] == a), None)
        second = target_rows[node] if node is not None else target_rows["off"][a]
        out[(a, b)] = float(target_rows[ROOT][a] * second[b])
    return out


def _empirical(tree, rows, draw_fn, n, seed):
    """Frequencies of the first two emitted tokens; when a step emits one token only, the second is drawn
    from the target's next distribution (the tree node's row if that token is a root child, else the
    off-tree row), as the next decoding step would."""
    g = torch.Generator().manual_seed(seed)
    counts: dict = {}
    for _ in range(n):
        res = draw_fn(g)
        seq = res.tokens + [res.next_token]
        if len(seq) == 1:
            a = seq[0]
            node = next((c for c in tree.children(ROOT) if tree.tokens[c] == a), None)
            row = rows[node] if node is not None else rows["off"][a]
            seq.append(int(torch.multinomial(row, 1, generator=g)))
        key = tuple(seq[:2])
        counts[key] = counts.get(key, 0) + 1
    return {k: v / n for k, v in counts.items()}


def _tv(p: dict, q: dict) -> float:
    keys = set(p) | set(q)
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in keys)


def _setup():
    # root children: tokens 1 and 3; node 0 (token 1) has children 2 and 0; node 1 (token 3) has child 4
    tree = DraftTree((1, 3, 2, 0, 4), (ROOT, ROOT, 0, 0, 1))
    rows = {ROOT: _dist(1), 0: _dist(2), 1: _dist(3), 2: _dist(4), 3: _dist(5), 4: _dist(6),
            "off": {a: _dist(10 + a) for a in range(V)}}
    target = torch.stack([rows[ROOT]] + [rows[i] for i in range(len(tree))])
    return tree, rows, target


N_SAMPLES = 40_000
TV_BOUND = 0.02      # 25 outcomes, 40k samples: expected TV ~ 0.5 * sum sqrt(p/n) * sqrt(2/pi) ~ 0.01


def test_deterministic_rule_emits_the_target_distribution():
    tree, rows, target = _setup()
    exact = _exact_two_token(rows, tree)
    emp = _empirical(tree, rows, lambda g: verify_deterministic(tree, target, g), N_SAMPLES, seed=0)
    assert _tv(emp, exact) < TV_BOUND
    # power: against a perturbed target the same samples are far off
    wrong = {**rows, ROOT: torch.softmax(torch.log(rows[ROOT]) + torch.tensor([0.5, 0, 0, 0, 0]), -1)}
    assert _tv(emp, _exact_two_token(wrong, tree)) > 2 * TV_BOUND


def test_sampled_rule_emits_the_target_distribution_with_repeated_draws():
    tree, rows, target = _setup()
    q_rows = torch.stack([_dist(20 + i, sharp=2.0) for i in range(len(tree) + 1)])
    exact = _exact_two_token(rows, tree)

    def draw(g):
        # children drawn i.i.d. from q at the parent: 3 draws at the root, 2 below; a draw of a token that is
        # not a child of the fixed tree cannot be verified, so the q rows are conditioned on the tree's
        # children and the draws use them (q must be what the draws came from)
        draws, qs = {}, q_rows.clone()
        for node, k in ((ROOT, 3), (0, 2), (1, 2)):
            kids = tree.children(node)
            q = torch.zeros(V)
            q[[tree.tokens[c] for c in kids]] = q_rows[node + 1][[tree.tokens[c] for c in kids]]
            q = q / q.sum()
            qs[node + 1] = q
            picks = torch.multinomial(q, k, replacement=True, generator=g).tolist()
            draws[node] = [next(c for c in kids if tree.tokens[c] == t) for t in picks]
        return verify_sampled(tree, target, qs, draws, g)

    emp = _empirical(tree, rows, draw, N_SAMPLES, seed=1)
    assert _tv(emp, exact) < TV_BOUND
    wrong = {**rows, 0: torch.softmax(torch.log(rows[0]) + torch.tensor([0, 0, 1.5, 0, 0]), -1)}
    assert _tv(emp, _exact_two_token(wrong, tree)) > 2 * TV_BOUND


# ---------------------------------------------------------------------- the output layer on the rows a rule reads
ON_DEMAND_TREES = [
    DraftTree.from_paths([[1, 2, 3], [1, 4, 5], [6, 7, 8], [6, 9], [10]]),     # leaves at depths 1, 2 and 3
    DraftTree.from_paths([[1, 2, 3, 4]]),                                      # a chain: one leaf
    DraftTree.from_paths([[i] for i in range(1, 9)]),                          # depth 1: every node a leaf
]


def _on_demand_rules(tree, temperature):
    logq = torch.log_softmax(torch.randn(len(tree), generator=torch.Generator().manual_seed(5)), -1)
    probs = lambda rows: torch.softmax(rows / temperature, -1)                # noqa: E731
    return {
        "greedy": lambda rows, g: verify_greedy(tree, rows),
        "deterministic": lambda rows, g: verify_deterministic(tree, probs(rows), g),
        "typical": lambda rows, g: verify_typical(tree, probs(rows), 0.05, 0.2),
        "mjsd": lambda rows, g: verify_mjsd(tree, probs(rows), logq, 0.05, g),
    }


@pytest.mark.parametrize("shape", range(len(ON_DEMAND_TREES)))
@pytest.mark.parametrize("rule", ["greedy", "deterministic", "typical", "mjsd"])
def test_verdict_on_demand_equals_the_rule_on_every_row(shape, rule):
    """The output layer run on the inner rows, then on the record chain's leaf (with the rule run again where
    the path ends there), gives what the rule gives on every row, draw for draw: the same path and token from
    the same generator seed, the same rows where the step's record reads them, and fewer rows computed."""
    tree = ON_DEMAND_TREES[shape]
    head = torch.nn.Linear(16, 12, bias=False)
    torch.nn.init.normal_(head.weight, std=0.5)
    verdict = _on_demand_rules(tree, temperature=0.7)[rule]
    ends_at_leaf = 0
    for seed in range(60):
        hidden = torch.randn(len(tree) + 1, 16, generator=torch.Generator().manual_seed(seed))
        # a target that often agrees with the tree: node i's token gets a bonus at its parent's row
        full = head(hidden).detach()
        for t, par in zip(tree.tokens, tree.parents):
            full[par + 1, t] += 8.0 if seed % 3 else 0.0
        computed = []

        def logits_of(h, full=full, hidden=hidden, computed=computed):
            idx = [next(r for r in range(len(hidden)) if torch.equal(hidden[r], x)) for x in h]
            computed.extend(idx)
            return full[idx]
        want = verdict(full, torch.Generator().manual_seed(1000 + seed))
        g = torch.Generator().manual_seed(1000 + seed)
        rows, got = verdict_on_demand(tree, hidden, logits_of, lambda r: verdict(r, g), g)
        assert (got.path, got.tokens, got.next_token) == (want.path, want.tokens, want.next_token)
        read = [0] + [1 + i for i in tree.chain_from(got.path)]
        assert torch.equal(rows[read], full[read])
        # each row once: the inner rows and the chain's leaf (a leaf's row is read only by the record and the end)
        assert sorted(computed) == sorted(set(inner_rows(tree)) | set(read))
        assert len(computed) == len(inner_rows(tree)) + 1
        ends_at_leaf += bool(got.path) and not tree.children(got.path[-1])
    assert ends_at_leaf > 0                # the re-run was exercised


def test_inner_rows_and_chain_from():
    tree = DraftTree.from_paths([[1, 2, 3], [1, 4], [5]])     # nodes: 0:1 1:2 2:3 3:4 4:5
    assert inner_rows(tree) == [0, 1, 2]                       # root, node 0, node 1
    assert tree.chain_from([]) == [0, 1, 2] and tree.chain_from([0, 3]) == [0, 3] and tree.chain_from([4]) == [4]
    assert inner_rows(DraftTree((), ())) == [0] and DraftTree((), ()).chain_from([]) == []


def test_verdict_on_demand_without_a_generator_computes_every_row():
    tree = ON_DEMAND_TREES[0]
    hidden = torch.randn(len(tree) + 1, 4)
    seen = []
    rows, res = verdict_on_demand(tree, hidden, lambda h: (seen.append(len(h)), h.repeat(1, 3))[1],
                                  lambda r: verify_greedy(tree, r), None)
    assert seen == [len(tree) + 1] and torch.equal(rows, hidden.repeat(1, 3))


def test_bench_tree_smoke(tmp_path):
    """scripts/bench_tree.py end to end on tiny random models: results written, outputs equal to greedy."""
    import json

    from scripts.bench_tree import main

    assert main(["--tiny", "--out", str(tmp_path), "--repeats", "1", "--nodes", "4", "8", "--branching", "2,1",
                 "1,1,1", "--prompts", "1", "--max-tokens", "6"]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert [r["nodes"] for r in result["verify_cost"]] == [0, 4, 8]
    rows = result["end_to_end"]
    assert set(rows) == {"target", "(2, 1)", "(1, 1, 1)"}
    assert all(rows[k]["mismatches"] == 0 and rows[k]["tokens"] == 6 for k in ("(2, 1)", "(1, 1, 1)"))
    assert (tmp_path / "tree.png").stat().st_size > 0 and "End to end" in (tmp_path / "results.md").read_text()


def test_bench_threads_smoke(tmp_path):
    """scripts/bench_threads.py end to end on a tiny random model: a row per width, each pass timed on 1 thread,
    on the wide count and switched, the thread count restored to 1 after the switched passes; bad input refused."""
    import json

    import torch

    from scripts.bench_threads import main

    before = torch.get_num_threads()
    try:
        assert main(["--tiny", "--out", str(tmp_path), "--repeats", "2", "--widths", "1", "4", "--prefix", "8"]) == 0
    finally:
        torch.set_num_threads(before)
    result = json.loads((tmp_path / "results.json").read_text())
    rows = result["rows"]
    assert [r["tokens"] for r in rows] == [1, 4]
    assert all(r[k] > 0 for r in rows for k in ("one_thread_ms", "wide_ms", "switched_ms", "next_one_token_ms"))
    assert rows[0]["one_thread_ratio"] == 1.0
    assert (tmp_path / "threads.png").stat().st_size > 0 and "| 4 |" in (tmp_path / "results.md").read_text()
    with pytest.raises(SystemExit):
        main(["--tiny", "--out", str(tmp_path), "--widths", "0"])
