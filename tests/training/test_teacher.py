"""The teacher's grouped-query attention (training/teacher.py) against transformers' own SDPA path on a
tiny GQA Llama (4 query heads over 2 key/value heads), in fp32 where both must agree to rounding."""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from tests import tiny_models
from training.teacher import (GROUPED_ATTENTION, attention_implementation, generate_teacher_data, grouped_attention,
                              left_pad)


class _Module(torch.nn.Module):
    training = False


@pytest.mark.parametrize("q_len", [1, 5])
def test_grouped_attention_matches_sdpa_with_an_additive_mask(q_len):
    torch.manual_seed(0)
    B, H, G, L, D = 3, 6, 2, 11, 8
    q, k, v = torch.randn(B, H, q_len, D), torch.randn(B, G, L, D), torch.randn(B, G, L, D)
    mask = torch.zeros(B, 1, q_len, L)
    mask[1, ..., :4] = torch.finfo(torch.float32).min            # row 1 is left-padded by 4
    mask[..., L - q_len:] += torch.triu(torch.full((q_len, q_len), torch.finfo(torch.float32).min), 1)
    got, weights = grouped_attention(_Module(), q, k, v, mask, scaling=0.3)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1),
                                         attn_mask=mask, scale=0.3).transpose(1, 2)
    assert weights is None and got.shape == (B, q_len, H, D)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # the padded keys really are ignored: changing them changes nothing
    k2 = k.clone()
    k2[1, :, :4] = 100.0
    torch.testing.assert_close(grouped_attention(_Module(), q, k2, v, mask, scaling=0.3)[0], got)


def test_prefill_goes_to_the_fused_kernel_and_decoding_to_the_matmuls(monkeypatch):
    """One query token (decoding) runs the two matmuls; a prompt's prefill runs PyTorch's fused SDPA kernel,
    which is the faster one there (PREFILL_SDPA_MIN_QUERIES). bf16, as the teacher runs: a query row whose keys
    are all padding (a left-padded prompt's pad positions) gives finite values, not NaN."""
    import training.teacher as teacher

    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(teacher.F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(1)
    B, H, G, L, D = 2, 6, 2, 9, 8
    for q_len, fused in [(1, False), (teacher.PREFILL_SDPA_MIN_QUERIES, True), (L, True)]:
        calls.clear()
        q = torch.randn(B, H, q_len, D, dtype=torch.bfloat16)
        k, v = torch.randn(B, G, L, D, dtype=torch.bfloat16), torch.randn(B, G, L, D, dtype=torch.bfloat16)
        mask = torch.zeros(B, 1, q_len, L, dtype=torch.bfloat16)
        mask[1, ..., :4] = torch.finfo(torch.bfloat16).min          # row 1 left-padded by 4
        mask[..., L - q_len:] += torch.triu(torch.full((q_len, q_len), torch.finfo(torch.bfloat16).min), 1)
        got = grouped_attention(_Module(), q, k, v, mask, scaling=0.3)[0]
        assert bool(calls) == fused
        assert torch.isfinite(got.float()).all()
        ref = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(H // G, 1),
                                             v.float().repeat_interleave(H // G, 1), attn_mask=mask.float(),
                                             scale=0.3).transpose(1, 2)
        live = torch.ones(B, q_len, dtype=torch.bool)
        live[1, : max(0, 4 - (L - q_len))] = False                    # pad queries: any finite value will do
        torch.testing.assert_close(got.float()[live], ref[live], rtol=3e-2, atol=3e-2)


def _padded_batch(tok, texts):
    prompts = [tok(t)["input_ids"] for t in texts]
    ids, mask = left_pad(prompts, tok.pad_token_id)
    assert [row[m.bool()].tolist() for row, m in zip(ids, mask)] == prompts
    assert ids[0, : ids.shape[1] - len(prompts[0])].eq(tok.pad_token_id).all()
    return prompts, ids, mask


def test_model_logits_and_greedy_text_match_sdpa_and_the_implementation_is_restored():
    tok = tiny_models.make_tokenizer()
    model = tiny_models.make_model(0, layers=2, sharp=8.0)
    _, ids, mask = _padded_batch(tok, ["add two and three", "hi", "multiply seven by a number"])
    assert model.config._attn_implementation != GROUPED_ATTENTION
    before = model.config._attn_implementation
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
        ref_gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        with attention_implementation(model):
            assert model.config._attn_implementation == GROUPED_ATTENTION
            got = model(input_ids=ids, attention_mask=mask).logits
            got_gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                     pad_token_id=tok.pad_token_id)
    assert model.config._attn_implementation == before
    live = mask.bool()
    torch.testing.assert_close(got[live], ref[live], rtol=1e-4, atol=1e-4)
    assert torch.equal(got_gen, ref_gen)


def test_teacher_data_is_the_targets_greedy_answer_with_its_top_k():
    tok = tiny_models.make_tokenizer()
    model = tiny_models.make_model(0, layers=2, sharp=8.0)
    texts = ["add two and three", "hi", "multiply seven by a number", "ok"]
    prompts, _, _ = _padded_batch(tok, texts)
    examples = generate_teacher_data(model, tok, prompts, max_new_tokens=6, batch_size=3, top_k=5,
                                     progress=lambda m: None)
    assert len(examples) == len(prompts)
    by_prompt = {tuple(e["tokens"][: e["prompt_len"]]): e for e in examples}
    for p in prompts:       # unpadded, one at a time, SDPA: the same answer and the same top-k
        e = by_prompt[tuple(p)]
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([p]), max_new_tokens=6, do_sample=False,
                                 pad_token_id=tok.pad_token_id, output_scores=True, return_dict_in_generate=True)
        answer = out.sequences[0, len(p):].tolist()
        if tok.eos_token_id in answer:
            answer = answer[: answer.index(tok.eos_token_id) + 1]
        assert e["tokens"][len(p):] == answer
        lp = torch.log_softmax(torch.stack(out.scores, 1)[0, : len(answer)].float(), -1)
        top_lp, top_ids = torch.topk(lp, 5, -1)
        assert torch.equal(torch.as_tensor(e["topk_ids"]).long(), top_ids)
        torch.testing.assert_close(torch.as_tensor(e["topk_logprobs"]).float(), top_lp, atol=1e-3, rtol=2e-3)


