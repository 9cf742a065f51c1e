"""Build the default draft on a fresh machine (the bootstrap), in a fixed time budget on a CPU.

Recipe (docs/benchmarks.md and scripts/bench_teacher.py measure why each lever matters on a 2-core CPU):
1. Teacher data: the target's greedy answers to broad prompts (`prompts_source="general"`): requests
   the target writes itself from its chat template's user prefix (Magpie; some with a generic seed
   word), follow-up turns it writes for finished conversations (multi-turn), and packaged GSM8K, GPQA,
   AIME and HumanEval prompts; its top-20 log-probabilities are saved on the way (training/teacher.py),
   so training never re-runs the target (batch 64, grouped-query attention instead of the CPU SDPA
   kernel). Gets 75% of the budget: on a 2-core CPU without native bf16 the 62% split gave 47k answer
   tokens and, after 11 passes, training agreement 0.89 against 0.34 held-out: data is the scarce part
   (docs/benchmarks.md).
2. Draft = the target's width and tokenizer, 2 decoder layers initialised from the target's first
   two (`layers` picks others), the target's embedding and final norm copied; the embedding is
   frozen and tied to the output layer, so only the two decoder layers (+ norm) train.
   `train_head=True` trains the draft's own output rows on the kept vocabulary instead (measured:
   no gain at equal time, and the saved folder grows by an untied output layer, so off by default).
3. Output vocabulary cut to the `vocab_size` tokens (training/vocab.py DEFAULT_VOCAB_SIZE) of largest
   target probability mass on the teacher data (plus the special tokens): the output projection
   dominates a small draft's cost on a CPU. Saved as `draftsmith.json` `output_token_ids`, with the
   whole ranking (`vocab_ranking`) so the size can be re-cut without retraining (scripts/bench_vocab.py);
   the folder itself stays a plain full-vocab Hugging Face model (serving/models.py).
4. Training under bf16 autocast (fp32 master weights) where the CPU has native bf16 (~1.5x the steps/s of
   fp32 there; `serving.models.cpu_has_fast_bf16`), else fp32; the teacher runs in the serving dtype.
   Loss per answer position, over the kept vocabulary:
   0.5 * soft cross-entropy against the target's top-20 distribution (renormalised over its top-20)
   + 0.5 * hard cross-entropy on the target's greedy token.
The held-out split is never trained on; the result reports top-1 agreement with the target on it
(= the per-token acceptance rate of greedy speculative decoding).
"""
from __future__ import annotations

import copy
import json
import logging
import random
import time
from pathlib import Path

import numpy as np
import torch

from training.teacher import generate_teacher_data, load_examples, records_final_states, save_examples

log = logging.getLogger(__name__)


def make_draft_from_target(target, num_layers: int = 2, layers: list[int] | None = None):
    """A `num_layers`-layer model of the target's width: embedding and final norm copied, decoder layer j
    initialised from the target's layer `layers[j]` (default: its first `num_layers` layers)."""
    from transformers import AutoModelForCausalLM

    layers = list(layers) if layers is not None else list(range(num_layers))
    num_layers = len(layers)
    n_target = target.config.num_hidden_layers
    if not layers or min(layers) < 0 or max(layers) >= n_target:
        raise ValueError(f"draft layers {layers} must be indices of the target's {n_target} layers")
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = num_layers
    cfg.tie_word_embeddings = True
    if hasattr(cfg, "layer_types") and cfg.layer_types:
        cfg.layer_types = [cfg.layer_types[i] for i in layers]
    draft = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    src = {t: j for j, t in enumerate(layers)}
    state = {}
    for k, v in target.state_dict().items():
        if k.startswith("model.layers."):
            i = int(k.split(".")[2])
            if i not in src:
                continue
            k = k.replace(f"model.layers.{i}.", f"model.layers.{src[i]}.", 1)
        state[k] = v.float()
    state.pop("lm_head.weight", None)
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(f"draft init mismatch: missing={missing} unexpected={unexpected}")
    draft.tie_weights()
    return draft


