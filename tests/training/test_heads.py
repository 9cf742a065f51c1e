"""Training Medusa heads (training/heads.py): row alignment of hidden states, committed tokens and labels;
the teacher-forced hidden-state pass against decoding's own; training that raises agreement and then
drafts accepted tokens in decoding; files and the CLI's errors."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from serving.decoding.medusa import MedusaHeads, medusa_generate
from serving.decoding.tree import feed_masked_hidden
from tests.serving.test_tree import plain_greedy
from tests.tiny_models import make_model, make_tokenizer
from training.heads import (HeadData, _eagle_batch, build_eagle, build_heads, chain_acceptance, eagle_agreement,
                            head_agreement, main, target_hidden_rows, target_hidden_states)


def teacher_examples(target, prompts, n, k=20, source="s"):
    """What training/teacher.py stores: the target's greedy answer and its top-k log-probs per answer token."""
    out = []
    for p in prompts:
        ans = plain_greedy(target, p, n)
        with torch.no_grad():
            logp = torch.log_softmax(target(input_ids=torch.tensor([p + ans])).logits[0].float(), -1)
        rows = logp[len(p) - 1: len(p) - 1 + n]
        top = torch.topk(rows, k)
        out.append({"tokens": p + ans, "prompt_len": len(p), "topk_ids": top.indices.numpy().astype(np.int32),
                    "topk_logprobs": top.values.numpy().astype(np.float16), "source": source})
    return out


def test_rows_align_hidden_state_committed_token_and_each_heads_label():
    tokens = [10, 11, 12, 20, 21, 22, 23]                  # prompt of 3, answer of 4
    ex = {"tokens": tokens, "prompt_len": 3, "topk_ids": np.arange(4 * 2).reshape(4, 2) % 5 + 20,
          "topk_logprobs": np.zeros((4, 2), np.float16)}
    hidden = torch.arange(5.0)[:, None].repeat(1, 3)        # row r = position P - 2 + r, marked r
    vocab_index = torch.arange(60)
    data = HeadData([ex], [hidden], 2, vocab_index)
    assert len(data) == 4
    assert data.h[:, 0].tolist() == [0, 1, 2, 3]
    assert data.root.tolist() == [12, 20, 21, 22]            # the token after the hidden state's position
    assert data.labels.tolist() == [[0, 1], [1, 2], [2, 3], [3, -1]]
    assert data.hard.tolist() == [20, 21, 22, 23]            # label j = answer token j
    ok, b = data.head_batch(torch.arange(4), 1)
    assert ok.tolist() == [True, True, True, False] and b["hard"].tolist() == [21, 22, 23]


def test_teacher_forced_hidden_rows_are_decodings_hidden_states():
    target = make_model(seed=0, sharp=3.0)
    exs = teacher_examples(target, [[1, 2, 3, 4], [9, 8]], 5)
    rows = target_hidden_rows(target, exs, batch_size=2, progress=lambda m: None)
    for e, r in zip(exs, rows):
        n = len(e["tokens"])
        _, h, _ = feed_masked_hidden(target, e["tokens"], torch.ones(n, n, dtype=torch.bool).tril(),
                                     torch.arange(n), None)
        P = e["prompt_len"]
        torch.testing.assert_close(r[: 5], h[P - 2: P + 3].float(), atol=1e-5, rtol=1e-4)


