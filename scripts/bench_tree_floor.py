"""How far should the heads' doubt prune their tree? Mode medusa's `node_floor`, replayed on held-out teacher data.

The bootstrap keeps held-out conversations of the target's own greedy answers
(<data dir>/bootstrap/teacher.heldout.safetensors) with the target's last hidden state at every position. At T=0 a
Medusa step from a position accepts exactly the tree path whose tokens are the target's greedy ones, and the heads
read the target's true hidden state and committed token there, so a replay over the held-out positions is a
faithful greedy decode of every step that starts there (as scripts/bench_confidence.py replays a draft chain).

For each `--floors` value and each depth 1..K of the served (width, branch) shape the replay builds the tree with
the served function (serving/decoding/medusa.py `grow_tree`) and counts: tree nodes, accepted tokens, the chain the
engine records as proposed (the accepted path continued through first children: what live accepted / proposed
counts), and a simulated speed-up over target-only from costs measured here:

    speed-up = sum(1 + accepted) / sum(verify_ms(1 + nodes) + heads_ms)  x  one_token_ms

with verify_ms the median time of a target pass over a root and n tree nodes at a --prefix-token cache
(scripts/bench_tree.py `verify_cost`) and heads_ms the median time of the heads' forward and tree for one step.
Also printed: the calibration of the path probability (share of nodes accepted per probability bin).

    .venv/bin/python scripts/bench_tree_floor.py --heads data/medusa-heads --shapes 2,1 3,1 4,1 2,2 \
        --out docs/results/tree-floor
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT_DIR))

from serving.decoding.medusa import grow_tree  # noqa: E402
from serving.decoding.tree import ROOT, tree_branching  # noqa: E402

BINS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0001)


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def replay_step(logits: torch.Tensor, labels: list[int], branching, token_ids, floor: float) -> dict:
    """One step from one position: the tree `grow_tree` builds from the heads' logits [K, V_keep], and at T=0 the
    accepted path (children whose column is the target's greedy column `labels[d]` at depth d; -1: none is).
    Returns nodes, accepted, the recorded chain's length and per node (path probability, accepted?)."""
    tree, _, depths, cols = grow_tree(logits, branching, token_ids, floor)
    logp = torch.log_softmax(logits[: len(branching)], dim=-1)
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents):
        kids.setdefault(p, []).append(i)
    path_lp: list[float] = []
    for i, p in enumerate(tree.parents):
        path_lp.append((path_lp[p] if p != ROOT else 0.0) + float(logp[depths[i], cols[i]]))
    node, accepted, on_path = ROOT, 0, set()
    while True:
        nxt = [c for c in kids.get(node, []) if labels[depths[c]] >= 0 and cols[c] == labels[depths[c]]]
        if not nxt:
            break
        node = nxt[0]
        on_path.add(node)
        accepted += 1
    chain = accepted
    while kids.get(node):                      # the engine's record: the path, then first children to a leaf
        node = kids[node][0]
        chain += 1
    return {"nodes": len(tree), "accepted": accepted, "chain": chain,
            "calibration": [(math.exp(lp), i in on_path) for i, lp in enumerate(path_lp)]}


def replay(head_logits: torch.Tensor, labels: torch.Tensor, token_ids, width: int, branch: int, floors, max_depth: int):
    """head_logits [R, K, V_keep], labels [R, K] (the target's greedy column per depth, -1: not in the kept
    vocabulary or past the answer's end). Per (floor, depth): totals over the R steps; and per floor the
    calibration of every node of the full-depth tree."""
    out = {}
    for floor in floors:
        for depth in range(1, max_depth + 1):
            br = tree_branching(depth, width, branch)
            tot = {"steps": 0, "nodes": 0, "accepted": 0, "chain": 0, "sizes": {}}
            calib = []
            for r in range(head_logits.shape[0]):
                s = replay_step(head_logits[r], labels[r].tolist(), br, token_ids, floor)
                tot["steps"] += 1
                for k in ("nodes", "accepted", "chain"):
                    tot[k] += s[k]
                tot["sizes"][s["nodes"]] = tot["sizes"].get(s["nodes"], 0) + 1
                if depth == max_depth:
                    calib += s["calibration"]
            out[(floor, depth)] = (tot, calib if depth == max_depth else None)
    return out


