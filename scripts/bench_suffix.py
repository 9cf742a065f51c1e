"""Offline: how many greedy target tokens the cross-request suffix store (serving/decoding/suffix.py)
and the in-context prompt lookup (serving/decoding/ngram.py) would get accepted per step.

The teacher data's answers are the target's greedy answers, so a proposal's accepted length at answer
position t is its common prefix with answer[t:t + depth]: exactly its T=0 acceptance there. The store is
seeded with the teacher's TRAIN answers and queried on the HELD-OUT answers (distinct prompts); with
--learn each held-out answer joins the store after it has been scored, as served traffic does.

    .venv/bin/python scripts/bench_suffix.py --out docs/results/suffix-offline
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving.decoding.ngram import ngram_propose  # noqa: E402
from serving.decoding.suffix import SuffixStore  # noqa: E402


def _accepted(path: list[int], truth: list[int]) -> int:
    n = 0
    for a, b in zip(path, truth):
        if a != b:
            break
        n += 1
    return n


def score(store: SuffixStore, held: list[dict], depth: int, learn: bool, stride: int = 1) -> dict:
    by_src: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    for e in held:
        P, toks = e["prompt_len"], e["tokens"]
        answer = toks[P:]
        s = by_src[e.get("source", "") or "all"]
        for t in range(0, len(answer) - 1, stride):
            ctx = toks[: P + t]
            truth = answer[t: t + depth]
            look = ngram_propose(ctx, 3, depth, 2)
            suf = store.propose(ctx, depth)
            a_look, a_suf = _accepted(look, truth), _accepted(suf, truth)
            s["positions"] += 1
            s["lookup_proposed"] += bool(look)
            s["store_proposed"] += bool(suf)
            s["lookup_accepted"] += a_look
            s["store_accepted"] += a_suf
            s["either_accepted"] += max(a_look, a_suf)
            s["store_tokens"] += len(suf)
        if learn:
            store.add(toks[:P], answer)
    out = {}
    for src, s in sorted(by_src.items()):
        n = max(s["positions"], 1)
        out[src] = {"positions": int(s["positions"]),
                    "lookup_share": s["lookup_proposed"] / n, "store_share": s["store_proposed"] / n,
                    "lookup_accepted_per_pos": s["lookup_accepted"] / n,
                    "store_accepted_per_pos": s["store_accepted"] / n,
                    "either_accepted_per_pos": s["either_accepted"] / n,
                    "store_accepted_per_proposed_token": s["store_accepted"] / max(s["store_tokens"], 1)}
    return out


def main(argv=None) -> int:
    from buffer.paths import data_dir
    from training.teacher import load_examples

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher", type=Path, default=data_dir() / "bootstrap" / "teacher.safetensors")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--min-support", type=float, nargs="+", default=[0.5])
    ap.add_argument("--max-match", type=int, default=12)
    ap.add_argument("--stride", type=int, default=1, help="score every STRIDE-th answer position")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    train = load_examples(args.teacher)
    held = load_examples(args.teacher.with_suffix(".heldout.safetensors"))
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for support in args.min_support:
        for seeded in (False, True):
            for learn in (False, True):
                if not seeded and not learn:
                    continue
                store = SuffixStore(max_match=args.max_match, min_support=support)
                t0 = time.time()
                if seeded:
                    store.add_many((e["tokens"][: e["prompt_len"]], e["tokens"][e["prompt_len"]:]) for e in train)
                t_seed = time.time() - t0
                t0 = time.time()
                res = score(store, held, args.depth, learn, args.stride)
                row = {"min_support": support, "seeded": seeded, "learn": learn, "store_tokens": len(store),
                       "seed_s": round(t_seed, 2), "score_s": round(time.time() - t0, 2), "by_source": res}
                rows.append(row)
                print(f"min_support {support} seeded {seeded} learn {learn} ({len(store)} tokens, seed "
                      f"{t_seed:.1f} s):", flush=True)
                for src, r in res.items():
                    print(f"  {src:12s} n={r['positions']:6d} lookup {r['lookup_accepted_per_pos']:.3f} "
                          f"store {r['store_accepted_per_pos']:.3f} either {r['either_accepted_per_pos']:.3f} "
                          f"(store proposes at {r['store_share']:.2f}, {r['store_accepted_per_proposed_token']:.2f}"
                          f" of its tokens accepted)", flush=True)
    (args.out / "suffix_offline.json").write_text(json.dumps({"depth": args.depth, "train_examples": len(train),
                                                              "heldout_examples": len(held), "rows": rows},
                                                             indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
