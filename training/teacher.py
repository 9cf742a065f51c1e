"""Offline teacher data for the bootstrap draft: the target's own greedy answers to training prompts,
with the target's top-k log-probabilities saved on the way (so distillation never re-runs the target).

Generation is batched with left padding (one `generate` call per batch, KV-cached), and the top-k
of the raw (temperature 1) log-softmax is taken from the scores `generate` already computed: the
teacher signal costs nothing extra. While generating, the target runs the grouped-query attention
below (`GROUPED_ATTENTION`) instead of PyTorch's CPU SDPA kernel, which at one query token and
batch 32 took over half of each decoding step on this project's CPU. Output: a list of examples, each
`{"tokens": [prompt + answer ids], "prompt_len": n, "topk_ids": [answer_len, k], "topk_logprobs": [answer_len, k]}`
where row j of the top-k belongs to the position that predicts answer token j.
Each example also carries its "source" (prompt category). Saved as one safetensors file (flat arrays +
offsets, category names in the metadata): no pickle.

`synthesize_prompts` writes the prompts themselves for traffic no packaged set covers (everyday
questions, writing, explanations, code, multi-turn follow-ups): the Magpie technique.
"""
from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

GROUPED_ATTENTION = "draftsmith_grouped"
# From this many query tokens on (a prompt's prefill), `grouped_attention` hands over to PyTorch's fused SDPA
# kernel: at one query token the two matmuls below are several times faster than it, but over a prompt they were
# 2.6x slower (prefill of 64 prompts x 400 tokens, bf16, 2 cores: 47 s against 18 s; docs/benchmarks.md,
# "The fourteenth session"), and long prompts' prefill took most of the bootstrap's teacher time.
PREFILL_SDPA_MIN_QUERIES = 2


def grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention for decoding with grouped-query heads, as two batched matmuls per key/value group.

    query [B, H, q, D], key/value [B, G, L, D] with H = G * r (query head h reads key/value head h // r,
    as `repeat_kv` in transformers), attention_mask additive [B, 1, q, L] or None. Scores and softmax
    in fp32. Returns ([B, q, H, D], None) like the other implementations behind transformers'
    `AttentionInterface`. The keys are never repeated r times, and no fused kernel is involved: on a
    CPU at one query token this is several times faster than `scaled_dot_product_attention`
    (docs/benchmarks.md). Prefill (q >= PREFILL_SDPA_MIN_QUERIES) goes to that fused kernel, with the same
    additive mask and grouped heads (`enable_gqa`), where it is the faster one. Models that need attention features this does not implement (logit
    soft-capping, attention sinks, dropout in training) go to transformers' SDPA path instead."""
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None or (dropout and module.training):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    B, H, q, D = query.shape
    G, L = key.shape[1], key.shape[2]
    r = H // G
    scale = scaling if scaling is not None else D ** -0.5
    if q >= PREFILL_SDPA_MIN_QUERIES:          # a prompt's prefill: PyTorch's fused kernel is the fast one there
        mask = None if attention_mask is None else attention_mask[:, :, :, -L:].to(query.dtype)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=r > 1)
        return out.transpose(1, 2).contiguous(), None
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


def _batch_order(lengths: list[int], batch_size: int, window: int | None) -> list[int]:
    """Prompt indices in processing order: similar lengths together (less padding). With `window`, only
    within consecutive windows of that many prompts, so a run cut short by its deadline still covers the
    given (e.g. shuffled, mixed-category) order instead of only the shortest prompts."""
    idx = list(range(len(lengths)))
    if not window:
        return sorted(idx, key=lambda i: lengths[i])
    return [i for w in range(0, len(idx), window) for i in sorted(idx[w: w + window], key=lambda i: lengths[i])]


MIN_BATCH_S = 5.0   # a batch started before its deadline runs at least this long (some tokens, never none)


def _time_left(deadline: float | None) -> dict:
    """`generate`'s max_time for a batch that must end by `deadline` (a time.time() value): the budget is
    kept within one decode step, not one batch. A batch of 64 prompts x 128 tokens takes minutes on a slow
    2-core CPU, and checking the deadline only between batches let the teacher overrun its share by ~110 s
    there, leaving training 15 steps (docs/benchmarks.md). At least MIN_BATCH_S, so every call yields some
    tokens; answers cut short still teach every position they reached."""
    if deadline is None:
        return {}
    return {"max_time": max(MIN_BATCH_S, deadline - time.time())}