def untie_output(draft, subset: torch.Tensor, head_rows: torch.Tensor) -> None:
    """Give `draft` its own output layer: the (frozen) input embedding everywhere, `head_rows` on the
    kept vocabulary `subset` (the rows the engine computes)."""
    emb = draft.get_input_embeddings().weight.detach()
    weight = emb.clone()
    weight[subset] = head_rows.detach().to(weight.dtype)
    draft.config.tie_word_embeddings = False
    if getattr(draft.config, "get_text_config", None):
        draft.config.get_text_config().tie_word_embeddings = False
    draft.lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    draft.lm_head.weight = torch.nn.Parameter(weight, requires_grad=False)


def _batch(examples, vocab_index, device="cpu"):
    """Right-padded batch; targets mapped into the kept vocabulary (-1 where outside)."""
    L = max(len(e["tokens"]) for e in examples)
    k = examples[0]["topk_ids"].shape[1]
    ids = torch.zeros(len(examples), L, dtype=torch.long)
    attn = torch.zeros(len(examples), L, dtype=torch.long)
    # loss rows: position t predicts token t+1; answer token j sits at prompt_len + j
    rows_b, rows_t, tk_ids, tk_lp, hard = [], [], [], [], []
    for b, e in enumerate(examples):
        n = len(e["tokens"])
        ids[b, :n] = torch.tensor(e["tokens"])
        attn[b, :n] = 1
        P = e["prompt_len"]
        A = len(e["topk_ids"])
        rows_b += [b] * A
        rows_t += list(range(P - 1, P - 1 + A))
        tk_ids.append(torch.as_tensor(e["topk_ids"], dtype=torch.long))
        tk_lp.append(torch.as_tensor(e["topk_logprobs"].astype(np.float32)))
        hard.append(torch.tensor(e["tokens"][P: P + A], dtype=torch.long))
    tk_ids = torch.cat(tk_ids)
    return dict(ids=ids, attn=attn, rows_b=torch.tensor(rows_b), rows_t=torch.tensor(rows_t),
                topk=vocab_index[tk_ids], topk_lp=torch.cat(tk_lp), hard=vocab_index[torch.cat(hard)])


def distill_loss(hidden_rows, out_weight, batch, soft_weight: float = 0.5):
    """0.5 * soft CE vs the target's top-k (renormalised over entries inside the kept vocab)
    + 0.5 * hard CE on the target's token. Returns (loss, top-1 agreement). A row whose top-k lies wholly
    outside the kept vocabulary (new traffic's tokens, online) has no soft term: it is left out of that mean
    (it made the loss NaN, though not its gradient), as a row without a hard label is left out of the other."""
    logits = hidden_rows @ out_weight.T                                   # [rows, V_keep]
    logp = torch.log_softmax(logits.float(), dim=-1)
    inside = batch["topk"] >= 0
    soft_ok = inside.any(-1)
    t_lp = batch["topk_lp"].masked_fill(~inside, float("-inf")).masked_fill(~soft_ok[:, None], 0.0)
    t_p = torch.softmax(t_lp, dim=-1)                                     # target over its top-k
    gathered = logp.gather(1, batch["topk"].clamp(min=0))
    soft = -(t_p * gathered.masked_fill(~inside, 0.0)).sum(-1)
    hard_ok = batch["hard"] >= 0
    hard = -logp.gather(1, batch["hard"].clamp(min=0)[:, None])[:, 0]
    loss = (soft_weight * (soft * soft_ok).sum() / soft_ok.sum().clamp(min=1)
            + (1 - soft_weight) * (hard * hard_ok).sum() / hard_ok.sum().clamp(min=1))
    agree = (logits.argmax(-1) == batch["hard"]).float().mean()
    return loss, float(agree)


def _hidden_rows(draft, batch):
    out = draft.model(input_ids=batch["ids"], attention_mask=batch["attn"])
    h = out.last_hidden_state
    return h[batch["rows_b"], batch["rows_t"]]


