"""Medusa heads (serving/decoding/medusa.py): the hidden-state pass, heads' start as the target's own
prediction, files, tree proposals, decoding equal to target greedy at T=0 and distributed as the target at
T=1 (with a power check)."""
from __future__ import annotations

import itertools

import pytest
import torch

from serving.decoding.medusa import HeadsConfig, MedusaHeads, medusa_generate
from serving.decoding.tree import ROOT, feed_masked, feed_masked_hidden
from tests.serving.test_tree import plain_greedy
from tests.tiny_models import make_model


def causal_mask(n):
    return torch.ones(n, n, dtype=torch.bool).tril(), torch.arange(n)


def heads_for(target, k=3, use_token=True, ids=None, seed=0):
    torch.manual_seed(seed)
    vocab = target.get_output_embeddings().weight.shape[0]
    cfg = HeadsConfig(target.config.hidden_size, k, 1, use_token)
    return MedusaHeads.for_target(target, cfg, list(range(vocab)) if ids is None else ids)


def randomise(heads, scale=0.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(scale * torch.randn(p.shape, generator=g))
    return heads


def test_hidden_pass_gives_the_same_logits_and_the_output_layers_input():
    target = make_model(seed=0, sharp=3.0)
    ids = [5, 9, 100, 42, 7]
    mask, pos = causal_mask(len(ids))
    logits, hidden, _ = feed_masked_hidden(target, ids, mask, pos, None)
    ref, _ = feed_masked(target, ids, mask, pos, None)
    torch.testing.assert_close(logits, ref)
    with torch.no_grad():
        full = target(input_ids=torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(logits, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(target.lm_head(hidden).float(), full, atol=1e-5, rtol=1e-5)


def test_untrained_heads_start_as_the_targets_own_next_token_prediction():
    target = make_model(seed=1)
    heads = heads_for(target, k=2)
    h = torch.randn(4, target.config.hidden_size)
    out = heads(h, torch.tensor([1, 2, 3, 4]))
    assert out.shape == (2, 4, 259)
    for k in range(2):
        torch.testing.assert_close(out[k], target.lm_head(h).detach(), atol=1e-5, rtol=1e-5)


def test_kept_vocabulary_maps_columns_back_to_token_ids():
    target = make_model(seed=1, sharp=4.0)
    keep = [3, 17, 200, 258, 40]
    heads = heads_for(target, k=2, ids=keep)
    h = torch.randn(target.config.hidden_size)
    tree = heads.propose(h, 9, (2, 1))
    assert set(tree.tokens) <= set(keep)
    scores = (target.lm_head.weight[keep] @ h).detach()
    best2 = [keep[i] for i in torch.topk(scores, 2).indices.tolist()]
    assert list(tree.tokens[:2]) == best2                  # untrained head = the target's own ranking
    assert tree.parents == (ROOT, ROOT, 0, 1) and tree.tokens[2] == tree.tokens[3] == best2[0]


def test_tree_needs_enough_heads_and_token_heads_need_the_root():
    target = make_model()
    heads = heads_for(target, k=2)
    with pytest.raises(ValueError, match="depth 3 needs 3 heads"):
        heads.propose(torch.randn(32), 1, (1, 1, 1))
    with pytest.raises(ValueError, match="pass `root`"):
        heads(torch.randn(1, 32))
    with pytest.raises(ValueError, match="out_rows"):
        MedusaHeads(HeadsConfig(32, 1, use_token=False), [1, 2], torch.zeros(3, 32))


def test_save_and_load_round_trip_and_clear_errors(tmp_path):
    target = make_model(seed=3)
    heads = randomise(heads_for(target, k=3, ids=list(range(0, 259, 2))))
    heads.save(tmp_path / "h", note="x")
    back = MedusaHeads.load(tmp_path / "h", target)
    h, root = torch.randn(5, 32), torch.tensor([1, 2, 3, 4, 5])
    torch.testing.assert_close(back(h, root), heads(h, root))
    assert back.output_token_ids == heads.output_token_ids and back.config == heads.config
    assert {p.name for p in (tmp_path / "h").iterdir()} == {"medusa_heads.json", "medusa_heads.safetensors"}
    with pytest.raises(FileNotFoundError, match="not a Medusa heads folder"):
        MedusaHeads.load(tmp_path, target)
    with pytest.raises(ValueError, match="hidden size 32, the target has 64"):
        MedusaHeads.load(tmp_path / "h", make_model(hidden=64))
    (tmp_path / "h" / "medusa_heads.json").write_text('{"hidden_size": "x"}')
    with pytest.raises(ValueError, match="not a valid heads config"):
        MedusaHeads.load(tmp_path / "h", target)


@pytest.mark.parametrize("branching", [(1, 1, 1), (2, 2, 1), (3,), (4, 1)])
@pytest.mark.parametrize("use_token", [True, False])
def test_t0_decoding_equals_target_greedy(branching, use_token):
    target = make_model(seed=0, sharp=3.0)
    heads = randomise(heads_for(target, k=3, use_token=use_token), scale=0.3, seed=len(branching))
    for prompt in ([1, 2, 3], [100, 101, 102, 103, 104, 105], [7]):
        out, stats = medusa_generate(target, heads, prompt, 20, branching)
        assert out == plain_greedy(target, prompt, 20)
        assert stats.steps <= 20 and (stats.nodes > 0 or len(prompt) == 1)


def test_eos_stops_decoding():
    target = make_model(seed=0, sharp=3.0)
    ref = plain_greedy(target, [1, 2, 3], 20)
    eos = ref[5]
    out, _ = medusa_generate(target, heads_for(target), [1, 2, 3], 20, (2, 1), eos_id=eos)
    assert out == ref[: ref.index(eos) + 1]


# ---------------------------------------------------------------------- exact distribution at T=1
V = 6
N_RUNS = 2500
TV_BOUND = 0.09      # 36 outcomes, 2,500 runs: expected TV about 0.04


def _exact_two(target, prompt):
    with torch.no_grad():
        p1 = torch.softmax(target(input_ids=torch.tensor([prompt])).logits[0, -1].float(), -1)
        out = {}
        for a in range(V):
            p2 = torch.softmax(target(input_ids=torch.tensor([prompt + [a]])).logits[0, -1].float(), -1)
            for b in range(V):
                out[(a, b)] = float(p1[a] * p2[b])
    return out


def _tv(emp, exact):
    return 0.5 * sum(abs(emp.get(k, 0.0) - exact[k]) for k in exact)


def assert_distributed_as_target(target, generate, prompt=(1, 4, 2)):
    """`generate(prompt, generator) -> (2 tokens, stats)` sampled N_RUNS times at T=1 matches the target's exact
    distribution of two tokens, uses its drafts (accepted tokens), and is far from a sharper target (power)."""
    prompt = list(prompt)
    g = torch.Generator().manual_seed(0)
    counts, accepted = {}, 0
    for _ in range(N_RUNS):
        out, stats = generate(prompt, g)
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
        accepted += stats.accepted
    emp = {k: v / N_RUNS for k, v in counts.items()}
    exact = _exact_two(target, prompt)
    assert abs(sum(exact.values()) - 1) < 1e-5
    assert _tv(emp, exact) < TV_BOUND
    assert accepted > 0.2 * N_RUNS                      # the tree was really used, not only target tokens
    sharper = {k: v ** 3 for k, v in exact.items()}     # power: far from the target at T = 1/3
    z = sum(sharper.values())
    assert _tv(emp, {k: v / z for k, v in sharper.items()}) > 2 * TV_BOUND
    assert len(set(itertools.chain.from_iterable(counts))) == V


def test_sampling_through_heads_is_distributed_as_the_target():
    target = make_model(seed=4, vocab_size=V, sharp=1.5)
    heads = randomise(heads_for(target, k=2), scale=0.4, seed=7)
    assert_distributed_as_target(
        target, lambda p, g: medusa_generate(target, heads, p, 2, (2, 1), temperature=1.0, generator=g))

def test_bench_medusa_smoke(tmp_path):
    """scripts/bench_medusa.py end to end on tiny random models: results written, outputs equal to greedy."""
    import json

    from scripts.bench_medusa import main

    assert main(["--tiny", "--out", str(tmp_path), "--branching", "2,1", "1,1,1", "--draft-branching", "2,1",
                 "--eagle-branching", "2,1", "--prompts", "1", "--max-tokens", "6"]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert set(rows) == {"target", "medusa (2, 1)", "medusa (1, 1, 1)", "draft (2, 1)", "eagle (2, 1)"}
    assert all(rows[k]["mismatches"] == 0 and rows[k]["tokens"] == 6 for k in rows if k != "target")
    assert (tmp_path / "medusa.png").stat().st_size > 0 and "EAGLE-style head" in (tmp_path / "results.md").read_text()
