"""Train Medusa heads (serving/decoding/medusa.py) from the bootstrap's teacher data (issue 19, steps 1 and 3).

The heads read the target's last hidden state, which the teacher data does not store. Measured choice for
the bootstrap: recompute it with ONE teacher-forced target pass over each stored sequence (prompt +
answer) and keep it in memory for the whole training ([answer tokens, d] fp32: about 140 MB for 60k
tokens), so training itself never runs the target again and makes many passes over the data cheaply.
The target's opinion of each position comes from the same stored top-20 log-probabilities the standalone
draft learns from, so the loss is training/draft_builder.py's `distill_loss` (0.5 soft cross-entropy
against the renormalised top-20 + 0.5 hard cross-entropy on the target's greedy token, over the kept
vocabulary), averaged over heads with Medusa's decaying weights (0.8^(k-1)).

Rows. For an example with prompt length P and A answer tokens, hidden state h_t at position t and the
committed token x_{t+1}: head k's label is answer token j = t + k - (P - 1) (the token at position
t + k + 1, distribution = the teacher's top-20 at answer index j). Rows run from t = P - 2 (h of the
prompt's second-to-last token: what decoding has right after the prefill) while head 1's label exists.

    .venv/bin/python -m training.heads --out data/medusa-heads            # teacher data of the bootstrap
"""
from __future__ import annotations

import argparse
import logging
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as nn_f

from serving.decoding.medusa import HeadsConfig, MedusaHeads
from training.draft_builder import distill_loss

HEAD_DECAY = 0.8


def kept_index(target, ids) -> torch.Tensor:
    """Token id -> its column in the kept vocabulary `ids`, -1 for every other token (and one extra cell)."""
    vocab = target.get_output_embeddings().weight.shape[0]
    index = torch.full((vocab + 1,), -1, dtype=torch.long)
    index[torch.as_tensor(ids, dtype=torch.long)] = torch.arange(len(ids))
    return index


