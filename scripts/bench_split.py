"""The bootstrap's split between teacher data and training, measured offline on a saved teacher cache.

    .venv/bin/python scripts/bench_split.py [--cache data/bootstrap/teacher.safetensors] \
        [--arm 1.0:170 --arm 0.87:255 ...] [--threads 2] [--out docs/results/split]

`draftsmith bootstrap` spends `teacher_share` of its budget generating teacher data and the rest training.
Each arm `FRACTION:SECONDS` trains a fresh draft (training/draft_builder.py: the same initialisation,
vocabulary choice, loss and time-based learning-rate schedule as the bootstrap) on a random FRACTION of the
cached training examples (what a proportionally shorter teacher phase would have produced: its phases are
shares of the teacher time) for SECONDS of training, then reports held-out top-1 agreement with the target
(overall and per category) on the cache's held-out examples, which no arm trains on. Arms run one after the
other on the same cache, so their differences are the split's, not the data's. Run it alone on the machine:
training time is the budget.

Writes split.json, split.md and split.png to --out.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse_arm(text: str) -> tuple[float, float]:
    try:
        frac, secs = (float(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"an arm is FRACTION:SECONDS, e.g. 0.87:255; got {text!r}") from None
    if not (0 < frac <= 1) or secs <= 0:
        raise argparse.ArgumentTypeError(f"FRACTION must be in (0, 1] and SECONDS > 0; got {text!r}")
    return frac, secs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, default=ROOT / "data" / "bootstrap" / "teacher.safetensors",
                    help="teacher cache written by the bootstrap (its .heldout.safetensors sibling is the held-out set)")
    ap.add_argument("--target", default=None, help="target model folder (default: the converted SmolLM2 target)")
    ap.add_argument("--arm", type=parse_arm, action="append", default=None,
                    help="FRACTION:SECONDS (repeatable; default: 1.0:170, 0.87:255, 0.73:340)")
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="kept output rows (default: training/vocab.py DEFAULT_VOCAB_SIZE, as the bootstrap)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "split")
    args = ap.parse_args(argv)
    held_path = args.cache.with_suffix(".heldout.safetensors")
    if not args.cache.exists() or not held_path.exists():
        ap.error(f"no teacher cache at {args.cache} (and {held_path.name}): run `draftsmith bootstrap` first")
    arms = args.arm or [(1.0, 170.0), (0.87, 255.0), (0.73, 340.0)]

    import torch

    from serving.models import cpu_has_fast_bf16, ensure_default_target, load_causal_lm, load_tokenizer, \
        resolve_model_path
    from training.draft_builder import (choose_output_vocabulary, make_draft_from_target, per_source_agreement,
                                        train_draft)
    from training.teacher import load_examples
    from training.vocab import DEFAULT_VOCAB_SIZE

    torch.set_num_threads(args.threads)
    tpath = resolve_model_path(args.target) if args.target else ensure_default_target()
    tok = load_tokenizer(tpath)
    train_all, held = load_examples(args.cache), load_examples(held_path)
    n_all = sum(len(e["topk_ids"]) for e in train_all)
    bf16 = cpu_has_fast_bf16()
    print(f"[split] {len(train_all)} training examples ({n_all} answer tokens), {len(held)} held-out; "
          f"training {'bf16 autocast' if bf16 else 'fp32'}; arms {arms}", flush=True)
    target = load_causal_lm(tpath, "cpu", torch.float32)
    rows = []
    for frac, secs in arms:
        random.seed(args.seed)
        torch.manual_seed(args.seed)
        train = random.sample(train_all, max(1, round(frac * len(train_all)))) if frac < 1 else list(train_all)
        n_tok = sum(len(e["topk_ids"]) for e in train)
        draft = make_draft_from_target(target)
        subset, _ = choose_output_vocabulary(train, tok, args.vocab_size or DEFAULT_VOCAB_SIZE)
        t0 = time.time()
        figs = train_draft(draft, train, held, subset, deadline=time.time() + secs, bf16=bf16,
                           progress=lambda m: print(m, flush=True))
        by_src = per_source_agreement(draft, held, subset)
        row = {"fraction": frac, "train_seconds_budget": secs, "examples": len(train), "answer_tokens": n_tok,
               "steps": figs["train_steps"], "epochs": figs["epochs"],
               "heldout_top1_agreement": round(figs["heldout_top1_agreement_after"], 4),
               "by_category": by_src, "wall_s": round(time.time() - t0, 1)}
        rows.append(row)
        print(f"[split] fraction {frac} ({n_tok} tokens), {secs:.0f} s: {row['steps']} steps, "
              f"{row['epochs']} epochs, held-out agreement {row['heldout_top1_agreement']:.3f} {by_src}", flush=True)
    _write(args.out, rows, args, n_all)
    return 0


def _write(out: Path, rows: list[dict], args, n_all: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "split.json").write_text(json.dumps({"cache": str(args.cache), "answer_tokens_all": n_all,
                                                "threads": args.threads, "seed": args.seed, "arms": rows}, indent=1))
    cats = sorted({c for r in rows for c in r["by_category"]})
    lines = ["| data share | answer tokens | training s | steps | epochs | held-out agreement | "
             + " | ".join(cats) + " |", "|---:|---:|---:|---:|---:|---:|" + "---:|" * len(cats)]
    for r in rows:
        lines.append(f"| {r['fraction']:.2f} | {r['answer_tokens']} | {r['train_seconds_budget']:.0f} | {r['steps']} "
                     f"| {r['epochs']} | {r['heldout_top1_agreement']:.3f} | "
                     + " | ".join(f"{r['by_category'].get(c, float('nan')):.3f}" for c in cats) + " |")
    (out / "split.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = [f"{r['fraction']:.2f} data\n{r['train_seconds_budget']:.0f} s" for r in rows]
    ax.bar(labels, [r["heldout_top1_agreement"] for r in rows], color="tab:blue")
    for i, r in enumerate(rows):
        ax.text(i, r["heldout_top1_agreement"], f"{r['heldout_top1_agreement']:.3f}", ha="center", va="bottom")
    ax.set_ylabel("held-out top-1 agreement")
    ax.set_title("bootstrap: teacher data against training time")
    fig.tight_layout()
    fig.savefig(out / "split.png", dpi=120)


if __name__ == "__main__":
    sys.exit(main())