def test_the_teachers_final_states_are_the_medusa_rows_of_a_teacher_forced_pass(tmp_path):
    """Hidden states kept while generating (FinalStates: left-padded batches, KV-cached decoding) equal the
    Medusa heads' rows of one teacher-forced pass per sequence (training/heads.py), including a one-token
    prompt's missing first row; they survive the cache file, and build_heads then needs no target pass."""
    from training.heads import target_hidden_rows
    from training.teacher import load_examples, records_final_states, save_examples

    tok = tiny_models.make_tokenizer()
    model = tiny_models.make_model(0, layers=2, sharp=8.0)
    assert records_final_states(model)
    texts = ["add two and three", "hi", "multiply seven by a number", "ok"]
    prompts, _, _ = _padded_batch(tok, texts)
    prompts.append(prompts[1][:1])                                       # a one-token prompt
    examples = generate_teacher_data(model, tok, prompts, max_new_tokens=6, batch_size=3, top_k=5, hidden=True,
                                     progress=lambda m: None)
    forced = target_hidden_rows(model, examples, progress=lambda m: None)
    for e, want in zip(examples, forced):
        got = torch.from_numpy(e["medusa_rows"]).float()
        assert got.shape == (len(e["topk_ids"]) + 1, model.config.hidden_size)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-2)        # stored in fp16
        if e["prompt_len"] < 2:
            assert not got[0].any()
    save_examples(examples, tmp_path / "t.safetensors")
    back = load_examples(tmp_path / "t.safetensors")
    assert all((a["medusa_rows"] == b["medusa_rows"]).all() for a, b in zip(examples, back))
    plain = generate_teacher_data(model, tok, prompts[:2], max_new_tokens=4, progress=lambda m: None)
    assert "medusa_rows" not in plain[0]


def test_a_passed_deadline_still_gives_one_batch_of_teacher_data_and_one_training_step():
    """A loaded machine (CI's parallel workers) can reach a phase's deadline before it starts: the phase
    then does one batch / one step instead of handing the bootstrap nothing to train on."""
    from training.draft_builder import train_draft

    tok = tiny_models.make_tokenizer()
    model = tiny_models.make_model(0, layers=2, sharp=8.0)
    prompts, _, _ = _padded_batch(tok, ["add two and three", "hi", "multiply seven by a number", "ok"])
    past = time.time() - 1
    examples = generate_teacher_data(model, tok, prompts, max_new_tokens=4, batch_size=3, deadline=past,
                                     progress=lambda m: None)
    assert len(examples) == 3          # the first batch, not the second
    draft = tiny_models.make_model(1, layers=2)
    subset = torch.arange(draft.get_input_embeddings().weight.shape[0])
    fig = train_draft(draft, examples, examples, subset, deadline=past,
                      bf16=False, progress=lambda m: None)
    assert fig["train_steps"] == 1
    assert train_draft(tiny_models.make_model(1, layers=2), [], [], subset, deadline=past, bf16=False,
                       progress=lambda m: None)["train_steps"] == 0


def test_a_deadline_inside_a_batch_cuts_its_answers_short_instead_of_overrunning(monkeypatch):
    """The deadline holds within a decode step, not a batch: a batch that would run far past it (here
    thousands of tokens per answer) stops at it, and its answers so far are kept as teacher data (every
    position reached has its top-k)."""
    import training.teacher as teacher

    monkeypatch.setattr(teacher, "MIN_BATCH_S", 0.2)
    tok = tiny_models.make_tokenizer()
    model = tiny_models.make_model(0, layers=2)
    prompts, _, _ = _padded_batch(tok, ["add two and three", "hi"])
    t0 = time.time()
    examples = generate_teacher_data(model, tok, prompts, max_new_tokens=20_000, batch_size=2,
                                     deadline=t0 + 0.5, progress=lambda m: None)
    elapsed = time.time() - t0
    assert elapsed < 5.0, elapsed
    assert len(examples) == 2
    for e in examples:
        n = len(e["tokens"]) - e["prompt_len"]
        assert 0 < n < 20_000
        assert len(e["topk_ids"]) == n == len(e["topk_logprobs"])
