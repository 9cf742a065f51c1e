"""Offline teacher data for the bootstrap draft: the target's own greedy answers to training prompts,
with the target's top-k log-probabilities saved on the way (so distillation never re-runs the target).

Generation is batched with left padding (one `generate` call per batch, KV-cached), and the top-k
of the raw (temperature 1) log-softmax is taken from the scores `generate` already computed: the
teacher signal costs nothing extra. While generating, the target runs the grouped-query attention
below (`GROUPED_ATTENTION`) instead of PyTorch's CPU SDPA kernel, which at one query token and
batch 32 took over half of each decoding step on this project's CPU. Output: a list of examples, each
`{"tokens": [prompt + answer ids], "prompt_len": n, "topk_ids": [answer_len, k], "topk_logprobs": [answer_len, k]}`
where row j of the top-k belongs to the position that predicts answer token j.
Saved as one safetensors file (flat arrays + offsets): no pickle.
"""
from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

GROUPED_ATTENTION = "draftsmith_grouped"


def grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention for decoding with grouped-query heads, as two batched matmuls per key/value group.

    query [B, H, q, D], key/value [B, G, L, D] with H = G * r (query head h reads key/value head h // r,
    as `repeat_kv` in transformers), attention_mask additive [B, 1, q, L] or None. Scores and softmax
    in fp32. Returns ([B, q, H, D], None) like the other implementations behind transformers'
    `AttentionInterface`. The keys are never repeated r times, and no fused kernel is involved: on a
    CPU at one query token this is several times faster than `scaled_dot_product_attention`
    (docs/benchmarks.md). Models that need attention features this does not implement (logit
    soft-capping, attention sinks, dropout in training) go to transformers' SDPA path instead."""
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None or (dropout and module.training):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    B, H, q, D = query.shape
    G, L = key.shape[1], key.shape[2]
    r = H // G
    scale = scaling if scaling is not None else D ** -0.5
    scores = torch.matmul(query.reshape(B, G, r * q, D), key.transpose(2, 3)).float().view(B, G, r, q, L)
    scores = scores * scale
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, None, :, -L:].float()      # [B, 1, 1, q, L]
    probs = torch.softmax(scores, dim=-1).to(value.dtype).view(B, G, r * q, L)
    out = torch.matmul(probs, value).view(B, H, q, D)
    return out.transpose(1, 2).contiguous(), None


def _register_grouped_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(GROUPED_ATTENTION, grouped_attention)
    AttentionMaskInterface.register(GROUPED_ATTENTION, eager_mask)       # additive float mask


@contextlib.contextmanager
def attention_implementation(model, name: str = GROUPED_ATTENTION):
    """Run `model` with attention implementation `name` inside the block (restored after). Models that
    cannot switch (no `AttentionInterface` support) keep their own and log why."""
    if name == GROUPED_ATTENTION:
        _register_grouped_attention()
    before = model.config._attn_implementation
    try:
        model.set_attn_implementation(name)
    except (ValueError, AttributeError) as exc:
        log.info("keeping attention implementation %s: %s", before, exc)
    try:
        yield model
    finally:
        if model.config._attn_implementation != before:
            model.set_attn_implementation(before)


def left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, width] left-padded with `pad`, and the attention mask (1 on real tokens)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[r, width - len(p):] = 1
    return ids, mask


def topk_logprobs(scores, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the log-softmax of each step's scores (`generate`'s tuple of [B, vocab]; greedy, so the
    raw logits), as ([B, steps, k] log-probs, [B, steps, k] ids). Step by step: no [B, steps, vocab]
    copy is ever made."""
    tops = [torch.topk(torch.log_softmax(sc.float(), dim=-1), k, dim=-1) for sc in scores]
    return torch.stack([t.values for t in tops], dim=1), torch.stack([t.indices for t in tops], dim=1)


def generate_teacher_data(target, tokenizer, prompts: list[list[int]], *, max_new_tokens: int = 128,
                          batch_size: int = 64, top_k: int = 20, deadline: float | None = None,
                          progress=print) -> list[dict]:
    """Greedy target answers + top-k raw log-probs. Stops early (keeping what is done) at `deadline`
    (a time.time() value)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    examples: list[dict] = []
    t0 = time.time()
    n_tokens = 0
    # Similar lengths together: less padding.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for b in range(0, len(order), batch_size):
        if deadline is not None and time.time() > deadline:
            progress(f"[teacher] time budget reached after {len(examples)} prompts")
            break
        batch = [prompts[i] for i in order[b: b + batch_size]]
        ids, mask = left_pad(batch, pad)
        width = ids.shape[1]
        with torch.no_grad(), attention_implementation(target):
            out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                  do_sample=False, output_scores=True, return_dict_in_generate=True,
                                  pad_token_id=pad, eos_token_id=eos)
        top_lp, top_ids = topk_logprobs(out.scores, top_k)          # [B, new, k] each
        gen = out.sequences[:, width:]
        for r, p in enumerate(batch):
            answer = gen[r].tolist()
            if eos in answer:
                answer = answer[: answer.index(eos) + 1]
            n = len(answer)
            if n == 0:
                continue
            examples.append({
                "tokens": list(p) + answer, "prompt_len": len(p),
                "topk_ids": top_ids[r, :n].to(torch.int32).numpy(),
                "topk_logprobs": top_lp[r, :n].to(torch.float16).numpy(),
            })
            n_tokens += n
        rate = n_tokens / (time.time() - t0)
        progress(f"[teacher] {min(b + batch_size, len(order))}/{len(order)} prompts, {n_tokens} tokens, "
                 f"{rate:.0f} tok/s")
    return examples


def save_examples(examples: list[dict], path: Path) -> None:
    from safetensors.numpy import save_file

    lens = np.array([len(e["tokens"]) for e in examples], dtype=np.int64)
    ans = np.array([len(e["topk_ids"]) for e in examples], dtype=np.int64)
    save_file({
        "tokens": np.concatenate([np.asarray(e["tokens"], dtype=np.int32) for e in examples]),
        "seq_lens": lens,
        "prompt_lens": np.array([e["prompt_len"] for e in examples], dtype=np.int64),
        "answer_lens": ans,
        "topk_ids": np.concatenate([e["topk_ids"] for e in examples]),
        "topk_logprobs": np.concatenate([e["topk_logprobs"] for e in examples]),
    }, str(path))


def load_examples(path: Path) -> list[dict]:
    from safetensors.numpy import load_file

    d = load_file(str(path))
    out, s, a = [], 0, 0
    for L, P, A in zip(d["seq_lens"], d["prompt_lens"], d["answer_lens"]):
        out.append({"tokens": d["tokens"][s: s + L].tolist(), "prompt_len": int(P),
                    "topk_ids": d["topk_ids"][a: a + A], "topk_logprobs": d["topk_logprobs"][a: a + A]})
        s += int(L)
        a += int(A)
    return out
