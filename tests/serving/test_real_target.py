"""End to end on the real default target (SmolLM2-135M-Instruct, converted once from the packaged GGUF
file, as set-up does anyway): its chat template, and temperature-0 speculative decoding (adaptive
controller on, and a fixed gamma) equal to target-only decoding, in fp32 (in bf16 a multi-token forward
rounds differently from a one-token one and flips near ties; see docs/benchmarks.md).

The draft is built the way the bootstrap starts it (two layers initialised from the target, embedding
tied) with a cut output vocabulary chosen by `training.vocab` from the target's own top-k on a prompt,
untrained: a weak draft, so both accepted and rejected tokens occur."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from serving.config import SamplingParams, SpecParams
from serving.engine import Engine
from serving.models import ensure_default_target, load_causal_lm, load_tokenizer
from training.draft_builder import make_draft_from_target
from training.prompts import chat_prompt_ids
from training.vocab import choose_vocabulary, token_mass

pytestmark = pytest.mark.slow

QUESTIONS = ["How do I reverse a list in Python?", "Write two sentences about autumn in a small town."]


@pytest.fixture(scope="module")
def real_pair(tmp_path_factory):
    target_dir = ensure_default_target()
    tok = load_tokenizer(target_dir)
    target = load_causal_lm(target_dir, "cpu", torch.float32)
    ids = torch.tensor([chat_prompt_ids(tok, QUESTIONS[0])])
    with torch.no_grad():
        lp = torch.log_softmax(target(ids).logits[0].float(), -1)
    top = torch.topk(lp, 200, dim=-1)
    keep = choose_vocabulary(token_mass(top.indices.numpy(), top.values.numpy(), len(tok)), 4096,
                             always=tok.all_special_ids)
    draft_dir = tmp_path_factory.mktemp("real") / "draft"
    make_draft_from_target(target, 2).save_pretrained(draft_dir)
    tok.save_pretrained(draft_dir)
    (draft_dir / "draftsmith.json").write_text(json.dumps({"output_token_ids": keep}))
    return target_dir, draft_dir, keep


@pytest.fixture
def two_threads():
    """A 135M model in fp32 runs ~2x faster on both cores; the other tests keep conftest's one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_chat_template_and_greedy_speculative_equals_target(real_pair, two_threads):
    target_dir, draft_dir, keep = real_pair
    engine = Engine.from_paths(str(target_dir), str(draft_dir), dtype=torch.float32, device="cpu",
                               draft_version="t")
    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    assert engine.draft.output_token_ids.tolist() == keep
    assert tok.convert_tokens_to_ids("<|im_end|>") in engine.eos_token_ids
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    drafted = 0
    for q in QUESTIONS:
        prompt = chat_prompt_ids(tok, q)
        expected = engine.generate_all(prompt, greedy, SpecParams(mode="target"))
        assert len(expected.token_ids) > 5 and tok.decode(expected.token_ids).strip()
        for spec in (SpecParams(mode="speculative", gamma=4), SpecParams(mode="speculative", gamma=4, adaptive=False),
                     SpecParams(mode="mjsd", gamma=4)):
            res = engine.generate_all(prompt, greedy, spec)
            assert res.token_ids == expected.token_ids, (q, spec)
            drafted += res.stats.draft_tokens
    assert drafted > 0
    assert np.isfinite(engine.costs.target_s(1))
