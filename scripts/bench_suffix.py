"""Offline: how many greedy target tokens the cross-request suffix store (serving/decoding/suffix.py)
and the in-context prompt lookup (serving/decoding/ngram.py) would get accepted per step.

The teacher data's answers are the target's greedy answers, so a proposal's accepted length at answer
position t is its common prefix with answer[t:t + depth]: exactly its T=0 acceptance there. The store is
seeded with the teacher's TRAIN answers and queried on the HELD-OUT answers (distinct prompts); with
--learn each held-out answer joins the store after it has been scored, as served traffic does.

--replicas N (N > 1) serves the held-out answers round-robin from N replicas, each with its own store: without
following the replay buffer a replica's store learns only the answers it served; with it (the served default,
serving/decoding/suffix.py `BufferFollower`) every replica's store learns every answer. Rows "follow" False / True.

--traffic sql,json scores instead the target's greedy answers (generated here, batched, about a minute a category
on 2 cores) to --traffic-n requests of each online-traffic category (scripts/online_traffic.py: templated
application traffic the bootstrap never saw), in stream order, with the figures per quarter of the stream: how
fast the store learns a new category, alone and spread over replicas.

--compaction N times proposals from a second thread while the teacher's answers, cycled, fill a full-size store N
times over: how long a proposal waits while the store drops its oldest half and rebuilds its index.

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


def score(stores: list[SuffixStore], held: list[dict], depth: int, learn: bool, stride: int = 1,
          follow: bool = True, offset: int = 0) -> dict:
    """Held-out answer i is served by replica (offset + i) % len(stores) and scored on that replica's store; with
    `learn` it then joins that store, or every store with `follow`."""
    by_src: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    for i, e in enumerate(held, start=offset):
        store = stores[i % len(stores)]
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
            for other in (stores if follow else [store]):
                other.add(toks[:P], answer)
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


def traffic_examples(categories: list[str], n: int, max_tokens: int, seed: int = 0) -> list[dict]:
    """Greedy target answers to `n` requests of each category, interleaved as a replica would receive them."""
    from scripts.online_traffic import PromptStream
    from serving.engine import Engine
    from training.prompts import chat_prompt_ids
    from training.teacher import generate_teacher_data

    engine = Engine.from_paths(None, None, device="cpu")
    streams = [PromptStream(c, seed=seed * 1000 + i) for i, c in enumerate(categories)]
    texts = [(s.category, s.next()) for _ in range(n) for s in streams]
    prompts = [chat_prompt_ids(engine.tokenizer, t) for _, t in texts]
    made = generate_teacher_data(engine.target.model, engine.tokenizer, prompts, max_new_tokens=max_tokens,
                                 batch_size=16, sources=[c for c, _ in texts],
                                 progress=lambda m: print(m, flush=True))
    order = {tuple(p): i for i, p in enumerate(prompts)}            # generation ran in length order
    return sorted(made, key=lambda e: order[tuple(e["tokens"][: e["prompt_len"]])])


def quarters(stores_fn, held: list[dict], depth: int, stride: int, follow: bool) -> list[dict]:
    """`score` over the stream, reported per quarter of it (the store learning as it goes throughout)."""
    stores, out, q = stores_fn(), [], max(1, len(held) // 4)
    for k in range(0, len(held), q):
        out.append(score(stores, held[k: k + q], depth, True, stride, follow, offset=k))
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
    ap.add_argument("--replicas", type=int, nargs="+", default=[1],
                    help="also score N replicas serving round-robin, with and without following the buffer")
    ap.add_argument("--traffic", default=None, help="comma-separated online-traffic categories (e.g. sql,json)")
    ap.add_argument("--traffic-n", type=int, default=48, help="requests per --traffic category")
    ap.add_argument("--max-tokens", type=int, default=96, help="answer length for --traffic")
    ap.add_argument("--compaction", type=int, default=0, metavar="N",
                    help="instead: time proposals from a second thread while teacher answers fill a full-size store "
                         "N times over (how long a proposal waits while the oldest half is dropped)")
    ap.add_argument("--no-gc", action="store_true",
                    help="with --compaction: Python's cyclic GC off during the run, so a full collection of the "
                         "process (torch's objects among them) does not hide how long the store's lock is held")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.compaction:
        return run_compaction(args)
    if args.traffic:
        return run_traffic(args)
    train = load_examples(args.teacher)
    held = load_examples(args.teacher.with_suffix(".heldout.safetensors"))
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for support in args.min_support:
        for replicas in args.replicas:
            # (seeded, learn, follow): one replica as before; N replicas learning with and without following
            arms = ([(False, True, True), (True, False, True), (True, True, True)] if replicas == 1
                    else [(True, True, False), (True, True, True)])
            for seeded, learn, follow in arms:
                rows.append(_row(args, train, held, support, replicas, seeded, learn, follow))
    (args.out / "suffix_offline.json").write_text(json.dumps({"depth": args.depth, "train_examples": len(train),
                                                              "heldout_examples": len(held), "rows": rows},
                                                             indent=1))
    return 0


def run_compaction(args) -> int:
    """Proposal latency while the store fills and compacts: a writer adds the teacher's answers (cycled) until a
    default-capacity store has taken `--compaction` times its capacity; a reader thread proposes continuously on
    held-out contexts. Reports each proposal's wall time (p50 / p99 / max) and the writer's slowest add."""
    import threading

    import numpy as np

    from training.teacher import load_examples

    train = load_examples(args.teacher)
    held = load_examples(args.teacher.with_suffix(".heldout.safetensors")) or train
    pairs = [(e["tokens"][: e["prompt_len"]], e["tokens"][e["prompt_len"]:]) for e in train]
    contexts = [e["tokens"][: e["prompt_len"] + k] for e in held for k in range(4, len(e["tokens"]) - e["prompt_len"], 7)]
    store = SuffixStore(max_match=args.max_match, min_support=args.min_support[0])
    stop, waits, adds = threading.Event(), [], []

    def reader():
        i = 0
        while not stop.is_set():
            t = time.perf_counter()
            store.propose(contexts[i % len(contexts)], args.depth)
            waits.append(time.perf_counter() - t)
            i += 1

    import gc

    th = threading.Thread(target=reader)
    if args.no_gc:
        gc.disable()
    t0 = time.time()
    th.start()
    added, goal, i = 0, args.compaction * store.capacity, 0
    while added < goal:
        p, a = pairs[i % len(pairs)]
        t = time.perf_counter()
        store.add(p, a)
        adds.append(time.perf_counter() - t)
        added += min(len(p), store.max_match) + len(a) + 1
        i += 1
    stop.set()
    th.join()
    gc.enable()
    w, ad = np.array(waits) * 1e3, np.array(adds) * 1e3
    res = {"capacity": store.capacity, "tokens_added": added, "answers_added": i, "seconds": round(time.time() - t0, 1),
           "compactions": getattr(store, "compactions", None), "gc": not args.no_gc, "proposals": len(w),
           "propose_ms": {"p50": round(float(np.percentile(w, 50)), 3), "p99": round(float(np.percentile(w, 99)), 3),
                          "max": round(float(w.max()), 1)},
           "add_ms": {"p50": round(float(np.percentile(ad, 50)), 3), "max": round(float(ad.max()), 1)}}
    print(json.dumps(res), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "suffix_compaction_nogc.json" if args.no_gc else "suffix_compaction.json"
    (args.out / name).write_text(json.dumps(res, indent=1))
    return 0


def run_traffic(args) -> int:
    """Learning curves of the store on new traffic: one replica, and N replicas with and without following."""
    from training.teacher import load_examples

    cats = [c.strip() for c in args.traffic.split(",") if c.strip()]
    t0 = time.time()
    stream = traffic_examples(cats, args.traffic_n, args.max_tokens)
    print(f"[suffix] {len(stream)} answers, {sum(len(e['tokens']) - e['prompt_len'] for e in stream)} tokens "
          f"generated in {time.time() - t0:.0f} s", flush=True)
    train = load_examples(args.teacher) if args.teacher.is_file() else []
    args.out.mkdir(parents=True, exist_ok=True)
    rows, lines = [], ["| replicas | follow | quarter | " + " | ".join(f"{c} store / either" for c in cats) + " |",
                       "|---:|---|---:|" + "---:|" * len(cats)]
    support = args.min_support[0]
    for replicas in args.replicas:
        for follow in ((True,) if replicas == 1 else (False, True)):
            def stores():
                made = [SuffixStore(max_match=args.max_match, min_support=support) for _ in range(replicas)]
                for st in made:
                    st.add_many((e["tokens"][: e["prompt_len"]], e["tokens"][e["prompt_len"]:]) for e in train)
                return made
            curve = quarters(stores, stream, args.depth, args.stride, follow)
            rows.append({"replicas": replicas, "follow": follow, "quarters": curve})
            for i, qd in enumerate(curve):
                cells = [f"{qd[c]['store_accepted_per_pos']:.3f} / {qd[c]['either_accepted_per_pos']:.3f}"
                         if c in qd else "-" for c in cats]
                lines.append(f"| {replicas} | {'yes' if follow else 'no'} | {i + 1} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    setup = (f"greedy tokens accepted per answer position (T=0), depth {args.depth}, min_support {support}; "
             f"{args.traffic_n} requests per category ({', '.join(cats)}), max_tokens {args.max_tokens}, stores "
             f"seeded from {args.teacher if train else 'nothing'}; 'store' the store alone, 'either' the better of "
             f"it and the prompt lookup; replica i % N serves request i")
    print(setup + "\n\n" + table, flush=True)
    (args.out / "suffix_traffic.md").write_text(setup + "\n\n" + table + "\n")
    (args.out / "suffix_traffic.json").write_text(json.dumps({"setup": setup, "rows": rows}, indent=1))
    return 0


def _row(args, train, held, support, replicas, seeded, learn, follow) -> dict:
    stores = [SuffixStore(max_match=args.max_match, min_support=support) for _ in range(replicas)]
    t0 = time.time()
    if seeded:
        for store in stores:
            store.add_many((e["tokens"][: e["prompt_len"]], e["tokens"][e["prompt_len"]:]) for e in train)
    t_seed = (time.time() - t0) / replicas
    t0 = time.time()
    res = score(stores, held, args.depth, learn, args.stride, follow)
    row = {"min_support": support, "replicas": replicas, "seeded": seeded, "learn": learn, "follow": follow,
           "store_tokens": len(stores[0]), "seed_s": round(t_seed, 2), "score_s": round(time.time() - t0, 2),
           "by_source": res}
    print(f"min_support {support} replicas {replicas} seeded {seeded} learn {learn} follow {follow} "
          f"({len(stores[0])} tokens, seed {t_seed:.1f} s):", flush=True)
    for src, r in res.items():
        print(f"  {src:12s} n={r['positions']:6d} lookup {r['lookup_accepted_per_pos']:.3f} "
              f"store {r['store_accepted_per_pos']:.3f} either {r['either_accepted_per_pos']:.3f} "
              f"(store proposes at {r['store_share']:.2f}, {r['store_accepted_per_proposed_token']:.2f}"
              f" of its tokens accepted)", flush=True)
    return row


if __name__ == "__main__":
    raise SystemExit(main())