def evaluate_agreement(draft, examples, out_weight, vocab_index, batch_size=16) -> float:
    """Top-1 agreement with the target's greedy token on `examples` (output rows `out_weight`)."""
    draft.eval()
    hit = tot = 0
    with torch.no_grad():
        for i in range(0, len(examples), batch_size):
            b = _batch(examples[i: i + batch_size], vocab_index)
            logits = _hidden_rows(draft, b) @ out_weight.T
            hit += int((logits.argmax(-1) == b["hard"]).sum())
            tot += len(b["hard"])
    draft.train()
    return hit / max(1, tot)


def train_draft(draft, train_ex: list[dict], held_ex: list[dict], subset: torch.Tensor, *, deadline: float,
                max_steps: int | None = None, batch_size: int = 16, lr: float = 3e-3, train_head: bool = False,
                soft_weight: float = 0.5, bf16: bool = True, progress=print) -> dict:
    """Train `draft` (decoder layers + final norm; the kept output rows too when `train_head`) on the
    teacher examples until `deadline` (a time.time() value), at least one step, or for `max_steps` steps when
    given (then the learning-rate decay follows steps, not time: the same run on any machine). The input
    embedding stays frozen.
    With `bf16` the forward runs under CPU autocast (bf16 matmuls; fp32 weights, optimizer state
    and log-softmax of the loss): about 1.5x the steps/s of fp32 on this project's CPU (native bf16).
    With `train_head` the draft is untied at the end (its own output layer, see `untie_output`).
    Returns the figures: steps, epochs, scored tokens, held-out agreement before/after."""
    vocab = draft.get_input_embeddings().weight.shape[0]
    vocab_index = torch.full((vocab + 1,), -1, dtype=torch.long)
    vocab_index[subset] = torch.arange(len(subset))
    emb = draft.get_input_embeddings().weight
    emb.requires_grad_(False)
    head = torch.nn.Parameter(emb.detach()[subset].clone()) if train_head else None
    fixed = None if train_head else emb.detach()[subset]       # frozen: gathered once, not every step
    W_sub = (lambda: head) if train_head else (lambda: fixed)
    params = [p for p in draft.parameters() if p.requires_grad] + ([head] if train_head else [])
    n_train = sum(p.numel() for p in params)
    progress(f"[bootstrap] draft: {draft.config.num_hidden_layers} layers, "
             f"{sum(p.numel() for p in draft.parameters()) / 1e6:.1f}M params ({n_train / 1e6:.1f}M trained"
             f"{', own output rows' if train_head else ''}), output vocabulary {len(subset)} of {vocab}")
    before = evaluate_agreement(draft, held_ex, W_sub(), vocab_index)
    progress(f"[bootstrap] held-out top-1 agreement before training: {before:.3f}")

    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    # 20 warm-up steps, then linear decay to 0.1x by the deadline (by time: steps/s varies with the machine)
    # or by max_steps
    t_begin, span = time.time(), max(1e-6, deadline - time.time())
    done = (lambda s: s / max_steps) if max_steps else (lambda s: (time.time() - t_begin) / span)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - done(s)))
    finished = (lambda: step >= max_steps) if max_steps else (lambda: time.time() >= deadline)
    draft.train()
    step, tokens, epoch = 0, 0, 0
    t_train = time.time()
    # group by length for less padding; shuffle the groups
    by_len = sorted(train_ex, key=lambda e: len(e["tokens"]))
    batches = [by_len[i: i + batch_size] for i in range(0, len(by_len), batch_size)]
    while batches and (step == 0 or not finished()):
        random.shuffle(batches)
        for group in batches:
            if step > 0 and finished():
                break
            b = _batch(group, vocab_index)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                hidden = _hidden_rows(draft, b)
                loss, agree = distill_loss(hidden, W_sub(), b, soft_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            tokens += len(b["hard"])
            if step % 20 == 0:
                el = time.time() - t_train
                progress(f"[bootstrap] epoch {epoch} step {step} loss {loss.item():.3f} train-agree {agree:.3f} "
                         f"{tokens / el:.0f} scored tok/s, {deadline - time.time():.0f} s left")
        epoch += 1
    draft.eval()
    after = evaluate_agreement(draft, held_ex, W_sub(), vocab_index)
    progress(f"[bootstrap] held-out top-1 agreement after {step} steps ({epoch} epochs): {after:.3f}")
    if train_head:
        untie_output(draft, subset, head)
    return {"train_steps": step, "epochs": epoch, "train_scored_tokens": tokens,
            "train_seconds": round(time.time() - t_train, 1), "train_head": train_head,
            "heldout_top1_agreement_before": before, "heldout_top1_agreement_after": after}


# Seed words for self-synthesised requests: generic openings of a user turn ("" = the bare turn, Magpie's
# original form, weighted up). They steer the mix towards writing, explanations, how-to and code without
# naming any topic; the target writes the rest.
MAGPIE_SEEDS = ["", "", "", "", "", "", "Write", "Write a", "Write a Python function", "How do I", "How can I",
                "Explain", "What is", "What are", "Can you", "Could you", "Tell me", "Give me", "Why", "I need",
                "Summarize", "Describe", "Help me", "Create", "List", "Compare", "Rewrite", "Fix", "Is it",
                "Suggest", "In Python,", "Draft an email", "Write a short story"]
FOLLOW_UP_SEEDS = ["", "", "", "Can you", "What about", "Thanks", "Why", "How", "Could you", "And"]
# Packaged prompts per self-synthesised one in the general mix (capped by what each source has).
GENERAL_MIX = {"gsm8k": 0.35, "humaneval": 0.25, "gpqa": 0.1, "aime": 0.05}
HELDOUT_PER_SOURCE = 6
MAX_PROMPT_TOKENS = 400


RESERVE_PROMPTS = 2000


def reserve_prompts(rest: dict[str, list[str]], shares: dict[str, float], limit: int) -> list[tuple[str, str]]:
    """(text, source) of the packaged prompts the mix left unused, interleaved in rounds by `shares` (per round of
    20: 7 gsm8k, 5 humaneval, 2 gpqa, 1 aime with GENERAL_MIX), at most `limit`. The mix is sized by how many chat
    prompts the target synthesised; where that is slow (an AVX2-only host synthesised 84 of 640 and answered the
    whole mix of 125 prompts by 70% of its time), the teacher goes on with these instead of idling."""
    pools = {s: list(texts) for s, texts in rest.items()}
    out: list[tuple[str, str]] = []
    while len(out) < limit and any(pools.values()):
        for source, share in shares.items():
            take = max(1, round(share * 20))
            pool = pools.get(source) or []
            out += [(t, source) for t in pool[:take]]
            pools[source] = pool[take:]
    return out[:limit]


def _general_teacher_data(target, tok, *, teacher_s: float, t_start: float, max_new_tokens: int,
                          synth_prompts: int, progress) -> tuple[list[dict], list[dict]]:
    """Teacher data for broad traffic within `teacher_s` seconds (phases by share of that time):
    ~20% self-synthesised user requests; held-out examples per category; ~68% answers to a shuffled mix of
    synthesised and packaged prompts (maths, science, code), then, if time is left, the packaged prompts the
    mix did not use (`reserve_prompts`); the rest multi-turn: follow-up requests the
    target writes for finished conversations, and their answers. Every example carries its "source"."""
    from training.prompts import chat_prompt_ids, load_prompts
    from training.teacher import synthesize_prompts

    def ids_of(messages):
        return [int(i) for i in tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False)]

    def short(pairs):   # a batch is padded to its longest prompt: one 3,000-token GPQA prompt stalls 63 others
        return [(p, s) for p, s in pairs if len(p) <= MAX_PROMPT_TOKENS]

    synth = synthesize_prompts(target, tok, synth_prompts, seeds=MAGPIE_SEEDS, max_new_tokens=40,
                               deadline=t_start + 0.2 * teacher_s, progress=progress)
    random.shuffle(synth)
    held = [(ids_of(m), "chat") for _, m in synth[:2 * HELDOUT_PER_SOURCE]]
    train = [(ids_of(m), "chat") for _, m in synth[2 * HELDOUT_PER_SOURCE:]]
    n_chat = len(train)
    rest = {}
    for source, share in GENERAL_MIX.items():
        texts = load_prompts(source, "train")
        random.shuffle(texts)
        used = max(1, round(share * n_chat))
        train += short([(chat_prompt_ids(tok, t), source) for t in texts[:used]])
        rest[source] = texts[used:]
        if source != "aime":
            held += short([(chat_prompt_ids(tok, t), source)
                           for t in load_prompts(source, "heldout", HELDOUT_PER_SOURCE)])
    random.shuffle(train)
    reserve = short([(chat_prompt_ids(tok, t), s) for t, s in reserve_prompts(rest, GENERAL_MIX, RESERVE_PROMPTS)])
    progress(f"[bootstrap] prompts: {len(train)} train, {len(held)} held-out "
             f"({', '.join(f'{s} {sum(1 for _, x in train if x == s)}' for s in ['chat', *GENERAL_MIX])}); "
             f"{len(reserve)} packaged prompts in reserve")
    train += reserve        # answered after the mix, only while the teacher's time lasts
    hidden = records_final_states(target)     # the Medusa heads' rows, kept from the generation itself
    held_ex = generate_teacher_data(target, tok, [p for p, _ in held], sources=[s for _, s in held],
                                    max_new_tokens=max_new_tokens, batch_size=16, hidden=hidden, progress=progress)
    train_ex = generate_teacher_data(target, tok, [p for p, _ in train], sources=[s for _, s in train],
                                     max_new_tokens=max_new_tokens, deadline=t_start + 0.88 * teacher_s,
                                     sort_window=128, hidden=hidden, progress=progress)
    # multi-turn: conversations from finished chat examples, a follow-up request, its answer
    history = []
    for e in train_ex:
        if e["source"] == "chat" and len(history) < 128:
            p = e["prompt_len"]
            conv = [m for m in _user_turns(tok, e["tokens"][:p])]
            answer = tok.decode(e["tokens"][p:], skip_special_tokens=True).strip()
            if conv and answer:
                history.append(conv + [{"role": "assistant", "content": answer}])
    follow_deadline = follow_up_deadline(time.time(), t_start, teacher_s)
    if history and follow_deadline is not None:
        follow = synthesize_prompts(target, tok, len(history), seeds=FOLLOW_UP_SEEDS, max_new_tokens=32,
                                    history=history, deadline=follow_deadline, seed=1, progress=progress)
        multi = [p for p in (ids_of(m) for _, m in follow) if len(p) <= MAX_PROMPT_TOKENS]
        train_ex += generate_teacher_data(target, tok, multi, sources=["multiturn"] * len(multi),
                                          max_new_tokens=max_new_tokens, deadline=t_start + teacher_s,
                                          hidden=hidden, progress=progress)
    return train_ex, held_ex


