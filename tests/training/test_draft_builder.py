"""The bootstrap draft builder (training/draft_builder.py) on tiny models: layer initialisation from the
target, training on the target's own teacher data, the draft's own output rows surviving save/load, and
the folder it writes decoding correctly in the engine."""
from __future__ import annotations

import json
import random
import time

import pytest
import torch

from tests import tiny_models
from serving.config import SamplingParams, SpecParams
from serving.engine import Engine
from training.draft_builder import bootstrap, choose_output_vocabulary, make_draft_from_target, train_draft
from training.teacher import generate_teacher_data


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("boot")
    tok = tiny_models.make_tokenizer()
    path = root / "target"
    tiny_models.make_model(0, layers=4, sharp=8.0).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def teacher(target_dir):
    from transformers import AutoModelForCausalLM

    tok = tiny_models.make_tokenizer()
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    rng = random.Random(0)
    words = "add the two numbers then multiply by three and tell me the answer please".split()
    prompts = [tok(" ".join(rng.choices(words, k=6)))["input_ids"] for _ in range(24)]
    examples = generate_teacher_data(target, tok, prompts, max_new_tokens=12, batch_size=8, progress=lambda m: None)
    return target, tok, examples


def test_draft_layers_are_copied_from_the_chosen_target_layers(teacher):
    target, _, _ = teacher
    draft = make_draft_from_target(target, layers=[0, 3])
    assert draft.config.num_hidden_layers == 2
    for j, i in enumerate([0, 3]):
        for name, p in draft.model.layers[j].state_dict().items():
            assert torch.equal(p, target.model.layers[i].state_dict()[name]), (j, i, name)
    assert torch.equal(draft.get_input_embeddings().weight, target.get_input_embeddings().weight)
    with pytest.raises(ValueError, match="must be indices"):
        make_draft_from_target(target, layers=[0, 4])


@pytest.mark.parametrize("train_head,bf16", [(False, True), (True, True), (False, False)])
def test_training_raises_agreement_with_the_teacher(teacher, train_head, bf16):
    target, tok, examples = teacher
    torch.manual_seed(0)
    draft = make_draft_from_target(target, layers=[0])
    subset, ranking = choose_output_vocabulary(examples, tok, 200)
    assert len(subset) <= 200 and set(tok.all_special_ids) <= set(subset.tolist())
    assert set(subset.tolist()) - set(tok.all_special_ids) <= set(ranking[:200])
    random.seed(0)
    # a step budget, not a time one: 4 s bought only 12 steps on a loaded CI host, too few to fit
    fig = train_draft(draft, examples, examples, subset, deadline=time.time() + 600, max_steps=40, lr=1e-2,
                      train_head=train_head, bf16=bf16, progress=lambda m: None)
    assert fig["train_steps"] == 40
    # the examples are the training set here: fitting them is what this checks
    assert fig["heldout_top1_agreement_after"] > fig["heldout_top1_agreement_before"] + 0.1, fig
    head = draft.get_output_embeddings().weight
    emb = draft.get_input_embeddings().weight
    if train_head:   # own output rows on the kept vocabulary, the input embedding elsewhere
        assert not torch.equal(head[subset], emb[subset])
        rest = torch.ones(len(head), dtype=torch.bool)
        rest[subset] = False
        assert torch.equal(head[rest], emb[rest])
    else:
        assert head.data_ptr() == emb.data_ptr()


def test_bootstrap_writes_a_folder_the_engine_decodes_losslessly(target_dir, tmp_path):
    out = bootstrap(tmp_path / "draft", target_dir, budget_s=24, teacher_share=0.5, layers=[0, 3], train_head=True,
                    max_new_tokens=8, vocab_size=200, synth_prompts=64, progress=lambda m: None)
    meta = json.loads((out / "draftsmith.json").read_text())
    # the general recipe: packaged maths / science / code prompts beside self-synthesised ones, and
    # held-out agreement reported per category
    assert meta["prompts_source"] == "general"
    sources = {"chat", "multiturn", "gsm8k", "humaneval", "gpqa", "aime"}
    assert len(meta["teacher_tokens_by_source"]) >= 2 and set(meta["teacher_tokens_by_source"]) <= sources
    # (the tiny byte-level tokenizer makes most HumanEval / GPQA prompts longer than MAX_PROMPT_TOKENS)
    assert "gsm8k" in meta["heldout_top1_agreement_by_source"]
    assert set(meta["heldout_top1_agreement_by_source"]) <= sources
    assert len(meta["output_token_ids"]) <= 200
    assert meta["layers_from_target"] == [0, 3] and meta["train_head"] is True
    assert meta["teacher_examples"] > 0 and meta["train_steps"] > 0
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert reloaded.config.tie_word_embeddings is False
    rows = torch.tensor(meta["output_token_ids"])
    assert not torch.equal(reloaded.lm_head.weight[rows], reloaded.get_input_embeddings().weight[rows])

    engine = Engine.from_paths(str(target_dir), str(out), dtype=torch.float32, device="cpu", draft_version="boot")
    prompt = engine.tokenizer("add the two numbers")["input_ids"]
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    expected = engine.generate_all(prompt, greedy, SpecParams(mode="target")).token_ids
    res = engine.generate_all(prompt, greedy, SpecParams(mode="speculative", gamma=4))
    assert res.token_ids == expected
    assert res.stats.draft_tokens > 0


