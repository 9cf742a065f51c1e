"""One heads-job lever at a time on a served buffer (issue 15): the same Medusa heads job, from the same parent
heads, on the same replay buffer, under several job settings (the training window `max_records`, the replay
share, the rate, the budget), each candidate scored per traffic category on one fixed held-out sample.

    .venv/bin/python scripts/bench_heads_window.py --redis-dir data/bench-online-1/redis \
        --parent data/medusa-heads [--parent DIR ...] --arm max_records=4000 --arm max_records=16000 \
        [--set budget_s=120 ...] [--eval-records 3000] [--prefix draftsmith:buf] [--out docs/results/heads-window]

`--redis-dir` is an embedded Redis folder holding a served replay buffer (scripts/bench_online.py leaves one in
its data dir); it is copied first, so the original is not touched. Each arm runs training/heads_job.py
`run_heads_distillation` in this process (the job's own held-out early stopping, its hidden-state cache shared
by every arm). The score is the heads gate's (deploy/heads.py `score_heads`): accepted / proposed of a greedy
chain of the K heads at T = 0, per held-out request, weighted by its positions; here averaged per traffic
category on the newest `--eval-records` held-out steps of the buffer (the split no job trains on), and for
each parent too ("before"). Prints and writes heads-window.md / .json and a PNG of the figures per category.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def per_category(scores: dict[str, dict], examples: list[dict]) -> dict[str, float]:
    """{category: positions-weighted mean acceptance, "all": over every request} of `score_heads` output."""
    sums: dict[str, list[float]] = {}
    for e in examples:
        s = scores.get(e["request_id"])
        if s is None:
            continue
        for key in (e.get("source") or "unlabelled", "all"):
            acc = sums.setdefault(key, [0.0, 0.0])
            acc[0] += s["acceptance"] * s["positions"]
            acc[1] += s["positions"]
    return {k: round(a / w, 4) for k, (a, w) in sorted(sums.items()) if w}


def parse_settings(spec: str, ap: argparse.ArgumentParser) -> dict:
    from training.job import _parse_value

    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key:
            ap.error(f"settings are KEY=VALUE[,KEY=VALUE], got {item!r}")
        out[key.strip()] = _parse_value(value.strip())
    return out


def plot(rows: list[dict], before: dict[str, dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = sorted({c for r in rows for c in r["after"]} - {"all"}) + ["all"]
    parents = list(before)
    fig, axes = plt.subplots(1, len(parents), figsize=(6 * len(parents), 4), squeeze=False)
    for ax, parent in zip(axes[0], parents):
        bars = [("parent", before[parent])] + [(r["arm"], r["after"]) for r in rows if r["parent"] == parent]
        width = 0.8 / len(bars)
        for i, (label, figs) in enumerate(bars):
            ax.bar([j + i * width for j in range(len(cats))], [figs.get(c, 0.0) for c in cats], width, label=label)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cats))], cats)
        ax.set_ylabel("held-out chain acceptance (accepted / proposed, T=0)")
        ax.set_title(f"from {Path(parent).name}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--redis-dir", type=Path, required=True, help="an embedded Redis folder with a served buffer")
    ap.add_argument("--parent", type=Path, action="append", required=True, help="parent heads folder (repeatable)")
    ap.add_argument("--arm", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                    help="one arm's heads-job settings (repeatable; default: the job's defaults alone)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a setting for every arm")
    ap.add_argument("--eval-records", type=int, default=3000, help="held-out steps scored per category")
    ap.add_argument("--prefix", default="draftsmith:buf")
    ap.add_argument("--target", default=None, help="target model folder (default: the served default)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "heads-window")
    args = ap.parse_args(argv)
    if not (args.redis_dir / "dump.rdb").is_file():
        ap.error(f"{args.redis_dir} holds no dump.rdb: pass the embedded Redis folder of a served buffer")
    for p in args.parent:
        if not (p / "medusa_heads.json").is_file():
            ap.error(f"{p} is not a Medusa heads folder (no medusa_heads.json)")
    extra = parse_settings(",".join(args.set), ap)
    arms = [(spec, parse_settings(spec, ap)) for spec in args.arm] or [("defaults", {})]

    from buffer.embedded import from_snapshot
    from deploy.heads import score_heads
    from serving.models import default_dtype, load_causal_lm, resolve_model_path
    from training.heads_job import read_examples, run_heads_distillation
    from training.hidden_cache import hidden_cache_for

    work = Path(tempfile.mkdtemp(prefix="bench-heads-window-"))
    server = from_snapshot(args.redis_dir, work)
    url = server.start()
    rows, before = [], {}
    try:
        tpath = resolve_model_path(args.target)
        target = load_causal_lm(tpath, "cpu", default_dtype("cpu"))
        cache = hidden_cache_for(tpath, default_dtype("cpu"))
        examples, window = read_examples(redis_url=url, buffer_prefix=args.prefix, n=args.eval_records, heldout=True,
                                         heldout_fraction=extra.get("heldout_fraction", 0.1))
        print(f"[window] eval sample: {len(examples)} held-out requests ({window['steps']} steps)", flush=True)
        hidden = None
        for parent in args.parent:
            scores, hidden = score_heads(target, parent, examples, hidden, cache=cache)
            before[str(parent)] = per_category(scores, examples)
            print(f"[window] parent {parent}: {before[str(parent)]}", flush=True)
            for label, over in arms:
                cfg = {**extra, **over, "parent_heads": str(parent), "redis_url": url, "buffer_prefix": args.prefix,
                       "target": args.target, "out_dir": str(work / f"cand-{len(rows)}")}
                print(f"[window] {label} from {parent}", flush=True)
                t0 = time.time()
                out = run_heads_distillation(cfg, progress=lambda m: print("   ", m, flush=True))
                wall = time.time() - t0
                meta = json.loads((out / "candidate.json").read_text())
                scores, hidden = score_heads(target, out, examples, hidden, cache=cache)
                rows.append({"parent": str(parent), "arm": label, "settings": {**extra, **over}, "wall_s": round(wall, 1),
                             "train_requests": meta["data_window"]["requests"],
                             "train_steps": meta["data_window"]["steps"],
                             "replay_steps": meta["data_window"]["replay"]["steps"],
                             "epochs": meta["metrics"]["epochs"], "best_epoch": meta["metrics"]["best_epoch"],
                             "job_heldout": [meta["metrics"]["offline_acceptance_before"],
                                             meta["metrics"]["offline_acceptance_after"]],
                             "after": per_category(scores, examples)})
                print(f"[window] {label}: {rows[-1]['after']} in {wall:.0f} s", flush=True)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    cats = sorted({c for r in rows for c in r["after"]} - {"all"}) + ["all"]
    lines = [f"buffer={args.redis_dir} eval={len(examples)} held-out requests ({window['steps']} steps) "
             f"settings={extra or 'defaults'}", "",
             "Held-out chain acceptance (accepted / proposed of a greedy chain of the heads, T=0), per category.", "",
             "| parent | arm | train requests (steps + replay) | epochs (best) | job s | "
             + " | ".join(cats) + " |", "|---|---|---:|---:|---:|" + "---:|" * len(cats)]
    for parent, figs in before.items():
        lines.append(f"| {Path(parent).name} | (parent) | | | | " + " | ".join(f"{figs.get(c, 0):.3f}" for c in cats)
                     + " |")
        for r in (r for r in rows if r["parent"] == parent):
            lines.append(f"| {Path(parent).name} | {r['arm']} | {r['train_requests']} ({r['train_steps']} + "
                         f"{r['replay_steps']}) | {r['epochs']} ({r['best_epoch']}) | {r['wall_s']:.0f} | "
                         + " | ".join(f"{r['after'].get(c, 0):.3f} ({r['after'].get(c, 0) - figs.get(c, 0):+.3f})"
                                      for c in cats) + " |")
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "heads-window.md").write_text(table + "\n")
    (args.out / "heads-window.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                            "before": before, "rows": rows}, indent=1))
    plot(rows, before, args.out / "heads-window.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
