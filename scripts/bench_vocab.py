"""Draft output-vocabulary size, chosen by measured tokens/s: draft cost against acceptance.

    .venv/bin/python scripts/bench_vocab.py --draft data/drafts/bootstrap \
        --sizes 2048 4096 8192 16384 32768 full --out docs/results/vocab

The draft computes logits only over `draftsmith.json` `output_token_ids` (serving/models.py): a smaller set makes
each draft forward cheaper (the 49,152 x 576 output projection dominates a 2-layer draft on CPU) but the draft
can no longer propose the tokens left out. For each size this script makes a temporary view of the draft folder
(every file symlinked except draftsmith.json, which is rewritten with `output_token_ids` = the first `size` ids of
the draft's `vocab_ranking`, sorted ascending, plus the tokenizer's special tokens; `full` = no
`output_token_ids`, the whole vocabulary) and measures, in one process, one size after another:

(a) cost: the time of one draft forward of one token on a KV cache of `--context` (150) tokens, and of the same
    step of the target, alternating draft and target for `--reps` (30) timed repetitions after `--warmup`
    untimed ones (through the engine's own runner, so the reduced head's scatter back to the full vocabulary is
    included); c = median draft time / median target time;
(b) speed: speculative decoding at temperature 0 (gamma 4, fixed unless `--adaptive`) against target-only on
    the same prompts, prompt by prompt alternating the two (so drift hits both), over `--per-category` (2)
    prompts of each category of scripts/traffic_prompts.py (held-out, evaluation only), `--max-tokens` 48:
    tokens/s, ratio to target-only, acceptance (accepted / proposed), per-token acceptance alpha (accepted /
    judged draft tokens: position i is judged only when 1..i-1 were accepted) and the share of prompts whose
    output equals target-only's.

Ranking: `vocab_ranking` in draftsmith.json (token ids by the target's probability mass, written by the
bootstrap); without it the existing `output_token_ids` in their stored order, and nothing else, so sizes beyond
that list are capped at it (sizes that give the same set are measured once). Without either only `full` runs.

Writes into --out: results.json (setup, per-size rows, per-prompt records), results.md and results.png
(tokens/s ratio to target-only and c against the kept vocabulary size).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.traffic_prompts import prompt_ids  # noqa: E402


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def read_meta(draft: Path) -> dict:
    f = draft / "draftsmith.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def ranking_of(meta: dict) -> tuple[list[int] | None, str]:
    if meta.get("vocab_ranking"):
        return [int(i) for i in meta["vocab_ranking"]], "vocab_ranking"
    if meta.get("output_token_ids"):
        return [int(i) for i in meta["output_token_ids"]], "output_token_ids (stored order)"
    return None, "none"


def make_view(draft: Path, root: Path, name: str, meta: dict, ids: list[int] | None) -> Path:
    """A folder of symlinks to every file of `draft` except draftsmith.json, which gets `output_token_ids` = ids
    (None: the key is dropped, i.e. the full vocabulary)."""
    view = root / name
    view.mkdir(parents=True)
    for p in draft.iterdir():
        if p.name != "draftsmith.json":
            os.symlink(p.resolve(), view / p.name)
    m = {k: v for k, v in meta.items() if k not in ("output_token_ids", "vocab_ranking")}
    if ids is not None:
        m["output_token_ids"] = ids
    m["vocab_view_of"] = str(draft)
    (view / "draftsmith.json").write_text(json.dumps(m))
    return view


def time_step(engine, ctx: list[int], reps: int, warmup: int) -> dict:
    """Median / mean seconds of one one-token forward on a len(ctx) KV cache, draft and target alternating."""
    from serving.engine import _Runner

    runners = {"draft": _Runner(engine.draft, engine.vocab_size), "target": _Runner(engine.target, engine.vocab_size)}
    for r in runners.values():
        r.feed(ctx, keep=1)
    times = {k: [] for k in runners}
    tok = [ctx[-1]]
    for i in range(warmup + reps):
        for k, r in runners.items():
            t0 = time.perf_counter()
            r.feed(tok, keep=1)
            dt = time.perf_counter() - t0
            r.truncate(len(ctx))
            if i >= warmup:
                times[k].append(dt)
    out = {}
    for k, ts in times.items():
        out[f"{k}_ms_median"] = round(1e3 * statistics.median(ts), 4)
        out[f"{k}_ms_mean"] = round(1e3 * statistics.fmean(ts), 4)
    out["c"] = round(out["draft_ms_median"] / out["target_ms_median"], 4)
    return out


def token_alpha(accepted_per_position: list[int], steps: int, drafted: int, gamma: int) -> float | None:
    """Accepted over judged draft tokens (Leviathan et al.'s alpha); defined here only when every step drafted
    gamma tokens (fixed gamma), where judged = steps + accepted at positions 1..gamma-1."""
    if not steps or drafted != steps * gamma or not accepted_per_position:
        return None
    judged = steps + sum(accepted_per_position[:-1])
    return sum(accepted_per_position) / judged if judged else None


def decode(engine, prompts: list[tuple[str, list[int]]], spec, max_tokens: int) -> tuple[dict, list[dict]]:
    from serving.config import SamplingParams, SpecParams

    target_spec = SpecParams(mode="target")
    # warm-up, untimed
    engine.generate_all(prompts[0][1], SamplingParams(temperature=0, top_k=0, top_p=1.0, max_tokens=8, seed=0),
                        spec, log_mode="none")
    recs = []
    for i, (cat, ids) in enumerate(prompts):
        sp = SamplingParams(temperature=0, top_k=0, top_p=1.0, max_tokens=max_tokens, seed=1000 + i)
        order = [("target", target_spec), ("spec", spec)]
        if i % 2:
            order.reverse()
        out = {}
        for label, s in order:
            t0 = time.perf_counter()
            res = engine.generate_all(ids, sp, s, log_mode="none")
            out[label] = (res, time.perf_counter() - t0)
        st = out["spec"][0].stats
        recs.append(dict(category=cat, prompt_index=i, target_tokens=len(out["target"][0].token_ids),
                         target_wall_s=round(out["target"][1], 4), spec_tokens=len(out["spec"][0].token_ids),
                         spec_wall_s=round(out["spec"][1], 4), steps=st.steps, draft_tokens=st.draft_tokens,
                         accepted_tokens=st.accepted_tokens, accepted_per_position=list(st.accepted_per_position),
                         draft_time_s=round(st.draft_time_s, 4), target_time_s=round(st.target_time_s, 4),
                         same_as_target=out["spec"][0].token_ids == out["target"][0].token_ids))
    tt = sum(r["target_tokens"] for r in recs)
    tw = sum(r["target_wall_s"] for r in recs)
    st_ = sum(r["spec_tokens"] for r in recs)
    sw = sum(r["spec_wall_s"] for r in recs)
    steps = sum(r["steps"] for r in recs)
    drafted = sum(r["draft_tokens"] for r in recs)
    accepted = sum(r["accepted_tokens"] for r in recs)
    app = [sum(x) for x in zip(*[r["accepted_per_position"] for r in recs])] if recs else []
    alpha = token_alpha(app, steps, drafted, spec.gamma)
    summary = dict(target_tokens_per_s=round(tt / tw, 3), spec_tokens_per_s=round(st_ / sw, 3),
                   ratio_to_target=round((st_ / sw) / (tt / tw), 4), steps=steps, draft_tokens=drafted,
                   accepted_tokens=accepted, acceptance=round(accepted / drafted, 4) if drafted else None,
                   token_acceptance=round(alpha, 4) if alpha is not None else None,
                   accepted_per_step=round(accepted / steps, 4) if steps else None,
                   draft_time_share=round(sum(r["draft_time_s"] for r in recs) / sw, 4),
                   same_as_target=round(sum(r["same_as_target"] for r in recs) / len(recs), 4))
    return summary, recs


def fmt(v, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def plot(rows: list[dict], path: Path, title: str, full_size: int) -> None:
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["kept"] for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot(xs, [r["ratio_to_target"] for r in rows], "o-", color="tab:blue", label="speculative, T=0")
    ax[0].axhline(1.0, color="grey", lw=1, ls="--")
    ax[0].set_ylabel("tokens/s relative to target-only")
    ax2 = ax[0].twinx()
    ax2.plot(xs, [r["token_acceptance"] if r["token_acceptance"] is not None else r["acceptance"] for r in rows],
             "s:", color="tab:green", label="per-token acceptance")
    ax2.set_ylabel("acceptance", color="tab:green")
    ax2.set_ylim(0, 1)
    ax[1].plot(xs, [r["c"] for r in rows], "o-", color="tab:red")
    ax[1].set_ylabel("c = draft / target one-token step")
    for a in ax:
        a.set_xscale("log", base=2)
        a.set_xticks(xs)
        a.set_xticklabels([r["size"] if r["size"] == "full" else str(r["kept"]) for r in rows], fontsize=8)
        a.set_xlabel(f"kept output vocabulary (full = {full_size})")
    ax[0].legend(loc="upper left", fontsize=8)
    ax2.legend(loc="upper right", fontsize=8)
    fig.suptitle(textwrap.fill(title, 150), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--draft", required=True, type=Path, help="draft folder (its draftsmith.json gives the ranking)")
    ap.add_argument("--target", default=None, help="target model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--sizes", nargs="+", default=["2048", "4096", "8192", "16384", "32768", "full"],
                    help="kept output vocabulary sizes, or `full`")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--per-category", type=int, default=2, help="prompts per traffic_prompts category")
    ap.add_argument("--context", type=int, default=150, help="KV-cache length for the one-token cost")
    ap.add_argument("--reps", type=int, default=30, help="timed one-token steps per model")
    ap.add_argument("--warmup", type=int, default=5, help="untimed one-token steps first")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--mode", default="speculative", help="decoding mode of the speed run (T=0)")
    ap.add_argument("--adaptive", action="store_true",
                    help="let the adaptive controller choose the drafted length (if SpecParams has `adaptive`); "
                         "default: a fixed gamma, so acceptance is comparable across sizes")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, choices=[None, "bfloat16", "float16", "float32"])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "vocab")
    args = ap.parse_args(argv)

    import torch

    from serving.config import SpecParams
    from serving.engine import Engine

    if not (args.draft / "config.json").is_file():
        ap.error(f"--draft {args.draft}: not a model folder (no config.json)")
    for s in args.sizes:
        if s != "full" and not (s.isdigit() and int(s) > 0):
            ap.error(f"--sizes: {s!r} is neither a positive integer nor `full`")
    if args.threads:
        torch.set_num_threads(args.threads)
    from serving.models import default_dtype

    dtype = getattr(torch, args.dtype) if args.dtype else default_dtype(args.device)
    draft = args.draft.resolve()
    meta = read_meta(draft)
    ranking, ranking_src = ranking_of(meta)

    engine = Engine.from_paths(args.target, None, device=args.device, dtype=dtype)
    tok = engine.tokenizer
    vocab = engine.vocab_size
    specials = sorted({int(i) for i in tok.all_special_ids} | set(engine.eos_token_ids))
    per_cat = prompt_ids(tok, n=args.per_category)
    prompts = [(c, ids) for c, rows in per_cat.items() for ids in rows]
    ctx: list[int] = []
    for _, ids in prompts:
        ctx += ids
    while len(ctx) < args.context:
        ctx += ctx
    ctx = ctx[: args.context]
    spec = SpecParams(mode=args.mode, gamma=args.gamma, adaptive=bool(args.adaptive))

    # the id sets to measure, deduplicated
    plan, seen = [], {}
    for s in args.sizes:
        if s == "full":
            ids, key = None, "full"
        elif ranking is None:
            progress(f"[vocab] size {s}: the draft has neither vocab_ranking nor output_token_ids; skipped")
            continue
        else:
            ids = sorted(set(ranking[: int(s)]) | set(specials))
            key = tuple(ids)
        if key in seen:
            progress(f"[vocab] size {s}: the same {len(ids)} ids as size {seen[key]} (ranking has {len(ranking)}); "
                     "measured once")
            continue
        seen[key] = s
        plan.append((s, ids))

    tmp = Path(tempfile.mkdtemp(prefix="bench_vocab_"))
    rows, records = [], []
    t_run = time.perf_counter()
    try:
        for k, (size, ids) in enumerate(plan):
            view = make_view(draft, tmp, f"v{size}", meta, ids)
            engine.swap_draft(view, f"vocab-{size}")
            kept = len(ids) if ids is not None else vocab
            t0 = time.perf_counter()
            cost = time_step(engine, ctx, args.reps, args.warmup)
            progress(f"[vocab] size {size} ({kept} ids): draft {cost['draft_ms_median']:.2f} ms, target "
                     f"{cost['target_ms_median']:.2f} ms per one-token step, c = {cost['c']:.3f} "
                     f"({time.perf_counter() - t0:.0f} s)")
            t0 = time.perf_counter()
            summary, recs = decode(engine, prompts, spec, args.max_tokens)
            progress(f"[vocab] size {size}: {args.mode} {summary['spec_tokens_per_s']:.1f} tok/s vs target "
                     f"{summary['target_tokens_per_s']:.1f} (x{summary['ratio_to_target']:.2f}), acceptance "
                     f"{fmt(summary['acceptance'])}, per-token {fmt(summary['token_acceptance'])} "
                     f"({time.perf_counter() - t0:.0f} s; {k + 1}/{len(plan)} sizes, "
                     f"{time.perf_counter() - t_run:.0f} s so far)")
            capped = ids is not None and int(size) > len(ranking)
            rows.append(dict(size=size, kept=kept, capped_by_ranking=capped, **cost, **summary))
            for r in recs:
                records.append(dict(size=size, **r))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    if not rows:
        raise SystemExit("nothing measured")
    best = max(rows, key=lambda r: r["ratio_to_target"])
    setup = (f"target={engine.target_name} draft={draft} ranking={ranking_src} ({len(ranking) if ranking else 0} ids) "
             f"device={args.device} dtype={dtype} threads={torch.get_num_threads()} cost: {args.context}-token "
             f"cache, {args.reps} reps; speed: {args.mode} T=0 gamma={args.gamma} "
             f"adaptive={spec.adaptive} {len(prompts)} traffic prompts "
             f"({args.per_category}/category) x {args.max_tokens} tokens")
    lines = [setup, "",
             "| kept ids | draft ms | target ms | c | spec tok/s | target tok/s | vs target | acceptance | "
             "per-token alpha | same as target |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['kept']}{' (full)' if r['size'] == 'full' else ''}{' (capped)' if r['capped_by_ranking'] else ''} "
                     f"| {r['draft_ms_median']:.2f} | {r['target_ms_median']:.2f} | {r['c']:.3f} | "
                     f"{r['spec_tokens_per_s']:.1f} | {r['target_tokens_per_s']:.1f} | {r['ratio_to_target']:.2f} | "
                     f"{fmt(r['acceptance'])} | {fmt(r['token_acceptance'])} | {r['same_as_target']:.0%} |")
    lines.append(f"\nFastest: {best['kept']} kept ids ({best['size']}), x{best['ratio_to_target']:.2f} target-only.")
    md = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    report = dict(setup=setup, date=time.strftime("%Y-%m-%d %H:%M"),
                  args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                  ranking_source=ranking_src, ranking_len=len(ranking) if ranking else 0, specials=specials,
                  spec=dataclasses.asdict(spec), rows=rows, best=best["size"], records=records)
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    (args.out / "results.md").write_text(md)
    plot(rows, args.out / "results.png", setup, vocab)
    print(md)
    progress(f"[vocab] wrote {args.out}/results.json, results.md, results.png in {time.perf_counter() - t_run:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