def test_bench_split_trains_one_draft_per_arm_on_the_saved_teacher_cache(target_dir, teacher, tmp_path, capsys):
    """scripts/bench_split.py: each FRACTION:SECONDS arm trains a fresh draft on that share of the cached
    examples and reports held-out agreement; a malformed arm or a missing cache is a clear CLI error."""
    import importlib.util
    from pathlib import Path

    from training.teacher import save_examples

    spec = importlib.util.spec_from_file_location("bench_split", Path(__file__).resolve().parents[2] / "scripts" / "bench_split.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    _, _, examples = teacher
    cache = tmp_path / "teacher.safetensors"
    save_examples(examples[:18], cache)
    save_examples(examples[18:], cache.with_suffix(".heldout.safetensors"))
    out = tmp_path / "out"
    assert bench.main(["--cache", str(cache), "--target", str(target_dir), "--arm", "1.0:1", "--arm", "0.5:1",
                       "--vocab-size", "200", "--threads", "1", "--out", str(out)]) == 0
    arms = json.loads((out / "split.json").read_text())["arms"]
    assert [a["examples"] for a in arms] == [18, 9]
    assert all(a["steps"] >= 1 and 0.0 <= a["heldout_top1_agreement"] <= 1.0 for a in arms)
    assert (out / "split.md").exists() and (out / "split.png").exists()
    for bad in (["--arm", "1.5:10"], ["--arm", "half"], ["--cache", str(tmp_path / "none.safetensors")]):
        with pytest.raises(SystemExit):
            bench.main(["--cache", str(cache), "--target", str(target_dir), "--out", str(out), *bad])
        assert "error" in capsys.readouterr().err


def test_the_follow_up_phase_gets_at_least_a_batchs_time_while_the_teacher_has_it():
    """92% of the teacher's time as planned; at least FOLLOW_UP_MIN_S from now when the answer phase overran its
    88% (one bootstrap's follow-up batch got a few seconds and wrote none); skipped when the teacher's time is
    spent or would be."""
    from training.draft_builder import FOLLOW_UP_MIN_S, follow_up_deadline

    t0, teacher_s = 1000.0, 600.0
    assert follow_up_deadline(t0 + 0.80 * teacher_s, t0, teacher_s) == pytest.approx(t0 + 0.92 * teacher_s)
    late = t0 + 0.91 * teacher_s                     # the answer phase ran 18 s past its 88%
    assert follow_up_deadline(late, t0, teacher_s) == pytest.approx(late + FOLLOW_UP_MIN_S)
    assert follow_up_deadline(t0 + teacher_s - FOLLOW_UP_MIN_S + 1, t0, teacher_s) is None
    assert follow_up_deadline(t0 + 1.01 * teacher_s, t0, teacher_s) is None


def test_a_row_whose_top_k_lies_outside_the_kept_vocabulary_leaves_the_loss_finite_and_unchanged():
    """Online, new traffic brings target rows whose top-k tokens are all outside the kept vocabulary (and whose
    greedy token is too): such a row has neither a soft nor a hard term, so the loss and its gradient equal
    those of the batch without it (the loss was NaN; a heads job logged "loss nan")."""
    from training.draft_builder import distill_loss

    torch.manual_seed(0)
    h, w = torch.randn(4, 8), torch.randn(16, 8)
    topk = torch.tensor([[0, 1, 2], [3, 4, -1], [6, -1, -1], [-1, -1, -1]])
    batch = {"topk": topk, "topk_lp": torch.log_softmax(torch.randn(4, 3), -1), "hard": torch.tensor([0, 3, 6, -1])}
    rows = h.clone().requires_grad_(True)
    loss, _ = distill_loss(rows, w, batch)
    loss.backward()
    kept = h[:3].clone().requires_grad_(True)
    ref, _ = distill_loss(kept, w, {k: v[:3] for k, v in batch.items()})
    ref.backward()
    assert torch.isfinite(loss) and torch.allclose(loss, ref)
    assert torch.allclose(rows.grad[:3], kept.grad) and torch.count_nonzero(rows.grad[3]) == 0


def test_the_reserve_interleaves_the_unused_packaged_prompts_by_share():
    """The teacher's reserve (answered after the mix while its time lasts): rounds of 20 by share, each prompt
    once, sources that run out dropped from later rounds, at most `limit`."""
    from training.draft_builder import GENERAL_MIX, reserve_prompts

    rest = {"gsm8k": [f"g{i}" for i in range(30)], "humaneval": [f"h{i}" for i in range(6)],
            "gpqa": [f"q{i}" for i in range(10)], "aime": []}
    out = reserve_prompts(rest, GENERAL_MIX, limit=1000)
    assert [s for _, s in out[:15]] == ["gsm8k"] * 7 + ["humaneval"] * 5 + ["gpqa"] * 2 + ["gsm8k"]   # aime: none
    assert sorted(t for t, _ in out) == sorted(sum(rest.values(), []))          # every unused prompt, once
    assert [t for t, s in out if s == "gsm8k"] == rest["gsm8k"]                 # in the shuffled order given
    assert len(reserve_prompts(rest, GENERAL_MIX, limit=10)) == 10
    assert reserve_prompts({s: [] for s in GENERAL_MIX}, GENERAL_MIX, limit=10) == []