def records_final_states(target) -> bool:
    """Whether `FinalStates` can hook this target (a decoder with a final `norm`, as Llama-style models have)."""
    try:
        return isinstance(getattr(target.get_decoder(), "norm", None), torch.nn.Module)
    except Exception:  # noqa: BLE001 - a model without get_decoder
        return False


class FinalStates:
    """Records the target's last hidden states (the final norm's output, what `decoder(...).last_hidden_state`
    and the serving tree passes give the Medusa heads) while `generate` runs: of the prefill the last two
    positions, of each decode step its one position; fp16 on the CPU. A forward hook, so that generation itself
    is untouched; `rows(r, A)` then gives example r's Medusa rows (training/heads.py `_medusa_rows`: positions
    P - 2 .. P + A - 2, the first zeros when the prompt has one token) without a second target pass."""

    def __init__(self, target) -> None:
        self.norm = target.get_decoder().norm
        self.calls: list[torch.Tensor] = []
        self.handle = None

    def __enter__(self) -> "FinalStates":
        def hook(_module, _inputs, output):
            h = output[0] if isinstance(output, tuple) else output
            self.calls.append(h[:, -2:].detach().to("cpu", torch.float16) if not self.calls
                              else h[:, -1:].detach().to("cpu", torch.float16))
        self.handle = self.norm.register_forward_hook(hook)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()

    def rows(self, r: int, prompt_len: int, answer_len: int) -> np.ndarray:
        """[answer_len + 1, d] fp16: positions P - 2, P - 1 from the prefill, then P .. P + A - 2 from decode
        steps 1 .. A - 1 (step j fed answer token j - 1)."""
        pre = self.calls[0][r]                                   # [2, d]: positions P - 2, P - 1
        steps = [c[r, 0] for c in self.calls[1: answer_len]]
        out = torch.stack([pre[0], pre[1], *steps]) if steps else pre.clone()
        if prompt_len < 2:
            out[0] = 0
        return out[: answer_len + 1].numpy()