def test_training_raises_agreement_and_the_heads_then_draft_accepted_tokens(tmp_path):
    target = make_model(seed=0, sharp=3.0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (6,), generator=g).tolist() for _ in range(12)]
    exs = teacher_examples(target, prompts, 16)
    figures = build_heads(target, make_tokenizer(), exs, exs[:4], tmp_path / "heads", num_heads=2,
                          vocab_size=128, budget_s=60, batch_size=32, lr=3e-3, max_epochs=300, progress=lambda m: None)
    heads = MedusaHeads.load(tmp_path / "heads", target)
    fresh = MedusaHeads.for_target(target, heads.config, heads.output_token_ids)
    vocab_index = torch.full((260,), -1, dtype=torch.long)
    vocab_index[torch.tensor(heads.output_token_ids)] = torch.arange(len(heads.output_token_ids))
    data = HeadData(exs, target_hidden_rows(target, exs, progress=lambda m: None), 2, vocab_index)
    before, after = head_agreement(fresh, data), head_agreement(heads, data)
    assert after[0] >= before[0] + 0.3 and after[1] >= before[1] + 0.3, (before, after)
    assert figures["train_head_agreement"] == after
    assert chain_acceptance(heads, data)[1] > 0.3
    out, stats = medusa_generate(target, heads, prompts[0], 16, (1, 1))
    assert out == plain_greedy(target, prompts[0], 16)
    assert stats.accepted >= 4                                   # learnt continuations are accepted (7 seen)
    meta = (tmp_path / "heads" / "medusa_heads.json").read_text()
    assert "heldout_chain_acceptance" in meta and "heldout_head_agreement_by_source" in meta


def test_eagle_batch_aligns_inputs_feature_targets_and_labels():
    tokens = [10, 11, 12, 20, 21, 22]                     # prompt of 3, answer of 3
    ex = {"tokens": tokens, "prompt_len": 3, "topk_ids": np.array([[20, 1], [21, 1], [22, 1]]),
          "topk_logprobs": np.zeros((3, 2), np.float16)}
    feats = torch.arange(6.0)[:, None].repeat(1, 4)        # f_t marked t
    b = _eagle_batch([ex], [feats], torch.arange(30))
    assert b["f_in"][0, :, 0].tolist() == [0, 1, 2, 3, 4] and b["f_out"][0, :, 0].tolist() == [1, 2, 3, 4, 5]
    assert b["tok"][0].tolist() == [11, 12, 20, 21, 22]     # input t reads x_{t+1}
    assert b["rows_t"].tolist() == [1, 2, 3]                # input t predicts x_{t+2} = answer token t - 1
    assert b["hard"].tolist() == [20, 21, 22] and b["topk"][:, 0].tolist() == [20, 21, 22]


def test_eagle_training_raises_agreement_and_drafts_accepted_tokens(tmp_path):
    from serving.decoding.eagle import EagleHead, eagle_generate

    target = make_model(seed=0, sharp=3.0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (6,), generator=g).tolist() for _ in range(12)]
    exs = teacher_examples(target, prompts, 16)
    figures = build_eagle(target, make_tokenizer(), exs, exs[:4], tmp_path / "eagle", vocab_size=128, budget_s=60,
                          batch_size=4, lr=3e-3, max_epochs=60, progress=lambda m: None)
    head = EagleHead.load(tmp_path / "eagle", target)
    fresh = EagleHead.for_target(target, head.output_token_ids)
    vocab_index = torch.full((260,), -1, dtype=torch.long)
    vocab_index[torch.tensor(head.output_token_ids)] = torch.arange(len(head.output_token_ids))
    feats = target_hidden_states(target, exs, progress=lambda m: None)
    before, after = eagle_agreement(fresh, exs, feats, vocab_index), eagle_agreement(head, exs, feats, vocab_index)
    assert after >= before + 0.5, (before, after)
    assert figures["heldout_agreement"] == eagle_agreement(head, exs[:4], feats[:4], vocab_index)
    out, stats = eagle_generate(target, head, prompts[0], 16, (1, 1, 1))
    assert out == plain_greedy(target, prompts[0], 16)
    assert stats.accepted >= 6                                   # learnt continuations, several per pass


def test_cli_says_what_to_fix(tmp_path, capsys):
    assert main(["--teacher", str(tmp_path / "none.safetensors")]) == 2
    assert "run `draftsmith bootstrap` first" in capsys.readouterr().err