def target_hidden_states(target, examples: list[dict], *, batch_size: int = 16, select=None, cache=None,
                         progress=print) -> list[torch.Tensor]:
    """Per example, the target's last hidden states (fp32 [len(tokens), d]) from one teacher-forced pass per
    batch (right-padded), or `select(example, states)` of them. With `cache` (training/hidden_cache.py) a
    sequence whose states are stored is read instead of recomputed, and the computed ones are stored."""
    out: list[torch.Tensor | None] = [None] * len(examples)
    todo = []
    for i, e in enumerate(examples):
        h = cache.get(e["tokens"]) if cache is not None else None
        if h is None:
            todo.append(i)
        else:
            out[i] = h.float() if select is None else select(e, h.float())
    order = sorted(todo, key=lambda i: len(examples[i]["tokens"]))
    decoder = target.get_decoder()
    device = next(target.parameters()).device
    t0 = time.time()
    done_tokens = 0
    cached = f" ({len(examples) - len(todo)} of {len(examples)} read from the cache)" if cache is not None else ""
    for s in range(0, len(order), batch_size):
        idx = order[s: s + batch_size]
        L = max(len(examples[i]["tokens"]) for i in idx)
        ids = torch.zeros(len(idx), L, dtype=torch.long)
        attn = torch.zeros(len(idx), L, dtype=torch.long)
        for b, i in enumerate(idx):
            n = len(examples[i]["tokens"])
            ids[b, :n] = torch.tensor(examples[i]["tokens"])
            attn[b, :n] = 1
        with torch.no_grad():
            h = decoder(input_ids=ids.to(device), attention_mask=attn.to(device)).last_hidden_state.cpu()
        for b, i in enumerate(idx):
            raw = h[b, : len(examples[i]["tokens"])]
            if cache is not None:
                cache.put(examples[i]["tokens"], raw.clone())
            states = raw.float().clone()
            out[i] = states if select is None else select(examples[i], states)
            done_tokens += len(examples[i]["tokens"])
        if (s // batch_size) % 20 == 0:
            progress(f"[heads] target hidden states: {min(s + batch_size, len(order))}/{len(order)} sequences "
                     f"computed{cached}, {done_tokens / max(1e-9, time.time() - t0):.0f} tokens/s")
    if not order and cache is not None:
        progress(f"[heads] target hidden states: all {len(examples)} sequences read from the cache")
    return out  # type: ignore[return-value]


def _medusa_rows(e: dict, states: torch.Tensor) -> torch.Tensor:
    """Rows P - 2 .. P + A - 2 of an example's states ([A + 1, d]; the first is zeros when P < 2)."""
    P, A = e["prompt_len"], len(e["topk_ids"])
    rows = torch.zeros(A + 1, states.shape[-1])
    lo = P - 2
    src = states[max(lo, 0): P + A - 1]
    rows[max(0, -lo):] = src
    return rows


def target_hidden_rows(target, examples: list[dict], *, batch_size: int = 16, cache=None,
                       progress=print) -> list[torch.Tensor]:
    """Per example, the target's last hidden states at positions P - 2 .. P + A - 2 (fp32 [A + 1, d], the
    first row is missing (zeros) when P < 2): the Medusa heads' rows. `cache` as `target_hidden_states`."""
    return target_hidden_states(target, examples, batch_size=batch_size, select=_medusa_rows, cache=cache,
                                progress=progress)


class HeadData:
    """Flat training rows for K heads: hidden state, committed token, and per head the label index into the
    concatenated answer arrays (-1 where the sequence has ended)."""

    def __init__(self, examples: list[dict], hidden: list[torch.Tensor], num_heads: int, vocab_index: torch.Tensor):
        hs, roots, labels = [], [], []
        tk_ids, tk_lp, hard = [], [], []
        offset = 0
        for e, H in zip(examples, hidden):
            P, A = e["prompt_len"], len(e["topk_ids"])
            toks = e["tokens"]
            first = 0 if P >= 2 else 1                       # row r = position P - 2 + r
            r = np.arange(first, A)                          # head 1's label (answer index r) exists
            hs.append(H[r])
            roots.append(torch.tensor([toks[P - 1 + int(i)] for i in r], dtype=torch.long))
            lab = np.stack([r + k for k in range(num_heads)], axis=1)            # answer index per head
            lab = np.where(lab < A, lab + offset, -1)
            labels.append(torch.as_tensor(lab, dtype=torch.long))
            tk_ids.append(torch.as_tensor(e["topk_ids"], dtype=torch.long))
            tk_lp.append(torch.as_tensor(np.asarray(e["topk_logprobs"], dtype=np.float32)))
            # the target's greedy token: the committed one in teacher data (greedy answers); buffer examples
            # (training/heads_job.py) carry it as "hard", since a sampled answer may differ from it
            hard.append(torch.as_tensor(np.asarray(e["hard"] if "hard" in e else toks[P: P + A]), dtype=torch.long))
            offset += A
        self.h = torch.cat(hs)
        self.root = torch.cat(roots)
        self.labels = torch.cat(labels)                                         # [R, K]
        self.topk = vocab_index[torch.cat(tk_ids)]
        self.topk_lp = torch.cat(tk_lp)
        self.hard = vocab_index[torch.cat(hard)]

    def __len__(self) -> int:
        return len(self.h)

    def head_batch(self, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, dict]:
        """Rows of `rows` with a label for head k (0-based) and distill_loss's batch for them."""
        lab = self.labels[rows, k]
        ok = lab >= 0
        lab = lab[ok]
        return ok, {"topk": self.topk[lab], "topk_lp": self.topk_lp[lab], "hard": self.hard[lab]}


def head_agreement(heads: MedusaHeads, data: HeadData, batch: int = 2048) -> list[float]:
    """Per head, top-1 agreement with the target's greedy token (= its T=0 acceptance given the earlier
    depths were right)."""
    heads.eval()
    K = heads.config.num_heads
    hit, tot = [0] * K, [0] * K
    with torch.no_grad():
        for s in range(0, len(data), batch):
            rows = torch.arange(s, min(s + batch, len(data)))
            logits = heads(data.h[rows], data.root[rows])
            for k in range(K):
                ok, b = data.head_batch(rows, k)
                hit[k] += int((logits[k][ok].argmax(-1) == b["hard"]).sum())
                tot[k] += int(ok.sum())
    heads.train()
    return [round(h / max(1, t), 4) for h, t in zip(hit, tot)]


def chain_acceptance(heads: MedusaHeads, data: HeadData, batch: int = 2048) -> list[float]:
    """Share of rows where heads 1..k are ALL right (k = 1..K): the chance a greedy chain of depth k is
    accepted whole; their sum is the expected accepted tokens per step of a chain (width 1)."""
    heads.eval()
    K = heads.config.num_heads
    counts = [0] * K
    n = 0
    with torch.no_grad():
        for s in range(0, len(data), batch):
            rows = torch.arange(s, min(s + batch, len(data)))
            logits = heads(data.h[rows], data.root[rows])
            alive = torch.ones(len(rows), dtype=torch.bool)
            for k in range(K):
                lab = data.labels[rows, k]
                right = torch.zeros(len(rows), dtype=torch.bool)
                ok = lab >= 0
                right[ok] = logits[k][ok].argmax(-1) == data.hard[lab[ok]]
                alive &= right
                counts[k] += int(alive.sum())
            n += len(rows)
    heads.train()
    return [round(c / max(1, n), 4) for c in counts]


class BestEpoch:
    """Keeps the weights of the epoch with the best held-out score (restored at the end of training), and
    says when training has stopped paying: `converged` once `patience` epochs in a row have not beaten the
    best score by more than `min_gain` (never with patience None)."""

    def __init__(self, patience: int | None = None, min_gain: float = 0.0) -> None:
        if patience is not None and (isinstance(patience, bool) or not isinstance(patience, int) or patience < 1):
            raise ValueError(f"patience must be an integer >= 1 or None, got {patience!r}")
        if not min_gain >= 0:
            raise ValueError(f"min_gain must be >= 0, got {min_gain!r}")
        self.score, self.epoch, self.state = -1.0, 0, None
        self.patience, self.min_gain, self.stale = patience, float(min_gain), 0

    def update(self, score: float, epoch: int, module: torch.nn.Module) -> bool:
        self.stale = 0 if score > self.score + self.min_gain else self.stale + 1
        if score <= self.score:
            return False
        self.score, self.epoch = score, epoch
        self.state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        return True

    @property
    def converged(self) -> bool:
        return self.patience is not None and self.stale >= self.patience

    def restore(self, module: torch.nn.Module) -> None:
        if self.state is not None:
            module.load_state_dict(self.state)


def _optimizer_step(opt, loss, params, clip: float | None = None) -> None:
    opt.zero_grad()
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()


def train_heads(heads: MedusaHeads, train: HeadData, held: HeadData, *, deadline: float, batch_size: int = 256,
                lr: float = 1e-3, max_epochs: int = 50, patience: int | None = None, min_gain: float = 0.0,
                progress=print) -> dict:
    """AdamW on the heads' own weights until `deadline` (time.time()) or `max_epochs`; the heads end with the
    weights of the epoch of best held-out agreement (weighted like the loss): the first run on the bootstrap's
    data peaked at epoch 4 of 14 (head 1: 0.445, then 0.439-0.44 while the training loss kept falling).
    With `patience`, training also stops once that many epochs in a row gained no more than `min_gain` of the
    weighted held-out agreement (`BestEpoch.converged`; an online job's default, training/heads_job.py)."""
    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    K = heads.config.num_heads
    weights = [HEAD_DECAY ** k for k in range(K)]
    steps = 0
    t0 = time.time()
    epoch = 0
    best = BestEpoch(patience, min_gain)
    heads.train()
    while epoch < max_epochs and time.time() < deadline:
        perm = torch.randperm(len(train))
        for s in range(0, len(perm), batch_size):
            rows = perm[s: s + batch_size]
            states = heads.head_states(train.h[rows], train.root[rows])
            loss = 0.0
            for k in range(K):
                ok, b = train.head_batch(rows, k)
                if int(ok.sum()) == 0:
                    continue
                lk, _ = distill_loss(states[k][ok], heads.out_rows, b)
                loss = loss + weights[k] * lk
            _optimizer_step(opt, loss, params)
            steps += 1
            if steps % 200 == 0:
                progress(f"[heads] epoch {epoch} step {steps}: loss {float(loss.detach()) / sum(weights):.3f}, "
                         f"{steps / (time.time() - t0):.1f} steps/s")
            if time.time() >= deadline:
                break
        epoch += 1
        agree = head_agreement(heads, held)
        improved = best.update(sum(w * a for w, a in zip(weights, agree)) / sum(weights), epoch, heads)
        progress(f"[heads] epoch {epoch} done after {time.time() - t0:.0f} s; held-out agreement per head "
                 f"{agree}{' (best so far)' if improved else ''}")
        if best.converged:
            progress(f"[heads] stopped: {best.stale} epochs without a gain over {min_gain:g} (best: epoch {best.epoch})")
            break
    best.restore(heads)
    return {"steps": steps, "epochs": epoch, "best_epoch": best.epoch, "train_seconds": round(time.time() - t0, 1),
            "converged": best.converged, "train_head_agreement": head_agreement(heads, train),
            "heldout_head_agreement": head_agreement(heads, held),
            "heldout_chain_acceptance": chain_acceptance(heads, held)}


def per_source(heads: MedusaHeads, examples: list[dict], hidden: list[torch.Tensor],
               vocab_index: torch.Tensor) -> dict[str, list[float]]:
    out = {}
    for src in sorted({e.get("source", "") for e in examples}):
        idx = [i for i, e in enumerate(examples) if e.get("source", "") == src]
        data = HeadData([examples[i] for i in idx], [hidden[i] for i in idx], heads.config.num_heads, vocab_index)
        out[src or "unlabelled"] = head_agreement(heads, data)
    return out


def build_heads(target, tok, train_ex: list[dict], held_ex: list[dict], out_dir: str | Path, *,
                num_heads: int = 3, num_layers: int = 1, use_token: bool = True, vocab_size: int | None = None,
                budget_s: float = 300, batch_size: int = 256, lr: float = 1e-3, max_epochs: int = 50,
                seed: int = 0, hidden: tuple[list, list] | None = None, progress=print) -> dict:
    """Heads for `target` trained on teacher examples within about `budget_s` seconds (hidden-state pass
    included unless `hidden` gives them); saved into `out_dir`; returns the figures (also in the json)."""
    from training.draft_builder import choose_output_vocabulary
    from training.vocab import DEFAULT_VOCAB_SIZE

    t_start = time.time()
    random.seed(seed)
    torch.manual_seed(seed)
    if hidden is None and all("medusa_rows" in e for e in train_ex + held_ex):
        # the teacher kept them while it generated (training/teacher.py FinalStates): no second target pass
        hidden = ([torch.from_numpy(e["medusa_rows"]).float() for e in train_ex],
                  [torch.from_numpy(e["medusa_rows"]).float() for e in held_ex])
        progress(f"[heads] hidden states from the teacher data ({sum(len(h) for h in hidden[0])} rows)")
    if hidden is None:
        hidden = (target_hidden_rows(target, train_ex, progress=progress),
                  target_hidden_rows(target, held_ex, progress=progress))
    hid_s = time.time() - t_start
    subset, _ = choose_output_vocabulary(train_ex, tok, vocab_size or DEFAULT_VOCAB_SIZE)
    vocab_index = kept_index(target, subset)
    train = HeadData(train_ex, hidden[0], num_heads, vocab_index)
    held = HeadData(held_ex, hidden[1], num_heads, vocab_index)
    config = HeadsConfig(target.config.hidden_size, num_heads, num_layers, use_token)
    heads = MedusaHeads.for_target(target, config, subset.tolist())
    progress(f"[heads] {len(train)} training rows, {len(held)} held-out rows, {num_heads} heads x {num_layers} "
             f"blocks, use_token={use_token}, vocabulary {len(subset)}; before training: held-out agreement "
             f"{head_agreement(heads, held)}")
    figures = train_heads(heads, train, held, deadline=t_start + budget_s, batch_size=batch_size, lr=lr,
                          max_epochs=max_epochs, progress=progress)
    figures["heldout_head_agreement_by_source"] = per_source(heads, held_ex, hidden[1], vocab_index)
    figures.update(hidden_state_seconds=round(hid_s, 1), seconds=round(time.time() - t_start, 1),
                   training_rows=len(train), heldout_rows=len(held))
    heads.save(out_dir, built_by="training.heads.build_heads", **figures)
    progress(f"[heads] held-out agreement per head {figures['heldout_head_agreement']}, chain acceptance "
             f"{figures['heldout_chain_acceptance']}; wrote {out_dir} in {time.time() - t_start:.0f} s")
    return figures


# ---------------------------------------------------------------------- EAGLE-style head (serving/decoding/eagle.py)
def _eagle_batch(examples: list[dict], feats: list[torch.Tensor], vocab_index: torch.Tensor) -> dict:
    """Inputs (f_t, x_{t+1}) for t = 0..L-2, feature targets f_{t+1}, and token labels where x_{t+2} is answer
    token j = t + 2 - P (the teacher's top-k at j), right-padded."""
    T = max(len(e["tokens"]) for e in examples) - 1
    d = feats[0].shape[-1]
    B = len(examples)
    f_in = torch.zeros(B, T, d)
    f_out = torch.zeros(B, T, d)
    tok = torch.zeros(B, T, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.long)
    rows_b, rows_t, tk_ids, tk_lp, hard = [], [], [], [], []
    for b, (e, f) in enumerate(zip(examples, feats)):
        L, P, A = len(e["tokens"]), e["prompt_len"], len(e["topk_ids"])
        f_in[b, : L - 1] = f[: L - 1]
        f_out[b, : L - 1] = f[1:L]
        tok[b, : L - 1] = torch.tensor(e["tokens"][1:L])
        attn[b, : L - 1] = 1
        j = np.arange(max(0, 2 - P), A)                       # answer indices with t = j + P - 2 >= 0
        rows_b += [b] * len(j)
        rows_t += (j + P - 2).tolist()
        tk_ids.append(torch.as_tensor(e["topk_ids"][j], dtype=torch.long))
        tk_lp.append(torch.as_tensor(np.asarray(e["topk_logprobs"][j], dtype=np.float32)))
        hard.append(torch.tensor([e["tokens"][P + int(i)] for i in j], dtype=torch.long))
    return dict(f_in=f_in, f_out=f_out, tok=tok, attn=attn, rows_b=torch.tensor(rows_b, dtype=torch.long),
                rows_t=torch.tensor(rows_t, dtype=torch.long), topk=vocab_index[torch.cat(tk_ids)],
                topk_lp=torch.cat(tk_lp), hard=vocab_index[torch.cat(hard)])


def eagle_agreement(head, examples, feats, vocab_index, batch_size: int = 16) -> float:
    """Teacher-forced top-1 agreement of the head's first draft token with the target's greedy token."""
    head.eval()
    hit = tot = 0
    with torch.no_grad():
        for s in range(0, len(examples), batch_size):
            b = _eagle_batch(examples[s: s + batch_size], feats[s: s + batch_size], vocab_index)
            states, _ = head(b["f_in"], b["tok"], attention_mask=b["attn"])
            logits = head.logits(states[b["rows_b"], b["rows_t"]])
            hit += int((logits.argmax(-1) == b["hard"]).sum())
            tot += len(b["hard"])
    head.train()
    return round(hit / max(1, tot), 4)


def train_eagle(head, train_ex: list[dict], train_f: list[torch.Tensor], held_ex: list[dict],
                held_f: list[torch.Tensor], vocab_index: torch.Tensor, *, deadline: float, batch_size: int = 8,
                lr: float = 5e-4, feature_weight: float = 1.0, noise: float = 0.1, max_epochs: int = 50,
                patience: int | None = None, min_gain: float = 0.0, tag: str = "eagle", progress=print) -> dict:
    """Train an EagleHead on teacher examples and their target features until `deadline` (a time.time()
    value) or `max_epochs`, at least one batch: loss = distill_loss on the next-next token (answer
    positions) + `feature_weight` * smooth-L1 between predicted and true next features (all positions),
    inputs with uniform noise of +-`noise` x their RMS (EAGLE's augmentation against its own prediction
    errors). Keeps the epoch of best held-out agreement (restored in `head`), stopping early as
    `train_heads` does with `patience`; returns the figures."""
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    before = eagle_agreement(head, held_ex, held_f, vocab_index)
    progress(f"[{tag}] {len(train_ex)} training sequences, {sum(p.numel() for p in params) / 1e6:.1f}M "
             f"parameters, vocabulary {len(head.output_token_ids)}; before training: held-out agreement {before}")
    order = sorted(range(len(train_ex)), key=lambda i: len(train_ex[i]["tokens"]))
    batches = [order[i: i + batch_size] for i in range(0, len(order), batch_size)]   # similar lengths together
    best, steps, epoch = BestEpoch(patience, min_gain), 0, 0
    best.update(before, 0, head)                      # a job that cannot improve keeps what it started from
    t0 = time.time()
    head.train()
    while batches and epoch < max_epochs and (steps == 0 or time.time() < deadline):
        random.shuffle(batches)
        for idx in batches:
            b = _eagle_batch([train_ex[i] for i in idx], [train_f[i] for i in idx], vocab_index)
            f_in = b["f_in"]
            if noise > 0:
                rms = f_in.pow(2).mean(-1, keepdim=True).sqrt()
                f_in = f_in + noise * rms * (2 * torch.rand_like(f_in) - 1)
            states, _ = head(f_in, b["tok"], attention_mask=b["attn"])
            cls, _ = distill_loss(states[b["rows_b"], b["rows_t"]], head.out_rows, b)
            m = b["attn"].bool()
            reg = nn_f.smooth_l1_loss(states[m], b["f_out"][m])
            _optimizer_step(opt, cls + feature_weight * reg, params, clip=1.0)
            steps += 1
            if steps % 50 == 0:
                progress(f"[{tag}] epoch {epoch} step {steps}: token loss {float(cls.detach()):.3f}, feature loss "
                         f"{float(reg.detach()):.4f}, {steps / (time.time() - t0):.2f} steps/s")
            if time.time() >= deadline:
                break
        epoch += 1
        agree = eagle_agreement(head, held_ex, held_f, vocab_index)
        improved = best.update(agree, epoch, head)
        progress(f"[{tag}] epoch {epoch} done after {time.time() - t0:.0f} s; held-out agreement {agree}"
                 f"{' (best so far)' if improved else ''}")
        if best.converged:
            progress(f"[{tag}] stopped: {best.stale} epochs without a gain over {min_gain:g} (best: epoch {best.epoch})")
            break
    best.restore(head)
    head.eval()
    return {"steps": steps, "epochs": epoch, "best_epoch": best.epoch, "converged": best.converged,
            "heldout_agreement_before": before,
            "heldout_agreement": best.score}


def build_eagle(target, tok, train_ex: list[dict], held_ex: list[dict], out_dir: str | Path, *,
                vocab_size: int | None = None, budget_s: float = 300, batch_size: int = 8, lr: float = 5e-4,
                feature_weight: float = 1.0, noise: float = 0.1, max_epochs: int = 50, seed: int = 0,
                progress=print) -> dict:
    """An EAGLE-style head for `target`, trained on teacher examples within about `budget_s` seconds (the
    hidden-state pass included; `train_eagle` for the loss). Saves into `out_dir`; returns the figures."""
    from serving.decoding.eagle import EagleHead
    from training.draft_builder import choose_output_vocabulary
    from training.vocab import DEFAULT_VOCAB_SIZE

    t_start = time.time()
    random.seed(seed)
    torch.manual_seed(seed)
    train_f = target_hidden_states(target, train_ex, progress=progress)
    held_f = target_hidden_states(target, held_ex, progress=progress)
    hid_s = time.time() - t_start
    subset, _ = choose_output_vocabulary(train_ex, tok, vocab_size or DEFAULT_VOCAB_SIZE)
    vocab_index = kept_index(target, subset)
    head = EagleHead.for_target(target, subset.tolist())
    fig = train_eagle(head, train_ex, train_f, held_ex, held_f, vocab_index, deadline=t_start + budget_s,
                      batch_size=batch_size, lr=lr, feature_weight=feature_weight, noise=noise,
                      max_epochs=max_epochs, progress=progress)
    by_src = {}
    for src in sorted({e.get("source", "") for e in held_ex}):
        idx = [i for i, e in enumerate(held_ex) if e.get("source", "") == src]
        by_src[src or "unlabelled"] = eagle_agreement(head, [held_ex[i] for i in idx], [held_f[i] for i in idx],
                                                      vocab_index)
    figures = {"steps": fig["steps"], "epochs": fig["epochs"], "best_epoch": fig["best_epoch"],
               "heldout_agreement": fig["heldout_agreement"],
               "heldout_agreement_by_source": by_src, "hidden_state_seconds": round(hid_s, 1),
               "seconds": round(time.time() - t_start, 1), "training_sequences": len(train_ex),
               "feature_weight": feature_weight, "noise": noise, "lr": lr}
    head.save(out_dir, built_by="training.heads.build_eagle", **figures)
    progress(f"[eagle] held-out agreement {fig['heldout_agreement']} (epoch {fig['best_epoch']}), by category "
             f"{by_src}; wrote {out_dir} in {time.time() - t_start:.0f} s")
    return figures


def main(argv=None) -> int:
    from buffer.paths import data_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="target model folder (default: the served default)")
    ap.add_argument("--teacher", type=Path, default=None,
                    help="teacher data (default: the bootstrap's, <data dir>/bootstrap/teacher.safetensors)")
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default: <data dir>/medusa-heads or <data dir>/eagle-head)")
    ap.add_argument("--kind", choices=("medusa", "eagle"), default="medusa",
                    help="medusa: K heads on the hidden state; eagle: one autoregressive feature-level layer")
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--layers", type=int, default=1, help="residual blocks per head")
    ap.add_argument("--no-token", action="store_true", help="plain Medusa heads (hidden state only)")
    ap.add_argument("--vocab-size", type=int, default=None)
    ap.add_argument("--budget", type=float, default=300, help="seconds, hidden-state pass included")
    ap.add_argument("--lr", type=float, default=None, help="learning rate (default: 1e-3 medusa, 5e-4 eagle)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    if args.threads:
        torch.set_num_threads(args.threads)
    from serving.models import (default_dtype, ensure_default_target, load_causal_lm, load_tokenizer,
                                resolve_model_path)
    from training.teacher import load_examples

    teacher = args.teacher or data_dir() / "bootstrap" / "teacher.safetensors"
    held_file = teacher.with_suffix(".heldout.safetensors")
    if not teacher.is_file() or not held_file.is_file():
        print(f"error: no teacher data at {teacher} (and {held_file.name}); run `draftsmith bootstrap` first, "
              "or pass --teacher", file=sys.stderr)
        return 2
    if args.heads < 1 or args.layers < 1 or not math.isfinite(args.budget) or args.budget <= 0:
        print("error: --heads and --layers must be >= 1 and --budget > 0", file=sys.stderr)
        return 2
    tpath = resolve_model_path(args.target) if args.target else ensure_default_target()
    target = load_causal_lm(tpath, "cpu", default_dtype("cpu"))     # the hidden states serving will see
    if args.kind == "eagle":
        build_eagle(target, load_tokenizer(tpath), load_examples(teacher), load_examples(held_file),
                    args.out or data_dir() / "eagle-head", vocab_size=args.vocab_size, budget_s=args.budget,
                    lr=args.lr or 5e-4)
        return 0
    build_heads(target, load_tokenizer(tpath), load_examples(teacher), load_examples(held_file),
                args.out or data_dir() / "medusa-heads", num_heads=args.heads, num_layers=args.layers,
                use_token=not args.no_token, vocab_size=args.vocab_size, budget_s=args.budget, lr=args.lr or 1e-3)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