FOLLOW_UP_MIN_S = 20.0   # one batch of 64 follow-up requests x 32 tokens: ~16 s on 2 cores (fewer close their turn)


def follow_up_deadline(now: float, t_start: float, teacher_s: float) -> float | None:
    """When the multi-turn follow-up requests must be written by: 92% of the teacher's time, but at least
    FOLLOW_UP_MIN_S from now, as long as that leaves the teacher's time unspent; None when it would not. The
    answer phase before it overruns its 88% by up to a batch (a batch runs at least MIN_BATCH_S, plus its
    prefill), and a follow-up batch cut to a few seconds closes no turn: one bootstrap got 0 follow-ups of 64
    sampled and no multi-turn data at all (docs/benchmarks.md, "The fourteenth session")."""
    end = t_start + teacher_s
    deadline = max(t_start + 0.92 * teacher_s, now + FOLLOW_UP_MIN_S)
    return deadline if deadline < end else None


def _user_turns(tok, prompt_ids: list[int]) -> list[dict]:
    """The user message(s) of a one-turn chat prompt, recovered from its text (for multi-turn history)."""
    text = tok.decode(prompt_ids, skip_special_tokens=False)
    marker = "<|im_start|>user\n"
    if marker not in text:
        return []
    body = text.split(marker, 1)[1].split("<|im_end|>", 1)[0].strip()
    return [{"role": "user", "content": body}] if body else []


