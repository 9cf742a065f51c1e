"""LoRA distillation of a draft on packed replay-buffer units, and offline acceptance.

**Model.** The draft folder is loaded in fp32 with SDPA attention; peft LoRA adapters (rank r,
alpha = 2r by default, no dropout) go on q/k/v/o/gate/up/down projections; embeddings, norms and the
output layer stay frozen. The output layer is applied only to the scored rows and only over the
draft's output vocabulary, exactly as serving computes it (Engine._load_draft / _Runner.feed): the
rows of `draftsmith.json` `output_token_ids` (read by `serving.models.read_output_token_ids`, the one
reader), or the first len(tokenizer) rows when there is none, or the rows a distillation job chose
for its candidate (`Draft(..., output_token_ids=...)`, training/job.py).
A target top-k id outside that vocabulary maps to column -1 (losses put it in the tail cell;
acceptance gives the draft probability 0 there).

**Training.** Units (training/data.py) are grouped into batches of about `batch_tokens` padded tokens
(similar lengths together), right-padded, each with its own tree-attention mask; AdamW on the LoRA
parameters, linear warm-up then linear decay to 10% of `lr`, gradient-norm clipping; one optimizer
step per batch. Throughput counts real (unpadded) packed tokens per second of training time.

**Offline acceptance** on held-out units, per draft position (rows 0..gamma-1; the bonus row is
trained on but not scored): alpha = sum_x min(p(x), q(x)), with
  p = the target's stored top-k log-probs renormalised over the top-k and warped with the record's
      temperature / top_k / top_p (exact for the serving default top_k <= k = 20, since then the
      warped target lives inside its top-k; with top_k = 0 or > k the tail is ignored), and
  q = the draft's distribution over its output vocabulary under the same warp.
Temperature 0 makes both one-hot, so alpha = 1[argmax q == argmax p] (greedy acceptance).
Expected accepted length at gamma = 4, per step, from its own positions:
  E[L] = sum_{i=1..G} prod_{j=1..i} alpha_j,  G = min(4, step gamma),
i.e. the mean number of accepted draft tokens if position j is accepted with probability alpha_j
given the earlier ones (the recorded draft prefix is the context of each position, which is the
context speculative sampling reaches when it accepts that prefix). Reported: the mean of alpha over
positions and the mean of E[L] over steps.

**Acceptance weighting** (`acceptance_weight` s in [0, 1], issue 15's "replay weighted toward
low-acceptance requests"; 0 = off, the default). Before the first optimizer step the parent (the draft with
its fresh, zero-effect adapter, on the job's output vocabulary) is scored on every training row as above
(`row_alphas`, the record's own warp); a request's miss rate m = 1 - its mean alpha over all its scored rows,
including those of steps that drafted nothing (where the controller had given up on the draft, so the
recorded acceptance says nothing). Every row of request i then weighs

    w_i = (1 - s) + s * m_i / mean_j(m_j)         (mean over requests; mean weight 1)

in the loss (training/losses.py `weight`): at s = 1 a request the parent misses twice as often counts twice,
at s = 0 all count alike. Replayed older records are weighted the same way, so a share of old data is
still trained on (against forgetting) but mostly where the parent has lost it. Costs one no-grad pass over
the training window (its seconds, requests and per-source miss rates and weights: `TrainReport.weighting`,
the job's `candidate.json` and its MLflow run).
"""
from __future__ import annotations

import logging
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch

from serving.decoding.warp import warp_logprobs
from serving.models import load_tokenizer, read_output_token_ids
from training.data import Unit
from training.losses import LOSSES, get_loss

log = logging.getLogger(__name__)

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# `TrainConfig.lora_targets`: a named set, or a comma-separated list of these module names
LORA_TARGET_SETS = {"all": LORA_TARGETS, "attention": LORA_TARGETS[:4], "mlp": LORA_TARGETS[4:]}


