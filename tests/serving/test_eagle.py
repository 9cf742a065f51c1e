"""The EAGLE-style head (serving/decoding/eagle.py): the drafter's tree (cache, tree mask, fed-back
features) equals the head run teacher-forced over each path, its cache after acceptance equals a fresh
pass, decoding equals target greedy at T=0 and is distributed as the target at T=1, files and errors."""
from __future__ import annotations

import pytest
import torch

from serving.decoding.eagle import EagleDrafter, EagleHead, eagle_generate
from serving.decoding.tree import feed_masked_hidden
from tests.serving.test_medusa import V, assert_distributed_as_target
from tests.serving.test_tree import plain_greedy
from tests.tiny_models import make_model


def random_head(target, seed=0, scale=0.3, ids=None):
    vocab = target.get_output_embeddings().weight.shape[0]
    head = EagleHead.for_target(target, list(range(vocab)) if ids is None else ids)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(scale * p.std().clamp(min=0.05) * torch.randn(p.shape, generator=g))
    return head.eval()


def features(target, ids):
    n = len(ids)
    return feed_masked_hidden(target, ids, torch.ones(n, n, dtype=torch.bool).tril(), torch.arange(n), None)[1]


def teacher_forced(head, feats, tokens):
    with torch.no_grad():
        states, _ = head(torch.stack(list(feats))[None], torch.tensor([list(tokens)]))
    return states[0]


def test_tree_equals_the_head_run_over_each_path():
    target = make_model(seed=0, sharp=3.0)
    head = random_head(target)
    prompt = [5, 9, 100, 42, 7, 13]
    F = features(target, prompt[:-1])                          # f_0..f_4; inputs (f_t, x_{t+1})
    drafter = EagleDrafter(head, (2, 1, 1))
    drafter.push(F, prompt[1:])
    tree = drafter.propose()
    states = teacher_forced(head, F, prompt[1:])
    depth1 = torch.topk(head.logits(states[-1]), 2).indices.tolist()
    assert [tree.tokens[c] for c in tree.children(-1)] == depth1
    for c in tree.children(-1):                                # each chain: feed back the predicted feature
        feats, toks, node = list(F) + [states[-1]], list(prompt[1:]) + [tree.tokens[c]], c
        while tree.children(node):
            st = teacher_forced(head, feats, toks)
            (child,) = tree.children(node)
            assert tree.tokens[child] == int(head.logits(st[-1]).argmax())
            feats.append(st[-1])
            toks.append(tree.tokens[child])
            node = child


def test_cache_after_acceptance_equals_a_fresh_pass():
    target = make_model(seed=1, sharp=3.0)
    head = random_head(target, seed=2)
    prompt = [5, 9, 100, 42, 7]
    drafter = EagleDrafter(head, (2, 2))
    drafter.push(features(target, prompt[:-1]), prompt[1:])
    tree = drafter.propose()
    path = [tree.children(-1)[1], tree.children(tree.children(-1)[1])[0]]
    seq = prompt + [tree.tokens[i] for i in path] + [77]        # accepted path + the target's token
    true = features(target, seq[:-1])
    drafter.accept(true[len(prompt) - 1:], seq[len(prompt):])
    nxt = drafter.propose()
    fresh = teacher_forced(head, true, seq[1:])
    assert [nxt.tokens[c] for c in nxt.children(-1)] == torch.topk(head.logits(fresh[-1]), 2).indices.tolist()
    assert drafter.committed == len(seq) - 1


@pytest.mark.parametrize("branching", [(1, 1, 1), (2, 1, 1), (3, 2), (4,)])
def test_t0_decoding_equals_target_greedy(branching):
    target = make_model(seed=0, sharp=3.0)
    head = random_head(target, seed=len(branching))
    for prompt in ([1, 2, 3], [100, 101, 102, 103, 104, 105], [7, 8]):
        out, stats = eagle_generate(target, head, prompt, 20, branching)
        assert out == plain_greedy(target, prompt, 20)
        assert stats.nodes > 0


def test_sampling_through_the_head_is_distributed_as_the_target():
    target = make_model(seed=4, vocab_size=V, sharp=1.5)
    head = random_head(target, seed=7, scale=0.2)
    assert_distributed_as_target(
        target, lambda p, g: eagle_generate(target, head, p, 2, (2, 1), temperature=1.0, generator=g))

def test_files_and_errors(tmp_path):
    target = make_model(seed=3)
    head = random_head(target, ids=list(range(0, 259, 3)))
    head.save(tmp_path / "e", note="x")
    back = EagleHead.load(tmp_path / "e", target)
    f, t = torch.randn(1, 4, 32), torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(back(f, t)[0], head(f, t)[0])
    assert back.output_token_ids == head.output_token_ids
    with pytest.raises(FileNotFoundError, match="not an EAGLE head folder"):
        EagleHead.load(tmp_path, target)
    with pytest.raises(ValueError, match="hidden size 32, the target has 64"):
        EagleHead.load(tmp_path / "e", make_model(hidden=64))
    with pytest.raises(ValueError, match="at least two tokens"):
        eagle_generate(target, head, [1], 4, (1,))
    with pytest.raises(ValueError, match="branching"):
        EagleDrafter(head, (2, 0))