def choose_output_vocabulary(examples: list[dict], tok, size: int) -> tuple[torch.Tensor, list[int]]:
    """The kept output rows from the target's own token statistics on the teacher data (its top-k
    probability mass per token, training/vocab.py), the special tokens always; and the full ranking
    (token ids by mass, descending) so a benchmark can re-cut the size without retraining."""
    from training.vocab import choose_vocabulary, token_mass

    vocab = len(tok)
    mass = np.zeros(vocab)
    for e in examples:
        mass += token_mass(e["topk_ids"], e["topk_logprobs"], vocab)
    keep = choose_vocabulary(mass, size, always=tok.all_special_ids)
    ranking = [int(i) for i in np.argsort(-mass, kind="stable") if mass[i] > 0]
    return torch.tensor(keep, dtype=torch.long), ranking


def per_source_agreement(draft, examples, subset: torch.Tensor) -> dict[str, float]:
    """Held-out top-1 agreement per example source (category)."""
    vocab = draft.get_input_embeddings().weight.shape[0]
    vocab_index = torch.full((vocab + 1,), -1, dtype=torch.long)
    vocab_index[subset] = torch.arange(len(subset))
    out_w = draft.get_output_embeddings().weight.detach()[subset]
    out = {}
    for src in sorted({e.get("source", "") for e in examples}):
        out[src or "unlabelled"] = round(evaluate_agreement(
            draft, [e for e in examples if e.get("source", "") == src], out_w, vocab_index), 4)
    return out


