"""When should a draft chain stop? Its own confidence against the target's verdict, on held-out teacher data.

The bootstrap keeps held-out conversations of the target's own greedy answers
(<data dir>/bootstrap/teacher.heldout.safetensors). One teacher-forced draft pass over them gives, at every
answer position, the draft's greedy token, its confidence (the largest probability of its raw softmax over
the kept vocabulary) and whether the target agrees. At temperature 0 a speculative step that drafts from a
position is accepted exactly up to the first disagreement, and the draft's inputs before that point are the
target's own tokens, so a teacher-forced pass replays greedy speculative decoding exactly (the draft
tokens after a rejection are proposed on a wrong prefix; their confidence is approximated by the
teacher-forced one, which only matters for the stop rule's cost).

Printed and written (`--out`): calibration (agreement by confidence bin) and the simulated speed-up over
target-only of
  - fixed draft lengths k = 1..8,
  - "stop": draft up to `max_k` tokens, ending the chain after a token whose confidence is below a threshold,
with step cost  drafted * c + 1 + slope * drafted  target steps (c: a draft token over a target step;
slope: what one more verified token adds to a target pass). serving/controller.py uses the chosen
threshold (STOP_CONFIDENCE).

    .venv/bin/python scripts/bench_confidence.py --draft data/bootstrap-draft --out docs/results/confidence
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from buffer.paths import data_dir  # noqa: E402


def positions(draft_dir: Path, held_file: Path, threads: int) -> dict[str, np.ndarray]:
    """Per answer position: draft confidence, agreement with the target, example index, source index."""
    from serving.models import load_causal_lm
    from training.draft_builder import _batch, _hidden_rows
    from training.teacher import load_examples

    torch.set_num_threads(threads)
    draft = load_causal_lm(draft_dir, "cpu", torch.float32).eval()
    meta = json.loads((draft_dir / "draftsmith.json").read_text())
    vocab = draft.get_input_embeddings().weight.shape[0]
    subset = torch.tensor(meta["output_token_ids"], dtype=torch.long) if meta.get("output_token_ids") \
        else torch.arange(vocab)
    vocab_index = torch.full((vocab + 1,), -1, dtype=torch.long)
    vocab_index[subset] = torch.arange(len(subset))
    out_w = draft.get_output_embeddings().weight.detach()[subset]
    examples = load_examples(held_file)
    sources = sorted({e.get("source", "") for e in examples})
    conf, agree, ex, src = [], [], [], []
    with torch.no_grad():
        for i, e in enumerate(examples):
            b = _batch([e], vocab_index)
            p = torch.softmax((_hidden_rows(draft, b) @ out_w.T).float(), dim=-1)
            c, a = p.max(-1)
            conf.append(c.numpy())
            agree.append((a == b["hard"]).numpy())
            ex.append(np.full(len(c), i))
            src.append(np.full(len(c), sources.index(e.get("source", ""))))
    return {"conf": np.concatenate(conf), "agree": np.concatenate(agree), "example": np.concatenate(ex),
            "source": np.concatenate(src), "sources": sources}


def simulate(conf: np.ndarray, agree: np.ndarray, example: np.ndarray, *, max_k: int, threshold: float,
             c: float, slope: float) -> dict:
    """Greedy speculative decoding replayed over every example: tokens, cost (target steps), drafted,
    accepted."""
    tokens = cost = drafted_all = accepted_all = 0.0
    for e in np.unique(example):
        idx = np.flatnonzero(example == e)
        cf, ag = conf[idx], agree[idx]
        n, pos = len(idx), 0
        while pos < n:
            drafted = accepted = 0
            ok = True
            while drafted < max_k and pos + drafted < n:
                j = pos + drafted
                drafted += 1
                if ok and ag[j]:
                    accepted += 1
                else:
                    ok = False
                if cf[j] < threshold:
                    break
            emitted = min(accepted + 1, n - pos)
            tokens += emitted
            cost += drafted * c + 1 + slope * drafted
            drafted_all += drafted
            accepted_all += accepted
            pos += emitted
    return {"speedup": tokens / cost, "acceptance": accepted_all / max(1.0, drafted_all),
            "tokens_per_step": tokens / max(1.0, cost - drafted_all * (c + slope))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", type=Path, default=data_dir() / "bootstrap-draft")
    ap.add_argument("--heldout", type=Path, default=data_dir() / "bootstrap" / "teacher.heldout.safetensors")
    ap.add_argument("--c", type=float, nargs="+", default=[0.1], help="draft token / target step")
    ap.add_argument("--slope", type=float, nargs="+", default=[0.03, 0.08],
                    help="extra target time per extra verified token, relative to a one-token step")
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    ap.add_argument("--max-k", type=int, nargs="+", default=[4, 6, 8])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    for path, what in ((args.draft, "draft folder"), (args.heldout, "held-out teacher data")):
        if not path.exists():
            ap.error(f"{what} {path} not found: run `draftsmith bootstrap` first, or pass the path")
    t0 = time.time()
    d = positions(args.draft, args.heldout, args.threads)
    print(f"[confidence] {len(d['conf'])} held-out positions in {time.time() - t0:.1f} s, "
          f"agreement {d['agree'].mean():.3f}")
    bins = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0001]
    calib = []
    for lo, hi in zip(bins[:-1], bins[1:]):
        m = (d["conf"] >= lo) & (d["conf"] < hi)
        calib.append({"bin": f"{lo:.1f}-{min(hi, 1):.1f}", "share": float(m.mean()),
                      "agreement": float(d["agree"][m].mean()) if m.any() else None})
    lines = ["# Draft confidence against the target's verdict", "",
             f"Draft `{args.draft}`, held-out `{args.heldout}`: {len(d['conf'])} positions, "
             f"agreement {d['agree'].mean():.3f}. Greedy (T=0) speculative decoding replayed exactly.", "",
             "| draft confidence | share of positions | agreement with target |", "|---|---:|---:|"]
    lines += ["| {} | {:.3f} | {} |".format(r["bin"], r["share"], "-" if r["agreement"] is None
                                              else "{:.3f}".format(r["agreement"])) for r in calib]
    sims = []
    for c in args.c:
        for slope in args.slope:
            rows = []
            for k in range(1, 9):
                rows.append({"policy": f"fixed k={k}", "max_k": k, "threshold": 0.0,
                             **simulate(d["conf"], d["agree"], d["example"], max_k=k, threshold=0.0, c=c,
                                        slope=slope)})
            for k in args.max_k:
                for th in args.thresholds:
                    rows.append({"policy": f"stop <{th:.1f}, k<={k}", "max_k": k, "threshold": th,
                                 **simulate(d["conf"], d["agree"], d["example"], max_k=k, threshold=th, c=c,
                                            slope=slope)})
            best_fixed = max((r for r in rows if r["threshold"] == 0), key=lambda r: r["speedup"])
            best_stop = max((r for r in rows if r["threshold"] > 0), key=lambda r: r["speedup"])
            sims.append({"c": c, "slope": slope, "rows": rows, "best_fixed": best_fixed, "best_stop": best_stop})
            lines += ["", f"## c = {c}, slope = {slope}", "",
                      f"best fixed: {best_fixed['policy']} {best_fixed['speedup']:.3f}x; best stop: "
                      f"{best_stop['policy']} {best_stop['speedup']:.3f}x", "",
                      "| policy | x target (simulated) | acceptance (accepted / proposed) | tokens / step |",
                      "|---|---:|---:|---:|"]
            lines += [f"| {r['policy']} | {r['speedup']:.3f} | {r['acceptance']:.3f} | {r['tokens_per_step']:.2f} |"
                      for r in rows]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text(text + "\n")
        (args.out / "results.json").write_text(json.dumps({"calibration": calib, "simulations": sims,
                                                           "positions": int(len(d["conf"]))}, indent=1))
        print(f"[confidence] wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