def calibration_table(calib: list[tuple[float, bool]]) -> list[dict]:
    rows = []
    for lo, hi in zip(BINS[:-1], BINS[1:]):
        hits = [a for p, a in calib if lo <= p < hi]
        rows.append({"bin": f"[{lo:.2f}, {min(hi, 1.0):.2f})", "nodes": len(hits),
                     "accepted": round(sum(hits) / len(hits), 4) if hits else None})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="target model folder (default: the served default)")
    ap.add_argument("--heads", type=Path, default=ROOT_DIR / "data" / "medusa-heads")
    ap.add_argument("--teacher", type=Path, default=None,
                    help="held-out teacher data (default: <data dir>/bootstrap/teacher.heldout.safetensors)")
    ap.add_argument("--floors", type=float, nargs="+", default=[0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3])
    ap.add_argument("--shapes", nargs="+", default=["2,1"],
                    help="tree shapes WIDTH,BRANCH (the served one first: its calibration is printed), compared "
                         "on one cost measurement")
    ap.add_argument("--max-rows", type=int, default=6000, help="held-out positions replayed (evenly spaced)")
    ap.add_argument("--prefix", type=int, default=200, help="cached tokens before the tree (cost part)")
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT_DIR / "docs" / "results" / "tree-floor")
    args = ap.parse_args(argv)
    if any(not 0.0 <= f < 1.0 for f in args.floors):
        ap.error("--floors must be numbers in [0, 1)")
    try:
        shapes = [tuple(int(x) for x in sh.split(",")) for sh in args.shapes]
    except ValueError:
        shapes = []
    if not shapes or any(len(sh) != 2 or min(sh) < 1 for sh in shapes):
        ap.error("--shapes takes WIDTH,BRANCH pairs of integers >= 1, e.g. 2,1 3,1")
    torch.set_num_threads(args.threads)

    from buffer.paths import data_dir
    from scripts.bench_tree import verify_cost
    from serving.decoding.medusa import MedusaHeads
    from serving.models import default_dtype, ensure_default_target, load_causal_lm, load_tokenizer, resolve_model_path
    from training.heads import HeadData, kept_index, target_hidden_rows
    from training.teacher import load_examples

    held_file = args.teacher or data_dir() / "bootstrap" / "teacher.heldout.safetensors"
    if not held_file.is_file():
        ap.error(f"no held-out teacher data at {held_file}; run `draftsmith bootstrap` first, or pass --teacher")
    tpath = resolve_model_path(args.target) if args.target else ensure_default_target()
    dtype = default_dtype("cpu")
    target = load_causal_lm(tpath, "cpu", dtype).eval()
    try:
        heads = MedusaHeads.load(args.heads, target).to(dtype)
    except (OSError, ValueError) as e:
        ap.error(str(e))
    K = heads.config.num_heads
    examples = load_examples(held_file)
    hidden = [torch.from_numpy(e["medusa_rows"]).float() for e in examples] \
        if all("medusa_rows" in e for e in examples) else target_hidden_rows(target, examples, progress=progress)
    data = HeadData(examples, hidden, K, kept_index(target, heads.output_token_ids))
    rows = torch.linspace(0, len(data) - 1, min(args.max_rows, len(data))).round().long().unique()
    progress(f"{len(examples)} held-out conversations, {len(data)} positions, replaying {len(rows)}")
    with torch.no_grad():
        logits = torch.cat([heads(data.h[rows[s:s + 512]], data.root[rows[s:s + 512]]).float().transpose(0, 1)
                            for s in range(0, len(rows), 512)])                       # [R, K, V_keep]
    labels = torch.full((len(rows), K), -1, dtype=torch.long)
    for k in range(K):
        lab = data.labels[rows, k]
        ok = lab >= 0
        labels[ok, k] = data.hard[lab[ok]]
    t0 = time.time()
    res = {sh: replay(logits, labels, heads.output_token_ids, sh[0], sh[1], args.floors, K) for sh in shapes}
    progress(f"replayed {len(shapes)} shapes x {len(args.floors)} floors x {K} depths in {time.time() - t0:.0f} s")

    # costs on this machine: a target pass over a root and n nodes; the heads' forward and tree for one step
    max_nodes = max(max(t["sizes"]) for r in res.values() for t, _ in r.values())
    cost = verify_cost(target, len(load_tokenizer(tpath)), args.prefix, list(range(1, max_nodes + 1)), args.repeats)
    verify_ms = {r["nodes"]: r["ms"] for r in cost}
    one_ms = verify_ms[0]
    h1, root1 = data.h[rows[:1]].to(dtype), data.root[rows[:1]]
    times = []
    for i in range(args.repeats):
        t1 = time.perf_counter()
        with torch.no_grad():
            lg = heads(h1, root1)[:, 0].float()
        grow_tree(lg, tree_branching(K, *shapes[0]), heads.output_token_ids, 0.05)
        times.append(time.perf_counter() - t1)
    heads_ms = statistics.median(times) * 1e3
    progress(f"one-token step {one_ms:.2f} ms; heads' forward and tree {heads_ms:.2f} ms")

    table = []
    for sh, (floor, depth), (t, _) in [(sh, key, v) for sh, r in res.items() for key, v in r.items()]:
        ms = sum(n * (verify_ms[size] + heads_ms) for size, n in t["sizes"].items())   # each step at its own size
        table.append({"shape": f"{sh[0]},{sh[1]}", "floor": floor, "depth": depth, "steps": t["steps"],
                      "nodes_per_step": round(t["nodes"] / t["steps"], 3),
                      "accepted_per_step": round(t["accepted"] / t["steps"], 4),
                      "proposed_per_step": round(t["chain"] / t["steps"], 3),
                      "accepted_per_proposed": round(t["accepted"] / max(1, t["chain"]), 4),
                      "accepted_per_node": round(t["accepted"] / max(1, t["nodes"]), 4),
                      "simulated_speedup": round((t["steps"] + t["accepted"]) / ms * one_ms, 4)})
    calib = {str(f): calibration_table(res[shapes[0]][(f, K)][1]) for f in args.floors}
    result = {"setting": f"target {tpath.name} ({dtype}), heads {args.heads} ({K} heads), tree shapes (width, "
                         f"branch, 1...) {', '.join(args.shapes)}, held-out {held_file.name}, T=0 replay, "
                         f"{args.threads} threads",
              "date": time.strftime("%Y-%m-%d"), "positions": len(rows), "one_token_ms": one_ms,
              "heads_ms": heads_ms, "verify_cost": cost, "table": table, "calibration_full_tree": calib}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    lines = [f"# The heads' tree pruned by path probability ({result['date']})", "", result["setting"], "",
             f"{len(rows)} held-out positions; one-token step {one_ms:.2f} ms, heads {heads_ms:.2f} ms per step.", "",
             "| shape | node_floor | depth | nodes / step | accepted / step | recorded proposed / step | "
             "accepted / proposed | simulated x target |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['shape']} | {r['floor']} | {r['depth']} | {r['nodes_per_step']:.2f} | {r['accepted_per_step']:.3f} | "
              f"{r['proposed_per_step']:.2f} | {r['accepted_per_proposed']:.3f} | {r['simulated_speedup']:.3f} |"
              for r in table]
    lines += ["", f"Calibration of the full-depth tree of shape {args.shapes[0]} at floor {args.floors[0]}: share of "
              "nodes accepted by path probability", "", "| path probability | nodes | accepted |", "|---|---:|---:|"]
    lines += [f"| {c['bin']} | {c['nodes']} | {c['accepted'] if c['accepted'] is not None else '-'} |"
              for c in calib[str(args.floors[0])]]
    lines += ["", "| nodes verified | target pass ms | x one-token step |", "|---:|---:|---:|"]
    lines += [f"| {r['nodes'] or '1-token step'} | {r['ms']:.2f} | {r['ratio']:.2f} |" for r in cost]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(table, args.out / "tree_floor.png")
    return 0


def plot(table: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for key in dict.fromkeys((r["shape"], r["depth"]) for r in table):
        rs = [r for r in table if (r["shape"], r["depth"]) == key]
        label = f"({key[0]}) depth {key[1]}"
        a.plot([r["floor"] for r in rs], [r["simulated_speedup"] for r in rs], marker="o", label=label)
        b.plot([r["floor"] for r in rs], [r["accepted_per_proposed"] for r in rs], marker="o", label=label)
    a.set_xlabel("node_floor")
    a.set_ylabel("simulated x target-only (T=0)")
    b.set_xlabel("node_floor")
    b.set_ylabel("accepted / proposed (recorded chain)")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
