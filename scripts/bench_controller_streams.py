"""The adaptive controller on synthetic acceptance streams: what its acceptance estimate's weights cost (issue 19).

    .venv/bin/python scripts/bench_controller_streams.py --out docs/results/controller-streams
    .venv/bin/python scripts/bench_controller_streams.py --requests 8 --seeds 1 --out /tmp/streams   # seconds, for CI

No model runs: the real `RequestController` plans a Medusa tree (3, 5, 7 verified tokens at depth 1, 2, 3, no draft
catch-up) on a cost model seeded with --costs-ms (a one-token step and the three tree sizes, measured on the
twenty-first session's host), and each step's tokens are accepted at random by a stream: the chance that the token
at depth d is accepted, given the earlier ones were, per request and step. Requests of --steps steps share one
replica (its cost model and acceptance priors), as a replica's requests do. Per stream and per DEPTH_STRENGTH value
(--strengths): tokens per second at the seeded costs (each step timed at its size's cost plus --draft-ms per
drafted depth), the share of steps that drafted nothing, and drafted tokens per step; plain target decoding is
the 1.00x. A second table replays streams of two traffic categories (odd and even requests) at the served
strength, with the replica's acceptance prior pooled over both (unlabelled traffic) and kept per category (requests
that carry `metadata.category`), each category's ratio to plain steps reported. Writes streams.md / .json / .png
into --out.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import serving.controller as cm  # noqa: E402
from serving.controller import CostModel, ReplicaPriors, RequestController  # noqa: E402

# name -> acceptance(request, step, depth index) -> probability; a depth's chance given the earlier ones accepted
STREAMS = {
    "steady 0.30 then 0.10": lambda r, s, d: 0.30 if d == 0 else 0.10,
    "steady 0.20 then 0.10": lambda r, s, d: 0.20 if d == 0 else 0.10,
    "steady 0.45 then 0.30": lambda r, s, d: 0.45 if d == 0 else 0.30,
    "hopeless 0.03": lambda r, s, d: 0.03,
    "requests alternate 0.05 / 0.40": lambda r, s, d: (0.05 if r % 2 else 0.40) if d == 0 else 0.20,
    "bursts of 16 steps, 0.50 / 0.05": lambda r, s, d: (0.05 if (s // 16) % 2 else 0.50) if d == 0 else 0.20,
}

# streams of two categories: even requests are category 0, odd ones category 1
CATEGORY_STREAMS = {
    "deep 0.80/0.70 and shallow 0.35/0.05": lambda r, s, d: (0.80 if d == 0 else 0.70) if r % 2 == 0
    else (0.35 if d == 0 else 0.05),
    "deep 0.60/0.50 and hopeless 0.03": lambda r, s, d: (0.60 if d == 0 else 0.50) if r % 2 == 0 else 0.03,
}


def replay(stream, costs_s: dict, draft_s: float, requests: int, steps: int, seed: int,
           labelled: bool = False) -> dict:
    """`labelled`: each request carries its category (request index mod 2) and the replica keeps a prior per
    category; otherwise one pooled prior."""
    rng = random.Random(seed)
    c = CostModel(weight=0.1)
    for n, t in costs_s.items():
        for _ in range(cm.WARM_OBSERVATIONS + 1):
            c.observe_target(n, t)
    c.observe_draft("medusa", 1, draft_s)
    priors = ReplicaPriors(prior=0.5)
    tokens = seconds = drafted = 0.0
    plain = total = 0
    per_cat = [[0.0, 0.0], [0.0, 0.0]]      # category -> [tokens, seconds]
    for r in range(requests):
        ctrl = RequestController(gamma=3, costs=c, priors=priors, version="v", greedy=True, draft_key="medusa",
                                 catches_up=False, verify_tokens=lambda k: 2 * k + 1,
                                 category=f"c{r % 2}" if labelled else "")
        for s in range(steps):
            plan = ctrl.plan(0)
            a = 0
            while a < plan.k and rng.random() < stream(r, s, a):
                a += 1
            ctrl.observe(plan, a)
            t = costs_s[ctrl.verified(plan.k)] + draft_s * plan.k
            tokens += a + 1
            seconds += t
            per_cat[r % 2][0] += a + 1
            per_cat[r % 2][1] += t
            drafted += plan.k
            plain += plan.k == 0
            total += 1
    out = {"tokens_per_s": tokens / seconds, "plain_share": plain / total, "drafted_per_step": drafted / total}
    for i, (n, t) in enumerate(per_cat):
        if t:
            out[f"category_{i}_tokens_per_s"] = n / t
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strengths", type=float, nargs="+", default=[4.0, 8.0, 16.0])
    ap.add_argument("--costs-ms", type=float, nargs=4, default=[43.0, 46.0, 54.0, 60.0],
                    metavar=("T1", "T3", "T5", "T7"), help="target pass of 1, 3, 5, 7 tokens, ms")
    ap.add_argument("--draft-ms", type=float, default=1.0, help="the heads' time per drafted depth, ms")
    ap.add_argument("--requests", type=int, default=150)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if any(s <= 0 for s in args.strengths) or args.requests < 1 or args.steps < 1 or args.seeds < 1:
        ap.error("--strengths must be > 0 and --requests, --steps, --seeds >= 1")
    costs_s = {n: ms / 1000 for n, ms in zip((1, 3, 5, 7), args.costs_ms)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plain_rate = 1.0 / costs_s[1]
    rows, t0, saved = [], time.time(), cm.DEPTH_STRENGTH
    try:
        for strength in args.strengths:
            cm.DEPTH_STRENGTH = strength
            for name, stream in STREAMS.items():
                runs = [replay(stream, costs_s, args.draft_ms / 1000, args.requests, args.steps, seed)
                        for seed in range(args.seeds)]
                row = {"strength": strength, "stream": name}
                for key in runs[0]:
                    row[key] = statistics.mean(run[key] for run in runs)
                row["ratio_to_target"] = row["tokens_per_s"] / plain_rate
                rows.append(row)
                print(f"[streams] strength {strength:g} {name}: {row['ratio_to_target']:.3f}x, "
                      f"{row['plain_share']:.0%} plain ({time.time() - t0:.0f} s)", flush=True)
    finally:
        cm.DEPTH_STRENGTH = saved
    cat_rows = []
    for name, stream in CATEGORY_STREAMS.items():
        for labelled in (False, True):
            runs = [replay(stream, costs_s, args.draft_ms / 1000, args.requests, args.steps, seed, labelled)
                    for seed in range(args.seeds)]
            row = {"stream": name, "priors": "per category" if labelled else "pooled"}
            for key in runs[0]:
                row[key] = statistics.mean(run[key] for run in runs)
            row["ratio_to_target"] = row["tokens_per_s"] / plain_rate
            for i in (0, 1):
                row[f"category_{i}_ratio"] = row.get(f"category_{i}_tokens_per_s", 0.0) / plain_rate
            cat_rows.append(row)
            print(f"[streams] {name}, {row['priors']} priors: {row['ratio_to_target']:.3f}x (categories "
                  f"{row['category_0_ratio']:.3f}x / {row['category_1_ratio']:.3f}x, {time.time() - t0:.0f} s)",
                  flush=True)
    (out / "streams.json").write_text(json.dumps({"args": vars(args), "served_strength": saved, "rows": rows,
                                                  "category_rows": cat_rows}, indent=1))
    lines = [f"Controller on synthetic streams: {args.requests} requests x {args.steps} steps x {args.seeds} seeds, "
             f"costs {args.costs_ms} ms (1/3/5/7 tokens) + {args.draft_ms} ms per drafted depth; ratio to plain "
             f"target steps; served DEPTH_STRENGTH {saved:g}", "",
             "| stream | " + " | ".join(f"strength {s:g}: ratio, plain steps" for s in args.strengths) + " |",
             "|---|" + "---:|" * len(args.strengths)]
    for name in STREAMS:
        cells = [next(r for r in rows if r["stream"] == name and r["strength"] == s) for s in args.strengths]
        lines.append(f"| {name} | " + " | ".join(f"{c['ratio_to_target']:.3f}x, {c['plain_share']:.0%}"
                                                 for c in cells) + " |")
    lines += ["", f"Two categories (even / odd requests) at DEPTH_STRENGTH {saved:g}: the replica's acceptance prior "
              "pooled (unlabelled traffic) or per category (metadata.category); ratio to plain target steps", "",
              "| stream | priors | all | category 0 | category 1 | drafted per step |", "|---|---|---:|---:|---:|---:|"]
    for r in cat_rows:
        lines.append(f"| {r['stream']} | {r['priors']} | {r['ratio_to_target']:.3f}x | {r['category_0_ratio']:.3f}x | "
                     f"{r['category_1_ratio']:.3f}x | {r['drafted_per_step']:.2f} |")
    (out / "streams.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(9, 4))
        width = 0.8 / len(args.strengths)
        for i, s in enumerate(args.strengths):
            vals = [next(r["ratio_to_target"] for r in rows if r["stream"] == n and r["strength"] == s)
                    for n in STREAMS]
            ax.bar([j + i * width for j in range(len(STREAMS))], vals, width, label=f"DEPTH_STRENGTH {s:g}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(STREAMS))])
        ax.set_xticklabels(list(STREAMS), rotation=20, ha="right", fontsize=7)
        ax.set_ylabel("tokens/s over plain target steps")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "streams.png", dpi=120)
    except ImportError:
        print("[streams] matplotlib missing: no plot", file=sys.stderr)
    print(f"[streams] wrote {out}/streams.md, streams.json, streams.png in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