def lora_target_modules(spec: str) -> list[str]:
    """The LoRA target modules named by `spec` ("all", "attention", "mlp", or e.g. "q_proj,v_proj")."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"lora_targets must be one of {', '.join(LORA_TARGET_SETS)} or a comma-separated "
                         f"list of {', '.join(LORA_TARGETS)}, got {spec!r}")
    if spec in LORA_TARGET_SETS:
        return list(LORA_TARGET_SETS[spec])
    names = [n.strip() for n in spec.split(",") if n.strip()]
    bad = [n for n in names if n not in LORA_TARGETS]
    if bad or not names:
        raise ValueError(f"lora_targets: unknown module(s) {', '.join(bad) or spec!r}; use one of "
                         f"{', '.join(LORA_TARGET_SETS)} or a comma-separated list of {', '.join(LORA_TARGETS)}")
    return names
EAL_GAMMA = 4


@dataclass
class TrainConfig:
    """Distillation hyper-parameters (validated). steps: optimizer steps (None: `epochs` passes over the
    window, but at least `min_steps`: a scheduled job often sees only a few hundred records, a handful of
    batches, and one pass over them barely moves the adapter; the gate rejects an over-fitted result)."""

    loss: str = "jsd"
    beta: float = 0.5
    # 3e-3: on a served buffer (scripts/bench_weighting.py, 10,000 records, 50 steps) held-out offline acceptance
    # rose +0.060 at 1e-3, +0.092 at 3e-3, +0.097 at 6e-3, +0.097 at 1e-3 over 150 steps (3x the job time)
    lr: float = 3e-3
    steps: int | None = None
    epochs: int = 1
    min_steps: int = 50
    # 64: on a served buffer (scripts/bench_weighting.py, 9,000 records) held-out offline acceptance rose +0.077 at
    # rank 64 against +0.064 at 16, for the same job time; online (bench_online.py, 30 min, with replay_ratio 1)
    # +0.124 against +0.093 with rank 16 and no replay (docs/benchmarks.md, "The tenth session")
    lora_r: int = 64
    lora_alpha: float | None = None        # None: 2 * lora_r
    lora_targets: str = "all"              # lora_target_modules(): "all" | "attention" | "mlp" | "q_proj,v_proj"
    batch_tokens: int = 4096
    warmup_steps: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 10
    acceptance_weight: float = 0.0         # module docstring, "Acceptance weighting"

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        get_loss(self.loss, self.beta)     # validates beta for jsd
        if not (isinstance(self.lr, (int, float)) and 0 < self.lr < 1):
            raise ValueError(f"lr must be in (0, 1), got {self.lr!r}")
        for name in ("lora_r", "batch_tokens", "epochs", "log_every", "min_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.steps is not None and (isinstance(self.steps, bool) or not isinstance(self.steps, int)
                                       or self.steps < 1):
            raise ValueError(f"steps must be an integer >= 1 or None, got {self.steps!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if self.lora_alpha is not None and not (self.lora_alpha > 0):
            raise ValueError(f"lora_alpha must be > 0, got {self.lora_alpha!r}")
        if not (self.grad_clip > 0) or self.weight_decay < 0:
            raise ValueError("grad_clip must be > 0 and weight_decay >= 0")
        if isinstance(self.acceptance_weight, bool) or not isinstance(self.acceptance_weight, (int, float)) \
                or not (0.0 <= self.acceptance_weight <= 1.0):
            raise ValueError(f"acceptance_weight must be a number in [0, 1] (0: off), got {self.acceptance_weight!r}")
        lora_target_modules(self.lora_targets)


# ----------------------------------------------------------------------------- the draft
@dataclass
class Batch:
    input_ids: torch.Tensor        # [B, L] long
    position_ids: torch.Tensor     # [B, L] long
    attention_mask: torch.Tensor   # [B, 1, L, L] bool, True = attend
    row_b: torch.Tensor            # [R] long
    row_t: torch.Tensor            # [R] long
    target_cols: torch.Tensor      # [R, k] long: draft-vocabulary column, -1 outside it
    target_logprobs: torch.Tensor  # [R, k] float32
    tokens: int                    # real (unpadded) tokens
    units: list[Unit] = field(default_factory=list)


class Draft:
    """A draft folder ready for LoRA training (`lora_r` set), or for evaluation only (`lora_r=None`),
    optionally with a trained adapter folder applied (`adapter`, frozen).

    Output vocabulary: `output_token_ids` (a distillation job's newly chosen rows) when given, else the
    folder's own, read by `serving.models.read_output_token_ids` exactly as the engine reads it (None
    there: the first min(len(tokenizer), output rows) ids). `set_output_token_ids` switches it later
    (the job measures the parent's rows "before", then trains and measures on the new ones)."""

    def __init__(self, folder: str | Path, *, lora_r: int | None = 16, lora_alpha: float | None = None,
                 adapter: str | Path | None = None, output_token_ids: Iterable[int] | None = None,
                 lora_targets: str = "all") -> None:
        from transformers import AutoModelForCausalLM

        self.folder = Path(folder)
        base = AutoModelForCausalLM.from_pretrained(self.folder, dtype=torch.float32, attn_implementation="sdpa")
        self.tokenizer = load_tokenizer(self.folder)
        self._head = base.get_output_embeddings()                             # frozen (never a LoRA target)
        self.full_vocab_size = min(len(self.tokenizer), self._head.weight.shape[0])   # ids the draft could emit
        self.set_output_token_ids(read_output_token_ids(self.folder) if output_token_ids is None
                                  else output_token_ids)
        if adapter is not None and lora_r is not None:
            raise ValueError("pass either lora_r (train a new adapter) or adapter (evaluate a trained one)")
        if adapter is not None:
            from peft import PeftModel

            self.model = PeftModel.from_pretrained(base, str(adapter), is_trainable=False)
        elif lora_r is not None:
            from peft import LoraConfig, get_peft_model

            cfg = LoraConfig(r=lora_r, lora_alpha=lora_alpha or 2 * lora_r, lora_dropout=0.0, bias="none",
                             target_modules=lora_target_modules(lora_targets))
            self.model = get_peft_model(base, cfg)
        else:
            self.model = base
            for p in base.parameters():
                p.requires_grad_(False)
        self.decoder = base.get_decoder()
        self.model.eval()

    def set_output_token_ids(self, ids: Iterable[int] | None) -> None:
        """Compute the output layer over rows `ids` (in this order; None: the full vocabulary)."""
        rows_total = self._head.weight.shape[0]
        if ids is None:
            rows = torch.arange(self.full_vocab_size)
        else:
            rows = torch.as_tensor([int(i) for i in ids], dtype=torch.long)
            if rows.numel() == 0:
                raise ValueError(f"{self.folder}: empty output vocabulary")
            if int(rows.min()) < 0:
                raise ValueError(f"{self.folder}: output_token_ids hold a negative id {int(rows.min())}")
            if int(rows.max()) >= rows_total:
                raise ValueError(f"{self.folder}: output_token_ids reach {int(rows.max())}, beyond the "
                                 f"{rows_total} rows of its output layer")
            if len(torch.unique(rows)) != len(rows):
                raise ValueError(f"{self.folder}: output_token_ids list a token id twice")
        self.out_rows = rows                                                           # [V_out]
        self.head_weight = self._head.weight.detach()[rows].clone()                    # [V_out, H], frozen
        bias = getattr(self._head, "bias", None)
        self.head_bias = bias.detach()[rows].clone() if bias is not None else None
        self.vocab_index = torch.full((max(len(self.tokenizer), int(rows.max()) + 1),), -1, dtype=torch.long)
        self.vocab_index[rows] = torch.arange(len(rows))

    @property
    def output_token_ids(self) -> list[int]:
        """The rows the draft computes, as a list (full vocabulary: 0..full_vocab_size-1)."""
        return self.out_rows.tolist()

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def columns(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary ids [..] -> draft output columns, -1 where the draft cannot emit the token."""
        inside = (target_ids >= 0) & (target_ids < len(self.vocab_index))
        return torch.where(inside, self.vocab_index[target_ids.clamp(0, len(self.vocab_index) - 1)],
                           torch.full_like(target_ids, -1))

    def collate(self, units: list[Unit]) -> Batch:
        L = max(u.num_tokens for u in units)
        B = len(units)
        ids = torch.zeros(B, L, dtype=torch.long)
        pos = torch.zeros(B, L, dtype=torch.long)
        mask = torch.eye(L, dtype=torch.bool).repeat(B, 1, 1, 1)          # padding queries see themselves
        row_b, row_t, cols, lps = [], [], [], []
        for b, u in enumerate(units):
            n = u.num_tokens
            ids[b, :n] = torch.from_numpy(u.input_ids)
            pos[b, :n] = torch.from_numpy(u.position_ids)
            mask[b, 0, :n, :n] = torch.from_numpy(u.attention_mask())
            row_b.append(torch.full((u.num_rows,), b, dtype=torch.long))
            row_t.append(torch.from_numpy(u.row_index))
            cols.append(self.columns(torch.from_numpy(u.target_ids)))
            lps.append(torch.from_numpy(u.target_logprobs))
        return Batch(ids, pos, mask, torch.cat(row_b), torch.cat(row_t), torch.cat(cols), torch.cat(lps),
                     tokens=sum(u.num_tokens for u in units), units=list(units))

    def row_logits(self, batch: Batch) -> torch.Tensor:
        """Draft logits [R, V_out] (fp32) at the batch's scored rows."""
        hidden = self.decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                              position_ids=batch.position_ids, use_cache=False).last_hidden_state
        h = hidden[batch.row_b, batch.row_t]                                   # [R, H]
        logits = h @ self.head_weight.T
        return logits + self.head_bias if self.head_bias is not None else logits

    def save_adapter(self, folder: str | Path) -> Path:
        """peft save_pretrained (adapter_config.json + adapter_model.safetensors)."""
        folder = Path(folder)
        self.model.save_pretrained(str(folder), safe_serialization=True)
        return folder


def make_batches(units: list[Unit], batch_tokens: int) -> list[list[Unit]]:
    """Similar lengths together; a batch holds at most `batch_tokens` padded tokens (a longer unit
    forms a batch alone)."""
    batches: list[list[Unit]] = []
    cur: list[Unit] = []
    for u in sorted(units, key=lambda u: u.num_tokens):
        if cur and (len(cur) + 1) * u.num_tokens > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(u)
    if cur:
        batches.append(cur)
    return batches


# ----------------------------------------------------------------------------- acceptance
def row_acceptance(draft_logits: torch.Tensor, target_cols: torch.Tensor, target_logprobs: torch.Tensor,
                   temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """alpha per row = sum_j min(p_j, q(col_j)) over the target's top-k entries (module docstring).

    draft_logits [R, V_out]; target_cols [R, k] (-1: the draft cannot emit it, q = 0);
    target_logprobs [R, k] raw. Returns [R] fp32 in [0, 1].
    """
    p = warp_logprobs(target_logprobs.float(), temperature, top_k, top_p).exp()          # [R, k]
    q_all = warp_logprobs(draft_logits.float(), temperature, top_k, top_p).exp()         # [R, V_out]
    q = torch.where(target_cols >= 0, q_all.gather(1, target_cols.clamp(min=0)), torch.zeros_like(p))
    return torch.minimum(p, q).sum(-1).clamp(max=1.0)


def expected_accepted_length(alphas: Iterable[float], gamma: int = EAL_GAMMA) -> float:
    """sum_{i=1..G} prod_{j<=i} alpha_j for the first G = min(gamma, len) per-position alphas."""
    total, prod = 0.0, 1.0
    for a in list(alphas)[:gamma]:
        prod *= float(a)
        total += prod
    return total


@dataclass
class AcceptanceReport:
    acceptance: float | None               # mean alpha over scored positions
    expected_accepted_length: float | None  # mean E[L] (gamma = 4) over steps
    positions: int
    steps: int
    by_source: dict[str, dict] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def row_alphas(draft: Draft, units: list[Unit], *, batch_tokens: int = 4096) -> Iterable[tuple[Unit, np.ndarray]]:
    """(unit, alpha per scored row [R]) for every unit: the draft's acceptance under each record's warp."""
    was_training = draft.model.training
    draft.model.eval()
    try:
        for group in make_batches(units, batch_tokens):
            batch = draft.collate(group)
            logits = draft.row_logits(batch)
            alpha = torch.empty(logits.shape[0])
            temp = np.concatenate([u.temperature for u in group])
            tk = np.concatenate([u.top_k for u in group])
            tp = np.concatenate([u.top_p for u in group])
            for t, k, p in {(float(a), int(b), float(c)) for a, b, c in zip(temp, tk, tp)}:
                sel = torch.from_numpy((temp == np.float32(t)) & (tk == k) & (tp == np.float32(p)))
                alpha[sel] = row_acceptance(logits[sel], batch.target_cols[sel], batch.target_logprobs[sel],
                                            t, k, p)
            start = 0
            for u in group:
                yield u, alpha[start: start + u.num_rows].numpy()
                start += u.num_rows
    finally:
        draft.model.train(was_training)


def offline_acceptance(draft: Draft, units: list[Unit], *, batch_tokens: int = 4096) -> AcceptanceReport:
    """Offline acceptance of `draft` on (held-out) units; see the module docstring."""
    per_src: dict[str, dict[str, list[float]]] = {}
    for u, a in row_alphas(draft, units, batch_tokens=batch_tokens):
        acc = per_src.setdefault(u.source or "unlabelled", {"alpha": [], "eal": []})
        for s, gamma in enumerate(u.step_gamma):
            if gamma == 0:      # a step that drafted nothing (adaptive controller): trained on, not scored
                continue
            rows = (u.row_step == s)
            order = np.argsort(u.row_offset[rows])
            step_alpha = a[rows][order][:gamma]        # draft positions only, not the bonus row
            acc["alpha"].extend(step_alpha.tolist())
            acc["eal"].append(expected_accepted_length(step_alpha))

    def summary(alphas: list[float], eals: list[float]) -> dict:
        return {"acceptance": float(np.mean(alphas)) if alphas else None,
                "expected_accepted_length": float(np.mean(eals)) if eals else None,
                "positions": len(alphas), "steps": len(eals)}

    all_a = [x for v in per_src.values() for x in v["alpha"]]
    all_e = [x for v in per_src.values() for x in v["eal"]]
    return AcceptanceReport(**summary(all_a, all_e),
                            by_source={s: summary(v["alpha"], v["eal"]) for s, v in sorted(per_src.items())})


# ----------------------------------------------------------------------------- training
@dataclass
class TrainReport:
    steps: int
    loss_first: float
    loss_final: float            # mean loss over the last min(10, steps) steps
    tokens: int                  # real packed tokens processed
    rows: int                    # scored positions processed
    seconds: float
    tokens_per_s: float
    rows_per_s: float
    weighting: dict | None = None      # acceptance weighting: requests, miss rates, weights, seconds


def request_weights(draft: Draft, units: list[Unit], strength: float, *,
                    batch_tokens: int = 4096) -> tuple[dict[str, float], dict]:
    """Per-request loss weights (module docstring, "Acceptance weighting") from `draft`'s acceptance on
    every scored row of `units`, and a summary (per source: requests, mean miss rate, mean weight)."""
    t0 = time.perf_counter()
    sums: dict[str, list[float]] = {}
    source: dict[str, str] = {}
    for u, a in row_alphas(draft, units, batch_tokens=batch_tokens):
        acc = sums.setdefault(u.request_id, [0.0, 0])
        acc[0] += float(a.sum())
        acc[1] += int(a.shape[0])
        source[u.request_id] = u.source or "unlabelled"
    miss = {r: 1.0 - tot / n for r, (tot, n) in sums.items() if n}
    mean_miss = float(np.mean(list(miss.values()))) if miss else 0.0
    if mean_miss <= 1e-9:        # the parent already agrees everywhere: nothing to lean towards
        weights = {r: 1.0 for r in miss}
    else:
        weights = {r: (1.0 - strength) + strength * m / mean_miss for r, m in miss.items()}
    by_src: dict[str, dict] = {}
    for r, w in weights.items():
        d = by_src.setdefault(source[r], {"requests": 0, "miss": 0.0, "weight": 0.0})
        d["requests"] += 1
        d["miss"] += miss[r]
        d["weight"] += w
    for d in by_src.values():
        d["miss"] = round(d["miss"] / d["requests"], 4)
        d["weight"] = round(d["weight"] / d["requests"], 4)
    summary = {"strength": strength, "requests": len(weights), "mean_miss": round(mean_miss, 4),
               "weight_min": round(min(weights.values()), 4) if weights else None,
               "weight_max": round(max(weights.values()), 4) if weights else None,
               "by_source": dict(sorted(by_src.items())), "seconds": round(time.perf_counter() - t0, 3)}
    return weights, summary


def train(draft: Draft, units: list[Unit], cfg: TrainConfig, *,
          on_step: Callable[[list[Unit]], None] | None = None,
          log_metrics: Callable[[int, dict], None] | None = None,
          progress: Callable[[str], None] = print) -> TrainReport:
    """Train the draft's LoRA parameters on `units` (module docstring). `on_step(units)` runs after
    each optimizer step with the units it used (the job acks their records there)."""
    if not units:
        raise ValueError("no training units")
    params = draft.trainable_parameters()
    if not params:
        raise ValueError("the draft has no trainable parameters (load it with lora_r set)")
    loss_fn = get_loss(cfg.loss, cfg.beta)
    weights, weighting = None, None
    if cfg.acceptance_weight > 0:
        weights, weighting = request_weights(draft, units, cfg.acceptance_weight, batch_tokens=cfg.batch_tokens)
        srcs = ", ".join(f"{k} miss {v['miss']:.3f} weight {v['weight']:.2f}" for k, v in weighting["by_source"].items())
        progress(f"[distill] acceptance weighting (strength {cfg.acceptance_weight:g}) over {weighting['requests']} "
                 f"requests in {weighting['seconds']:.1f} s: weights {weighting['weight_min']:.2f}-"
                 f"{weighting['weight_max']:.2f}; {srcs}")
    batches = make_batches(units, cfg.batch_tokens)
    total = cfg.steps or max(cfg.min_steps, cfg.epochs * len(batches))
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    warm = max(1, min(cfg.warmup_steps, total // 5))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * max(0.1, 1.0 - max(0, s - warm) / max(1, total - warm)))
    rng = np.random.default_rng(cfg.seed)
    torch.manual_seed(cfg.seed)
    draft.model.train()
    step, tokens, rows, losses = 0, 0, 0, []
    t0 = time.perf_counter()
    while step < total:
        for i in rng.permutation(len(batches)):
            if step >= total:
                break
            batch = draft.collate(batches[i])
            logits = draft.row_logits(batch)
            mask = torch.ones(logits.shape[0], dtype=torch.bool)
            w = None
            if weights is not None:
                w = torch.cat([torch.full((u.num_rows,), weights.get(u.request_id, 1.0)) for u in batch.units])
            loss = loss_fn(logits, batch.target_cols, batch.target_logprobs, mask, weight=w)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite {cfg.loss} loss at step {step + 1}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            sched.step()
            step += 1
            tokens += batch.tokens
            rows += int(logits.shape[0])
            losses.append(float(loss.detach()))
            if on_step is not None:
                on_step(batch.units)
            if step % cfg.log_every == 0 or step == total:
                el = time.perf_counter() - t0
                m = {"loss": losses[-1], "tokens_per_s": tokens / el, "rows_per_s": rows / el,
                     "lr": sched.get_last_lr()[0]}
                progress(f"[distill] step {step}/{total} loss {m['loss']:.4f} {m['tokens_per_s']:.0f} tok/s "
                         f"{m['rows_per_s']:.0f} rows/s lr {m['lr']:.2e}")
                if log_metrics is not None:
                    log_metrics(step, m)
    draft.model.eval()
    el = time.perf_counter() - t0
    tail = losses[-min(10, len(losses)):]
    return TrainReport(step, losses[0], float(np.mean(tail)), tokens, rows, el, tokens / el, rows / el, weighting)


def peak_rss_mb() -> float:
    """Peak resident memory of this process (ru_maxrss, KiB on Linux) in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