def bootstrap(out_dir: str | Path, target_path: str | Path | None = None, *, budget_s: float = 840,
              teacher_share: float = 0.75, layers: list[int] | None = None, num_layers: int = 2,
              batch_size: int = 16, lr: float = 3e-3, train_head: bool = False, bf16: bool | None = None,
              prompts_source: str = "general", max_new_tokens: int = 128, heldout: int = 40,
              vocab_size: int | None = None, synth_prompts: int = 640,
              teacher_cache: str | Path | None = None, seed: int = 0, progress=print) -> Path:
    """Build the default draft into `out_dir` within about `budget_s` seconds; return the folder.

    prompts_source "general" (the default): broad traffic (`_general_teacher_data`); a packaged source name
    (training/prompts.py, e.g. "gsm8k") uses that source alone, `heldout` held-out prompts of it."""
    from serving.models import (cpu_has_fast_bf16, default_dtype, ensure_default_target, load_causal_lm,
                                load_tokenizer, resolve_model_path)
    from training.prompts import chat_prompt_ids, load_prompts
    from training.vocab import DEFAULT_VOCAB_SIZE

    t_start = time.time()
    random.seed(seed)
    torch.manual_seed(seed)
    out_dir = Path(out_dir)
    tpath = resolve_model_path(target_path) if target_path else ensure_default_target()
    tok = load_tokenizer(tpath)
    bf16 = cpu_has_fast_bf16() if bf16 is None else bf16
    target = load_causal_lm(tpath, "cpu", default_dtype("cpu"))
    progress(f"[bootstrap] target {tpath} loaded ({default_dtype('cpu')}); budget {budget_s:.0f} s, "
             f"prompts {prompts_source}, training {'bf16 autocast' if bf16 else 'fp32'}")

    # 1. teacher data (re-used from `teacher_cache` when both its files exist)
    cache = Path(teacher_cache) if teacher_cache else None
    held_cache = cache.with_suffix(".heldout.safetensors") if cache else None
    if cache is not None and cache.exists() and held_cache.exists():
        train_ex, held_ex = load_examples(cache), load_examples(held_cache)
        progress(f"[bootstrap] {len(train_ex)} + {len(held_ex)} teacher examples from {cache}")
    else:
        if prompts_source == "general":
            train_ex, held_ex = _general_teacher_data(
                target, tok, teacher_s=budget_s * teacher_share, t_start=t_start,
                max_new_tokens=max_new_tokens, synth_prompts=synth_prompts, progress=progress)
        else:
            prompts = [chat_prompt_ids(tok, t) for t in load_prompts(prompts_source, "train")]
            random.shuffle(prompts)
            held = [chat_prompt_ids(tok, t) for t in load_prompts(prompts_source, "heldout", heldout)]
            held_ex = generate_teacher_data(target, tok, held, max_new_tokens=max_new_tokens,
                                            sources=[prompts_source] * len(held), progress=progress)
            train_ex = generate_teacher_data(target, tok, prompts, max_new_tokens=max_new_tokens,
                                             sources=[prompts_source] * len(prompts),
                                             deadline=t_start + budget_s * teacher_share, progress=progress)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            save_examples(train_ex, cache)
            save_examples(held_ex, held_cache)
    del target
    if not train_ex:
        raise RuntimeError(f"no teacher data was generated within the {budget_s:.0f} s budget; give a larger "
                           "--budget (the default 14m fits a 2-core CPU)")
    n_tokens = sum(len(e["topk_ids"]) for e in train_ex)
    by_src = {}
    for e in train_ex:
        by_src[e.get("source", "")] = by_src.get(e.get("source", ""), 0) + len(e["topk_ids"])
    mix = ", ".join(f"{k or 'unlabelled'} {v}" for k, v in sorted(by_src.items()))
    progress(f"[bootstrap] teacher data: {len(train_ex)} examples, {n_tokens} answer tokens ({mix}) after "
             f"{time.time() - t_start:.0f} s")

    # 2. draft architecture + kept vocabulary (from the target's token statistics on the teacher data)
    target = load_causal_lm(tpath, "cpu", torch.float32)
    draft = make_draft_from_target(target, num_layers, layers)
    del target
    subset, ranking = choose_output_vocabulary(train_ex, tok, vocab_size or DEFAULT_VOCAB_SIZE)

    # 3. train until the budget (minus a margin for evaluation and saving)
    figures = train_draft(draft, train_ex, held_ex, subset, deadline=t_start + budget_s - min(60.0, 0.1 * budget_s),
                          batch_size=batch_size, lr=lr, train_head=train_head, bf16=bf16, progress=progress)
    figures["heldout_top1_agreement_by_source"] = per_source_agreement(draft, held_ex, subset)
    progress(f"[bootstrap] held-out agreement by category: {figures['heldout_top1_agreement_by_source']}")

    # 4. save a plain HF folder + the kept output rows
    out_dir.mkdir(parents=True, exist_ok=True)
    draft.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    meta = {
        "output_token_ids": subset.tolist(),
        "vocab_ranking": ranking[:32768],
        "built_by": "training.draft_builder.bootstrap",
        "target": str(tpath), "layers_from_target": layers or list(range(num_layers)),
        "prompts_source": prompts_source, "teacher_examples": len(train_ex), "heldout_examples": len(held_ex),
        "teacher_tokens": n_tokens, "teacher_tokens_by_source": by_src,
        **figures, "seconds": round(time.time() - t_start, 1),
    }
    (out_dir / "draftsmith.json").write_text(json.dumps(meta))
    progress(f"[bootstrap] wrote {out_dir} in {time.time() - t_start:.0f} s")
    return out_dir