def generate_teacher_data(target, tokenizer, prompts: list[list[int]], *, max_new_tokens: int = 128,
                          batch_size: int = 64, top_k: int = 20, deadline: float | None = None,
                          sources: list[str] | None = None, sort_window: int | None = None,
                          hidden: bool = False, progress=print) -> list[dict]:
    """Greedy target answers + top-k raw log-probs. Stops early (keeping what is done) at `deadline`
    (a time.time() value), within a decode step of it: the batch running then keeps its answers so far (cut
    short), and a slow or loaded machine gets less data, never none. `sources` (one label per prompt) is carried into each example's "source".
    `hidden`: each example also keeps "medusa_rows", the target's last hidden states the Medusa heads train on
    (`FinalStates`), taken from the generation itself instead of a second teacher-forced pass."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    examples: list[dict] = []
    t0 = time.time()
    n_tokens = 0
    order = _batch_order([len(p) for p in prompts], batch_size, sort_window)
    for b in range(0, len(order), batch_size):
        if deadline is not None and time.time() > deadline and examples:
            progress(f"[teacher] time budget reached after {len(examples)} prompts")
            break
        rows = order[b: b + batch_size]
        batch = [prompts[i] for i in rows]
        ids, mask = left_pad(batch, pad)
        width = ids.shape[1]
        states = FinalStates(target) if hidden else contextlib.nullcontext()
        with torch.no_grad(), attention_implementation(target), states:
            out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                  do_sample=False, output_scores=True, return_dict_in_generate=True,
                                  pad_token_id=pad, eos_token_id=eos, **_time_left(deadline))
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
                "source": sources[rows[r]] if sources else "",
            })
            if hidden:
                examples[-1]["medusa_rows"] = states.rows(r, len(p), n)
            n_tokens += n
        rate = n_tokens / (time.time() - t0)
        progress(f"[teacher] {min(b + batch_size, len(order))}/{len(order)} prompts, {n_tokens} tokens, "
                 f"{rate:.0f} tok/s")
    return examples


def synthesize_prompts(target, tokenizer, n: int, *, seeds: list[str] = ("",), batch_size: int = 64,
                       max_new_tokens: int = 40, temperature: float = 0.9, top_p: float = 1.0, top_k: int = 50,
                       history: list[list[dict]] | None = None, deadline: float | None = None,
                       seed: int = 0, progress=print) -> list[tuple[str, list[dict]]]:
    """Self-synthesised user requests (the Magpie technique): the target is given only its chat
    template up to the start of a user turn, optionally followed by a seed word ("Write", "How do I",
    ...), and samples the rest of the user message until it closes the turn. With `history` (earlier
    conversations, one per prompt, cycled) the new user turn follows that conversation: multi-turn chat.

    Returns up to `n` (user text, messages) pairs, where messages is the conversation including the new
    user turn, ready for `apply_chat_template(..., add_generation_prompt=True)`. Texts that never closed
    the turn, are very short, or repeat an earlier one are dropped. Stops at `deadline`, after at least one
    batch."""
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if not isinstance(end_id, int) or end_id == tokenizer.unk_token_id:
        end_id = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    marker = "\x00MAGPIE\x00"
    gen = torch.Generator().manual_seed(seed)
    out: list[tuple[str, list[dict]]] = []
    seen: set[str] = set()
    t0, made, i = time.time(), 0, 0
    while len(out) < n and (deadline is None or i == 0 or time.time() < deadline):
        prefixes, starts, convs = [], [], []
        for _ in range(batch_size):
            conv = list(history[i % len(history)]) if history else []
            start = seeds[int(torch.randint(len(seeds), (1,), generator=gen))]
            text = tokenizer.apply_chat_template(conv + [{"role": "user", "content": marker}], tokenize=False)
            prefixes.append(tokenizer(text[: text.index(marker)] + start, add_special_tokens=False).input_ids)
            starts.append(start)
            convs.append(conv)
            i += 1
        ids, mask = left_pad(prefixes, pad)
        torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
        with torch.no_grad(), attention_implementation(target):
            seqs = target.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature,
                                   top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens, pad_token_id=pad,
                                   eos_token_id=end_id, **_time_left(deadline))
        for start, conv, row in zip(starts, convs, seqs[:, ids.shape[1]:].tolist()):
            if end_id not in row:
                continue                                        # the request never closed its turn
            text = (start + tokenizer.decode(row[: row.index(end_id)], skip_special_tokens=True)).strip()
            if len(text.split()) < 4 or text in seen:
                continue
            seen.add(text)
            out.append((text, conv + [{"role": "user", "content": text}]))
        made += len(prefixes)
        progress(f"[teacher] synthesised {len(out)}/{n} user prompts ({made} sampled, "
                 f"{made / (time.time() - t0):.1f} samples/s)")
    return out[:n]


def save_examples(examples: list[dict], path: Path) -> None:
    from safetensors.numpy import save_file

    names = sorted({e.get("source", "") for e in examples})
    lens = np.array([len(e["tokens"]) for e in examples], dtype=np.int64)
    ans = np.array([len(e["topk_ids"]) for e in examples], dtype=np.int64)
    save_file({
        "tokens": np.concatenate([np.asarray(e["tokens"], dtype=np.int32) for e in examples]),
        "seq_lens": lens,
        "prompt_lens": np.array([e["prompt_len"] for e in examples], dtype=np.int64),
        "answer_lens": ans,
        "topk_ids": np.concatenate([e["topk_ids"] for e in examples]),
        "topk_logprobs": np.concatenate([e["topk_logprobs"] for e in examples]),
        "source_index": np.array([names.index(e.get("source", "")) for e in examples], dtype=np.int64),
        # the Medusa heads' hidden rows (A + 1 per example), when every example has them
        **({"medusa_rows": np.concatenate([e["medusa_rows"] for e in examples])}
           if examples and all("medusa_rows" in e for e in examples) else {}),
    }, str(path), metadata={"sources": json.dumps(names)})


def load_examples(path: Path) -> list[dict]:
    from safetensors import safe_open
    from safetensors.numpy import load_file

    d = load_file(str(path))
    with safe_open(str(path), framework="np") as f:
        names = json.loads((f.metadata() or {}).get("sources", '[""]'))
    src = d.get("source_index", np.zeros(len(d["seq_lens"]), dtype=np.int64))
    rows = d.get("medusa_rows")
    out, s, a, h = [], 0, 0, 0
    for L, P, A, S in zip(d["seq_lens"], d["prompt_lens"], d["answer_lens"], src):
        out.append({"tokens": d["tokens"][s: s + L].tolist(), "prompt_len": int(P),
                    "topk_ids": d["topk_ids"][a: a + A], "topk_logprobs": d["topk_logprobs"][a: a + A],
                    "source": names[int(S)]})
        if rows is not None:
            out[-1]["medusa_rows"] = rows[h: h + A + 1]
            h += int(A) + 1
        s += int(L)
        a += int(A)
    return out
