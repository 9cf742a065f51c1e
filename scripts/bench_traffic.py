"""Traffic-mix benchmark: every decoding mode on six categories of held-out chat traffic, in one process.

    .venv/bin/python scripts/bench_traffic.py --draft data/drafts/bootstrap --out docs/results/traffic
    .venv/bin/python scripts/bench_traffic.py --draft data/drafts/bootstrap --smoke --out /tmp/traffic_smoke
    .venv/bin/python scripts/bench_traffic.py --draft data/drafts/bootstrap --http     # through the HTTP API

Prompts: scripts/traffic_prompts.py (written for evaluation only, never trained on): maths, science, code,
everyday, writing and multi-turn chat, `--n` per category (default all 12), chat template applied.

Modes (`--modes`, default `default,target,speculative,ngram`):
    default      what the API serves with no `speculative` field (serving/config.py served_mode): with
                 --medusa-heads the heads' tree, its depth adaptive (mode medusa); else MJSD (gamma 4, 8 beams,
                 tau 0.1), adaptive on
    mjsd         MJSD with the draft model, adaptive on (the default without heads)
    target       target-only decoding: the baseline every ratio is taken against (always run)
    speculative  lossless speculative sampling, adaptive on
    ngram        prompt-lookup drafting, no draft model
    any other engine mode name (serving/config.py MODES) runs with SpecParams' defaults.
`--fixed-gamma` adds `default-fixed` and `speculative-fixed` rows with adaptive=False (gamma tokens drafted at
every step), for comparison. "Adaptive" is SpecParams.adaptive (gamma is then an upper bound).

Sampling: temperature 0 (greedy) and 0.7 (`--temperatures`), with the API's default warps for an OpenAI
client (top_k 0 = off, top_p 1.0 = off), `--max-tokens` 64, a fixed seed per prompt (the same for every mode).

Fairness on a shared VM: one untimed warm-up generation per mode (and temperature) first; then modes are
interleaved prompt by prompt (for each prompt every mode runs, the starting mode rotating), so the machine's
speed drift affects all modes alike. `--repeats R` runs each prompt's modes R times (the order reversed every
other round) and takes, per prompt and mode, the median seconds per token over its runs: on a shared 2-core
VM a single request can run 20-30% slow when a neighbour is busy, which at 4 prompts a category moves a ratio
by more than the 3% floor the benchmark checks; the plain sums are reported beside it ("all runs").

Reported per category x temperature x mode: tokens/s = sum of tokens / sum of wall time over the category's
prompts; ratio to target-only = that tokens/s over target-only's on the same prompts; acceptance = accepted /
proposed draft tokens; drafted tokens per step = draft_tokens / steps; the share of steps that drafted 0 tokens
(GenerationStats.zero_draft_steps); at temperature 0, the share of prompts
whose output equals target-only's (lossless modes must give 1.0 up to bf16 ties). Also the geometric mean of
the ratio over categories per mode and temperature.

Writes into --out: results.json (setup, per-prompt records with stats and output ids, summary, geometric
means), results.md (tables) and results.png (grouped bars of the ratio per category and mode, one panel per
temperature, dashed line at 1.0). Progress lines with rates go to stderr.

--http: instead of the in-process engine, start `draftsmith serve --draft DRAFT` on a free port (as
scripts/bench_load.py does; or use `--url`) and send the same prompts, non-streaming, as chat requests at
the first of `--temperatures` (OpenAI's default warps, a seed per prompt unless --no-seed: a seeded request at
T > 0 plans from the replica's cost profile and keeps the heads, an unseeded one is routed by the replica's measured
choice between heads and draft, serving/mode_choice.py): the served default (no `speculative` field) against
`{"speculative": {"mode": "target"}}`, interleaved prompt by prompt. Reports the per-category ratio of client-side tokens/s (end to end, HTTP + Ray
included) and of the server-side engine tokens/s, plus the `metrics.speculative_decoding` totals; writes
http_results.json and http_results.md into --out.

--smoke: 1 prompt per category, 8 tokens, temperature 0 only (a seconds-long check that everything runs).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.traffic_prompts import CATEGORIES, messages, prompt_to_ids, traffic_prompts  # noqa: E402

DEFAULT_MODES = "default,target,speculative,ngram"
BASE_STATS_FIELDS = {"mode", "draft_version", "gamma", "steps", "draft_tokens", "accepted_tokens", "tokens",
                     "accepted_per_position", "draft_time_s", "target_time_s", "wall_time_s", "energy_j",
                     "energy_reason"}


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- modes
# row variants that set one knob of the heads' tree: name -> (knob, parser, what it takes)
VARIANT_KNOBS = {"floor": ("node_floor", float, "a number in [0, 1)"), "lookup": ("lookup_ngram", int, "an integer >= 0"),
                 "suffix": ("suffix", int, "0 or 1")}


def make_spec(label: str, args):
    """SpecParams for a row label: default / default-fixed / speculative / speculative-fixed / any engine mode;
    `tree+typical` / `medusa+typical` / `eagle+typical` (or `+mjsd`): that mode with Medusa's typical acceptance on the tree;
    `default+nostop` / `speculative+nostop`: adaptive chains without the draft-confidence stop;
    `medusa+fp32heads` / `eagle+fp32heads`: that mode with its heads in fp32 (the engine runs them in the
    target's dtype; the row measures what that buys on a bf16 machine);
    `default+floor=X` / `medusa+floor=X`: that mode with the heads' tree pruned at node_floor X (0: the full
    shape; serving/decoding/medusa.py);
    `default+lookup=N` / `medusa+lookup=N`: that mode with the prompt lookup's branch grafted onto the heads' tree
    from context n-grams of at least N tokens (0: the heads' tree alone; serving/engine.py `medusa_tree`);
    `default+suffix=0` / `medusa+suffix=0`: that mode without the suffix store's branch (serving/decoding/suffix.py);
    `mjsd+nostore` (any mode): that mode on an engine without a suffix store (the chain modes' n-gram proposer reads
    it where the context proposes nothing);
    `mjsd+onesource` (any chain mode): the suffix store's proposals priced as the prompt lookup's, one acceptance
    estimate for both (Engine.store_apart off: the controller before the forty-sixth session); in a run with such
    a row every row plans from replica priors of its own, so that neither pricing's estimates leak into the other's."""
    from serving.config import (ADAPTIVE_TREE_MODES, AUTO_MODE, DRAFT_FREE_MODES, SpecParams, served_knobs,
                                served_mode)

    label, _, variant = label.partition("+")
    fixed = label.endswith("-fixed")
    base = label[: -len("-fixed")] if fixed else label
    # "default": what the service serves a request that names no mode, with this run's draft and heads
    mode = served_mode(AUTO_MODE, has_draft=True, has_heads=bool(args.medusa_heads),
                       has_eagle=bool(args.eagle_head)) if base == "default" else base
    kw = dict(mode=mode, gamma=args.gamma, beams=args.beams, tau=args.tau)
    if base == "default":
        kw["extra"] = served_knobs(mode)
    name, eq, value = variant.partition("=")
    if eq and name in VARIANT_KNOBS:                        # `+floor=X`, `+lookup=N`: one knob of the tree
        knob, kind, what = VARIANT_KNOBS[name]
        try:
            kw["extra"] = {**kw.get("extra", {}), knob: kind(value)}
        except ValueError:
            raise ValueError(f"row {label}+{variant}: {name}= takes {what}") from None
    elif variant and variant not in ("nostop", "fp32heads", "nostore", "onesource"):   # the engine's knobs
        kw["extra"] = {"rule": variant}
    if mode not in DRAFT_FREE_MODES or mode in ADAPTIVE_TREE_MODES:
        kw["adaptive"] = not fixed
    return SpecParams(**kw)


def row_labels(args) -> list[str]:
    labels = [m.strip() for m in args.modes.split(",") if m.strip()]
    if "target" not in labels:
        labels.insert(1 if labels else 0, "target")   # every ratio needs it
    if args.fixed_gamma:
        for base in ("default", "speculative"):
            if base in labels and f"{base}-fixed" not in labels:
                labels.append(f"{base}-fixed")
    return list(dict.fromkeys(labels))


# ----------------------------------------------------------------------------- stats
def zero_draft_steps(stats) -> int:
    """Steps that drafted 0 tokens (the adaptive controller chose a plain target step)."""
    return int(stats.zero_draft_steps)


def stats_dict(stats) -> dict:
    d = stats.to_dict() if hasattr(stats, "to_dict") else dataclasses.asdict(stats)
    return {k: v for k, v in d.items() if isinstance(v, (int, float, str, list, dict, type(None)))}


def geomean(values: list[float]) -> float | None:
    vals = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals and len(vals) == len(values) else None


def r3(v):
    return None if v is None else round(v, 3)


def joules_per_token(records: list[dict], tokens: int) -> float | None:
    """GPU energy (NVML) per generated token over `records`; None unless every request's energy was measured
    (on the CPU the engine reports none)."""
    joules = [r["stats"].get("energy_j") for r in records]
    if not tokens or not joules or any(j is None for j in joules):
        return None
    return sum(joules) / tokens


def repeat_medians(rs: list[dict]) -> tuple[float, float]:
    """(tokens, wall seconds) of one (temperature, category, mode) cell: per prompt, its tokens (mean over
    the repeats) times the median over the repeats of its seconds per token; summed over the prompts. With
    one repeat: the plain sums. The median drops a repeat that a burst of other load on the machine slowed
    (or a quiet moment sped up) without favouring either mode, as a minimum would favour a mode whose speed
    varies with its plan."""
    by: dict = {}
    for r in rs:
        by.setdefault(r.get("prompt_index"), []).append(r)
    tokens = wall = 0.0
    for reps in by.values():
        mean_tokens = sum(r["tokens"] for r in reps) / len(reps)
        spt = sorted(r["wall_s"] / max(1, r["tokens"]) for r in reps)
        mid = len(spt) // 2
        median = spt[mid] if len(spt) % 2 else 0.5 * (spt[mid - 1] + spt[mid])
        tokens += mean_tokens
        wall += mean_tokens * median
    return tokens, wall


def summarise(records: list[dict], temps: list[float], cats: list[str], labels: list[str]) -> tuple[list, dict]:
    """Per (temperature, category, mode) rows, and {T: {mode: geometric mean of the ratio over categories}}."""
    rows = []
    for T in temps:
        for cat in cats:
            agg = {}
            for label in labels:
                rs = [r for r in records if r["temperature"] == T and r["category"] == cat and r["mode"] == label]
                if not rs:
                    continue
                tokens_all = sum(r["tokens"] for r in rs)
                wall_all = sum(r["wall_s"] for r in rs)
                tokens, wall = repeat_medians(rs)
                steps = sum(r["stats"].get("steps", 0) for r in rs)
                drafted = sum(r["stats"].get("draft_tokens", 0) for r in rs)
                accepted = sum(r["stats"].get("accepted_tokens", 0) for r in rs)
                zeros = [r["zero_draft_steps"] for r in rs]
                same = [r["same_as_target"] for r in rs if r.get("same_as_target") is not None]
                agg[label] = dict(
                    temperature=T, category=cat, mode=label, prompts=len({r.get("prompt_index") for r in rs}),
                    repeats=max(r.get("repeat", 0) for r in rs) + 1, tokens=tokens, wall_s=round(wall, 3),
                    tokens_per_s=tokens / wall if wall > 0 else None,
                    tokens_per_s_all_runs=tokens_all / wall_all if wall_all > 0 else None, steps=steps, draft_tokens=drafted,
                    accepted_tokens=accepted,
                    acceptance=accepted / drafted if drafted else None,
                    drafted_per_step=drafted / steps if steps else None,
                    accepted_per_step=accepted / steps if steps else None,
                    zero_draft_share=(sum(zeros) / steps if steps else None) if all(z is not None for z in zeros) else None,
                    same_as_target=sum(same) / len(same) if same else None,
                    draft_time_share=(sum(r["stats"].get("draft_time_s", 0.0) for r in rs) / wall_all
                                      if wall_all > 0 else None),
                    j_per_token=joules_per_token(rs, tokens_all),
                )
            base = agg.get("target", {}).get("tokens_per_s")
            base_all = agg.get("target", {}).get("tokens_per_s_all_runs")
            for label, row in agg.items():
                row["ratio_to_target"] = row["tokens_per_s"] / base if base and row["tokens_per_s"] else None
                row["ratio_all_runs"] = (row["tokens_per_s_all_runs"] / base_all
                                         if base_all and row["tokens_per_s_all_runs"] else None)
                rows.append(row)
    gm: dict = {}
    for T in temps:
        gm[str(T)] = {}
        for label in labels:
            ratios = [r["ratio_to_target"] for r in rows if r["temperature"] == T and r["mode"] == label]
            if ratios:
                gm[str(T)][label] = r3(geomean(ratios))
    for r in rows:
        for k, v in list(r.items()):
            if isinstance(v, float):
                r[k] = round(v, 4 if k in ("zero_draft_share", "same_as_target", "j_per_token") else 3)
    return rows, gm


def fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def to_markdown(setup: str, rows: list[dict], gm: dict, temps: list[float], labels: list[str]) -> str:
    out = [setup, ""]
    energy = any(r.get("j_per_token") is not None for r in rows)      # a GPU run: NVML's J/token column
    repeats = max((r.get("repeats", 1) for r in rows), default=1)
    if repeats > 1:
        out += [f"Each prompt ran {repeats} times per mode (rounds interleaved); tokens/s and \"vs target\" use each "
                "prompt's median seconds per token over its runs, \"all runs\" the plain sums.", ""]
    for T in temps:
        out += [f"### Temperature {T:g}", "",
                "| category | mode | tokens/s | vs target |" + (" vs target (all runs) |" if repeats > 1 else "")
                + " acceptance | drafted/step | 0-draft steps | same as target |" + (" J/token |" if energy else ""),
                "|---|---|---:|---:|" + ("---:|" if repeats > 1 else "") + "---:|---:|---:|---:|"
                + ("---:|" if energy else "")]
        for r in rows:
            if r["temperature"] != T:
                continue
            out.append(f"| {r['category']} | {r['mode']} | {fmt(r['tokens_per_s'], '.1f')} | "
                       f"{fmt(r['ratio_to_target'])} | "
                       + (f"{fmt(r.get('ratio_all_runs'))} | " if repeats > 1 else "")
                       + f"{fmt(r['acceptance'], '.3f')} | {fmt(r['drafted_per_step'])} | "
                       f"{fmt(r['zero_draft_share'], '.1%')} | {fmt(r['same_as_target'], '.0%')} |"
                       + (f" {fmt(r.get('j_per_token'), '.3f')} |" if energy else ""))
        out.append("")
    out += ["### Geometric mean over categories of the ratio to target-only", "",
            "| mode | " + " | ".join(f"T={T:g}" for T in temps) + " |", "|---|" + "---:|" * len(temps)]
    for label in labels:
        out.append(f"| {label} | " + " | ".join(fmt(gm.get(str(T), {}).get(label)) for T in temps) + " |")
    return "\n".join(out) + "\n"


def plot(rows: list[dict], gm: dict, temps: list[float], cats: list[str], labels: list[str], path: Path,
         title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [m for m in labels if m != "target"]
    groups = cats + ["geo. mean"]
    fig, axes = plt.subplots(1, len(temps), figsize=(max(6.0, 1.1 * len(groups)) * len(temps) / 1.4, 4.2),
                             squeeze=False, sharey=True)
    width = 0.8 / max(1, len(shown))
    for ax, T in zip(axes[0], temps):
        for j, label in enumerate(shown):
            vals = []
            for cat in cats:
                r = next((r for r in rows if r["temperature"] == T and r["category"] == cat and r["mode"] == label), None)
                vals.append((r or {}).get("ratio_to_target") or 0.0)
            vals.append(gm.get(str(T), {}).get(label) or 0.0)
            xs = [i + (j - (len(shown) - 1) / 2) * width for i in range(len(groups))]
            ax.bar(xs, vals, width, label=label)
        ax.axhline(1.0, color="grey", lw=1, ls="--")
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(groups, rotation=20, fontsize=8)
        ax.set_title(f"temperature {T:g}", fontsize=9)
        ax.set_ylabel("tokens/s relative to target-only")
    top = max([r["ratio_to_target"] or 0.0 for r in rows] + [1.0])
    for ax in axes[0]:
        ax.set_ylim(0, top * 1.2)
    axes[0][0].legend(fontsize=7, ncol=min(4, len(shown)), loc="upper left")
    import textwrap

    fig.suptitle(textwrap.fill(title, 90 * len(temps)), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- in-process run
class SuffixStores:
    """What the engine's suffix store (serving/decoding/suffix.py) holds for each prompt of the run. A run replays
    each prompt (rows, repeats), so a store that learned from the run as a replica does would propose a
    prompt's own earlier answer: a cache hit, not a measurement. Here the store holds the seed's answers (the
    bootstrap's teacher data) and, with `learn`, the run's answers to its OTHER prompts (leave one prompt out):
    the state a replica reaches after serving other traffic."""

    def __init__(self, seed: str | None, learn: bool) -> None:
        from serving.decoding.suffix import teacher_answers

        self.pairs = teacher_answers(seed) if seed else []
        self.learn_on = learn
        self.learned: dict = {}
        self.shared = self._build([])

    def _build(self, extra: list):
        from serving.decoding.suffix import SuffixStore

        store = SuffixStore()
        store.add_many(self.pairs + extra)
        return store

    def for_prompt(self, key):
        if not self.learn_on:
            return self.shared
        return self._build([pa for k, pa in self.learned.items() if k != key])

    def learn(self, key, prompt: list[int], answer: list[int]) -> None:
        if self.learn_on and answer:
            self.learned[key] = (list(prompt), list(answer))


def run_engine(args) -> int:
    import torch

    from serving.config import SamplingParams
    from serving.controller import ReplicaPriors
    from serving.engine import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    t_load = time.perf_counter()
    engine = Engine.from_paths(args.target, args.draft, device=args.device, dtype=dtype, heads=args.medusa_heads,
                                eagle=args.eagle_head)
    progress(f"[traffic] models loaded in {time.perf_counter() - t_load:.1f} s")
    if args.prior_costs:
        engine.calibrate = lambda *a, **k: None
    if args.seeded_prior is not None:
        engine.seeded_prior = args.seeded_prior
    engine.profile_dir = args.profile_dir
    stop_confidence = engine.stop_confidence if args.stop_confidence is None else args.stop_confidence
    labels = row_labels(args)
    specs = {label: make_spec(label, args) for label in labels}
    own_heads = fp32_heads = (engine.heads, engine.eagle)
    if any(lab.endswith("+fp32heads") for lab in labels):       # the same folders loaded as saved: fp32
        from serving.decoding.eagle import EagleHead
        from serving.decoding.medusa import MedusaHeads

        fp32_heads = tuple(None if path is None else cls.load(path, engine.target.model).to(engine.target_device)
                           for cls, path in ((MedusaHeads, args.medusa_heads), (EagleHead, args.eagle_head)))

    def use_heads(label: str) -> None:      # `+fp32heads` rows: the same heads in fp32 (make_spec)
        engine.heads, engine.eagle = fp32_heads if label.endswith("+fp32heads") else own_heads
    cats = args.categories
    prompts = traffic_prompts(cats, args.n)
    ids = {c: [prompt_to_ids(engine.tokenizer, p) for p in ps] for c, ps in prompts.items()}
    temps = args.temperatures

    def sampling(T: float, max_tokens: int, seed: int) -> SamplingParams:
        # --no-seed: what an OpenAI client sends by default; the controller of an unseeded (or greedy)
        # request plans with the replica's measured costs, a seeded sampled one with the replica's frozen
        # cost profile (Engine.calibrate, measured in the warm-up's first seeded request)
        return SamplingParams(temperature=T, top_k=0, top_p=1.0, max_tokens=max_tokens,
                              seed=None if args.no_seed else seed)

    # warm-up: one untimed generation per mode and temperature (first-call allocations, kernel choice)
    warm = ids[cats[0]][0]
    for T in temps:
        for label in labels:
            use_heads(label)
            engine.generate_all(warm, sampling(T, min(8, args.max_tokens), 0), specs[label], log_mode="none")
    progress(f"[traffic] warm-up done; {len(labels)} modes x {len(cats)} categories x {args.n or 12} prompts x "
             f"{len(temps)} temperatures, {args.max_tokens} tokens each")

    warm_each = args.warm_each if args.warm_each is not None else str(args.device).startswith("cuda")
    # replica priors: the engine's, shared by every row as in a replica; in a run with `+onesource` rows (make_spec)
    # every row's own, so that the two pricings learn apart and neither arm steers the other's probes
    own = any(label.endswith("+onesource") for label in labels)
    priors_of = {label: ReplicaPriors() if own else engine.priors for label in labels}
    stores = SuffixStores(args.suffix_seed, args.suffix_learn)
    engine.suffix_learn = False                 # the bench decides what the store holds (SuffixStores)
    records: list[dict] = []
    total = len(temps) * sum(len(v) for v in ids.values())
    done, t_run = 0, time.perf_counter()
    for T in temps:
        for ci, cat in enumerate(cats):
            cum = {label: [0, 0.0] for label in labels}
            for i, prompt in enumerate(ids[cat]):
                seed = 1000 * (list(CATEGORIES).index(cat) + 1) + i
                k = i % len(labels)
                order = labels[k:] + labels[:k]       # rotate the starting mode prompt by prompt
                if warm_each:                         # the prompt's lengths once, untimed (see --warm-each)
                    engine.generate_all(prompt, sampling(T, args.max_tokens, seed), specs["target"], log_mode="none")
                for rep in range(args.repeats):
                    outs = {}
                    store = stores.for_prompt((cat, i))
                    for label in (order if rep % 2 == 0 else order[::-1]):    # ABBA over the rounds
                        engine.suffix_store = None if label.endswith("+nostore") else store
                        if not args.keep_prefix_cache:    # every row prefills its prompt (the tree modes always do)
                            engine.scheduler.prefix_cache.clear()
                        t0 = time.perf_counter()
                        engine.stop_confidence = 0.0 if label.endswith("+nostop") else stop_confidence
                        engine.store_apart = not label.endswith("+onesource")
                        engine.priors = priors_of[label]
                        use_heads(label)
                        res = engine.generate_all(prompt, sampling(T, args.max_tokens, seed), specs[label],
                                                  log_mode="none")
                        wall = time.perf_counter() - t0
                        st = res.stats
                        outs[label] = res.token_ids
                        cum[label][0] += len(res.token_ids)
                        cum[label][1] += wall
                        records.append(dict(
                            temperature=T, category=cat, prompt_index=i, repeat=rep, mode=label, seed=seed,
                            prompt_tokens=len(prompt), tokens=len(res.token_ids), wall_s=round(wall, 4),
                            tokens_per_s=round(len(res.token_ids) / wall, 3),
                            finish_reason=res.finish_reason, zero_draft_steps=zero_draft_steps(st),
                            stats=stats_dict(st), new_stats_fields=sorted(set(stats_dict(st)) - BASE_STATS_FIELDS
                                                                          - {"mean_accepted_length", "acceptance_rate",
                                                                             "overhead_time_s", "tokens_per_s"}),
                            output_ids=list(res.token_ids)))
                    stores.learn((cat, i), prompt, next(iter(outs.values())))
                    if T == 0 and "target" in outs:
                        for r in records[-len(order):]:
                            r["same_as_target"] = None if r["mode"] == "target" else outs[r["mode"]] == outs["target"]
                done += 1
                base = cum["target"][0] / cum["target"][1] if cum["target"][1] else 0
                rates = " ".join(f"{label} {cum[label][0] / cum[label][1]:.1f}"
                                 + (f" (x{cum[label][0] / cum[label][1] / base:.2f})" if base and label != "target" else "")
                                 for label in labels if cum[label][1])
                el = time.perf_counter() - t_run
                progress(f"[traffic] T={T:g} {cat} {i + 1}/{len(ids[cat])} tok/s so far: {rates} | {done}/{total} "
                         f"prompts, {el:.0f} s, ~{el / done * (total - done):.0f} s left")

    rows, gm = summarise(records, temps, cats, labels)
    setup = (f"target={engine.target_name} draft={args.draft} device={args.device} "
             f"dtype={next(engine.target.model.parameters()).dtype} threads={torch.get_num_threads()} "
             f"prompts=traffic_prompts x{args.n or 12}/category"
             f"{f' x{args.repeats} runs' if args.repeats > 1 else ''} max_tokens={args.max_tokens} "
             f"T={','.join(f'{T:g}' for T in temps)} top_k=0 top_p=1.0 gamma={args.gamma} beams={args.beams} "
             f"tau={args.tau} seeds={'none' if args.no_seed else 'per prompt'} stop_confidence={stop_confidence}"
             f"{' seeded_costs=prior' if args.prior_costs else ''}"
             f"{f' seeded_prior={args.seeded_prior}' if args.seeded_prior is not None else ''}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = dict(setup=setup, args={k: v for k, v in vars(args).items()}, date=time.strftime("%Y-%m-%d %H:%M"),
                  specs={label: dataclasses.asdict(s) for label, s in specs.items()},
                  summary=rows, geomean_ratio=gm, records=records, seeded_cost_profile=engine.seeded_profile,
                  replica_costs=engine.costs.snapshot())       # what the controller measured (seconds)
    (out / "results.json").write_text(json.dumps(report, indent=1))
    md = to_markdown(setup, rows, gm, temps, labels)
    (out / "results.md").write_text(md)
    plot(rows, gm, temps, cats, labels, out / "results.png", setup)
    print(md)
    progress(f"[traffic] wrote {out}/results.json, results.md, results.png in {time.perf_counter() - t_run:.0f} s")
    return 0


# ----------------------------------------------------------------------------- HTTP run
def start_server(port: int, draft: str | None, target: str | None, log: Path,
                 medusa_heads: str | None = None) -> subprocess.Popen:
    """`draftsmith serve` on `port` with an explicit draft folder (and Medusa heads folder, which the served
    default then drafts with) (scripts/bench_load.py's start_server serves the registry's champions and takes no
    folders, so this is its minimal copy with --draft); waits for /health."""
    import httpx

    cmd = [str(ROOT / ".venv" / "bin" / "draftsmith"), "serve", "--port", str(port), "--no-bootstrap"]
    if draft:
        cmd += ["--draft", str(draft)]
    if medusa_heads:
        cmd += ["--medusa-heads", str(medusa_heads)]
    if target:
        cmd += ["--target", str(target)]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"draftsmith serve exited; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(2)
    stop_server(proc)
    raise SystemExit(f"the server did not become healthy in 300 s; see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_http(args) -> int:
    import httpx

    cats = args.categories
    prompts = traffic_prompts(cats, args.n)
    settings = {"default": None, "target": {"mode": "target"}}   # None: no `speculative` field (served default)
    proc, url = None, args.url
    if url is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = Path("/tmp/bench_traffic_serve.log")
        progress(f"[traffic-http] starting draftsmith serve --draft {args.draft} on port {port} (log {log})")
        proc = start_server(port, args.draft, args.target, log, args.medusa_heads)
        url = f"http://127.0.0.1:{port}"
    records: list[dict] = []
    try:
        with httpx.Client(base_url=url, timeout=600) as client:
            def ask(msgs, label, seed, max_tokens):
                body = {"messages": msgs, "max_tokens": max_tokens, "temperature": args.temperatures[0], "top_k": 0,
                        "top_p": 1.0, "seed": None if args.no_seed else seed, "log_mode": "none"}
                if settings[label] is not None:
                    body["speculative"] = settings[label]
                t0 = time.perf_counter()
                r = client.post("/v1/chat/completions", json=body)
                wall = time.perf_counter() - t0
                if r.status_code != 200:
                    raise SystemExit(f"HTTP {r.status_code}: {r.text[:500]}")
                return r.json(), wall

            first = messages(prompts[cats[0]][0])
            for label in settings:   # warm-up, untimed
                body, _ = ask(first, label, 0, 8)
                mode = body.get("metrics", {}).get("speculative_decoding", {}).get("mode")
                progress(f"[traffic-http] warm-up {label}: served mode {mode}")
                if label == "default" and mode == "target":
                    progress("[traffic-http] WARNING: the served default is target-only (no draft loaded?)")
            total = sum(len(v) for v in prompts.values())
            done, t_run = 0, time.perf_counter()
            for cat in cats:
                for i, p in enumerate(prompts[cat]):
                    seed = 1000 * (list(CATEGORIES).index(cat) + 1) + i
                    order = list(settings) if i % 2 == 0 else list(settings)[::-1]
                    for label in order:
                        body, wall = ask(messages(p), label, seed, args.max_tokens)
                        m = body.get("metrics", {}).get("speculative_decoding", {})
                        toks = body["usage"]["completion_tokens"]
                        records.append(dict(category=cat, prompt_index=i, mode=label, seed=seed, tokens=toks,
                                            wall_s=round(wall, 4), server_wall_s=m.get("wall_time_s"),
                                            text=body["choices"][0]["message"]["content"], spec_metrics=m,
                                            system_fingerprint=body.get("system_fingerprint")))
                    done += 1
                    el = time.perf_counter() - t_run
                    last = {r["mode"]: r for r in records[-len(order):]}
                    progress(f"[traffic-http] {cat} {i + 1}/{len(prompts[cat])}: "
                             + " ".join(f"{k} {v['tokens'] / v['wall_s']:.1f} tok/s" for k, v in last.items())
                             + f" | {done}/{total}, {el:.0f} s, ~{el / done * (total - done):.0f} s left")
    finally:
        if proc is not None:
            stop_server(proc)

    rows = []
    for cat in cats:
        agg = {}
        for label in settings:
            rs = [r for r in records if r["category"] == cat and r["mode"] == label]
            tokens = sum(r["tokens"] for r in rs)
            wall = sum(r["wall_s"] for r in rs)
            swall = sum(r["server_wall_s"] or 0.0 for r in rs)
            ms = [r["spec_metrics"] for r in rs]
            steps = sum(m.get("steps") or 0 for m in ms)
            drafted = sum(m.get("draft_tokens") or 0 for m in ms)
            accepted = sum(m.get("accepted_tokens") or 0 for m in ms)
            agg[label] = dict(category=cat, mode=label, prompts=len(rs), tokens=tokens,
                              tokens_per_s=tokens / wall if wall else None,
                              server_tokens_per_s=tokens / swall if swall else None,
                              served_mode=sorted({m.get("mode") for m in ms if m.get("mode")}),
                              draft_version=sorted({str(m.get("draft_version")) for m in ms}),
                              steps=steps, draft_tokens=drafted, accepted_tokens=accepted,
                              acceptance=accepted / drafted if drafted else None,
                              drafted_per_step=drafted / steps if steps else None)
        base, sbase = agg["target"]["tokens_per_s"], agg["target"]["server_tokens_per_s"]
        for label, row in agg.items():
            row["ratio_to_target"] = row["tokens_per_s"] / base if base and row["tokens_per_s"] else None
            row["server_ratio_to_target"] = (row["server_tokens_per_s"] / sbase
                                             if sbase and row["server_tokens_per_s"] else None)
            rows.append(row)
    dflt = [r for r in rows if r["mode"] == "default"]
    gm = {"client": r3(geomean([r["ratio_to_target"] for r in dflt])),
          "server": r3(geomean([r["server_ratio_to_target"] for r in dflt]))}
    setup = (f"HTTP {url} draft={args.draft} served default vs target-only, T={args.temperatures[0]:g} top_k=0 top_p=1.0, "
             f"max_tokens={args.max_tokens}, {args.n or 12} prompts/category, non-streaming, one client")
    lines = [setup, "", "| category | mode | client tokens/s | vs target | server tokens/s | vs target | acceptance | "
             "drafted/step |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['category']} | {r['mode']} ({'/'.join(r['served_mode'])}) | {fmt(r['tokens_per_s'], '.1f')} | "
                     f"{fmt(r['ratio_to_target'])} | {fmt(r['server_tokens_per_s'], '.1f')} | "
                     f"{fmt(r['server_ratio_to_target'])} | {fmt(r['acceptance'], '.3f')} | {fmt(r['drafted_per_step'])} |")
    lines.append(f"\nGeometric mean over categories of the default's ratio to target-only: client {fmt(gm['client'])}, "
                 f"server-side {fmt(gm['server'])}")
    md = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "http_results.json").write_text(json.dumps(dict(setup=setup, args=vars(args), summary=rows,
                                                           geomean_ratio=gm, records=records), indent=1, default=str))
    (out / "http_results.md").write_text(md)
    print(md)
    progress(f"[traffic-http] wrote {out}/http_results.json, http_results.md")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--draft", required=True, help="draft model folder (same tokenizer as the target)")
    ap.add_argument("--target", default=None, help="target model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--medusa-heads", default=None, help="Medusa heads folder, for a `medusa` row in --modes")
    ap.add_argument("--eagle-head", default=None, help="EAGLE-style head folder, for an `eagle` row in --modes")
    ap.add_argument("--n", type=int, default=12, help="prompts per category (at most 12)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run each prompt this many times per mode (rounds interleaved); the figures then use each "
                         "prompt's median seconds per token, which a burst of other load on a shared VM cannot sway")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--modes", default=DEFAULT_MODES,
                    help="comma-separated: default, target, speculative, ngram, or any engine mode")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--categories", nargs="+", default=list(CATEGORIES), choices=list(CATEGORIES))
    ap.add_argument("--fixed-gamma", action="store_true", help="add adaptive=False rows for default and speculative")
    ap.add_argument("--gamma", type=int, default=4, help="draft tokens per step (an upper bound when adaptive)")
    ap.add_argument("--beams", type=int, default=8)
    ap.add_argument("--no-seed", action="store_true",
                    help="send no seed (the OpenAI default): the controller then plans with the replica's measured "
                         "costs at every temperature, not only at T=0")
    ap.add_argument("--prior-costs", action="store_true",
                    help="seeded sampled requests plan from the prior cost ratios instead of the replica's measured "
                         "profile (Engine.calibrate off): the behaviour before the profile, for an A/B")
    ap.add_argument("--profile-dir", default=None,
                    help="keep / read the seeded requests' cost profile here (as the service does), so that runs "
                         "compared with each other plan seeded requests from the same profile")
    ap.add_argument("--seeded-prior", type=float, default=None,
                    help="the acceptance a seeded sampled request assumes before its own steps (Engine.seeded_prior)")
    ap.add_argument("--stop-confidence", type=float, default=None,
                    help="adaptive chains end after a token the draft doubts below this (default: the engine's, "
                         "serving/controller.py STOP_CONFIDENCE; rows `+nostop` turn it off)")
    ap.add_argument("--suffix-seed", default=None,
                    help="teacher data whose answers seed the suffix store (default: the bootstrap's "
                         "<data>/bootstrap/teacher.safetensors where it exists; 'none': an empty store)")
    ap.add_argument("--suffix-learn", action="store_true",
                    help="the suffix store also holds this run's answers to the OTHER prompts (leave one out)")
    ap.add_argument("--tau", type=float, default=0.1)
    ap.add_argument("--device", default="cpu")
    from scripts.bench_decode import add_row_fairness_flags

    add_row_fairness_flags(ap)
    ap.add_argument("--dtype", default=None, choices=[None, "bfloat16", "float16", "float32"])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "traffic"))
    ap.add_argument("--http", action="store_true", help="run default vs target through the HTTP API instead")
    ap.add_argument("--url", default=None, help="with --http: an already running server (default: start one)")
    ap.add_argument("--smoke", action="store_true", help="1 prompt per category, 8 tokens, temperature 0 only")
    args = ap.parse_args(argv)
    from serving.decoding.suffix import resolve_seed

    args.suffix_seed = resolve_seed(args.suffix_seed)
    if args.smoke:
        args.n, args.max_tokens, args.temperatures = 1, 8, [0.0]
    if not 1 <= args.n <= 12:
        ap.error("--n must be in 1..12")
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if not Path(args.draft).is_dir():
        ap.error(f"--draft {args.draft}: no such folder")
    if any(m.strip().startswith("medusa") for m in args.modes.split(",")) and not args.medusa_heads:
        ap.error("a `medusa` row needs --medusa-heads PATH (heads from `python -m training.heads`)")
    if any(m.strip().startswith("eagle") for m in args.modes.split(",")) and not args.eagle_head:
        ap.error("an `eagle` row needs --eagle-head PATH (a head from `python -m training.heads --kind eagle`)")
    return run_http(args) if args.http else run_engine(args)


if __name__ == "__main__":
    raise SystemExit(main())
