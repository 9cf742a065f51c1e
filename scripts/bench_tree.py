"""Tree verification on this machine (issue 19, step 2): what a tree of N candidates costs the target, and
what top-k trees from the standalone draft buy end to end.

    .venv/bin/python scripts/bench_tree.py --draft data/bootstrap-draft --out docs/results/tree
    .venv/bin/python scripts/bench_tree.py --tiny --out /tmp/tree-smoke          # seconds, random models

(a) Verification cost: the target holds a --prefix-token cache; one verification pass over [root] + N tree
    nodes (tree attention mask, serving/decoding/tree.py) against a one-token target step, median of
    --repeats, N in --nodes. Two passes: the output layer on every row, and as served (the output layer on
    the rows a tree rule reads, `verdict_on_demand`: the root, nodes with children, and one leaf).
(b) End to end at T=0: plain target greedy decoding against `tree_generate` with each --branching, on the
    traffic prompts of scripts/traffic_prompts.py (written for benchmarks, never trained on), --prompts per
    category, --max-tokens new tokens; outputs are checked equal to target greedy (T=0 is lossless).
    Reported: tokens/s, ratio to target-only (same run, prompt by prompt interleaved), tokens per target
    pass (accepted + 1), nodes verified per pass.

Writes results.json, results.md and tree.png into --out. Single sequence, batch 1, torch threads as set.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT_DIR))

from serving.decoding.tree import (ROOT, DraftTree, feed_masked, inner_rows, keep_path, tree_forward,  # noqa: E402
                                   tree_forward_hidden, tree_generate)


def progress(msg: str) -> None:
    print(f"[tree {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_branching(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"branching must look like 4,2,1, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"branching needs positive ints, got {text!r}")
    return out


def tree_nodes(branching: tuple[int, ...]) -> int:
    n, width = 0, 1
    for b in branching:
        width *= b
        n += width
    return n


def causal_feed(model, ids, cache, start):
    n = len(ids)
    return feed_masked(model, ids, torch.ones(n, start + n, dtype=torch.bool).tril(start),
                       torch.arange(start, start + n), cache)


def verify_cost(target, vocab: int, prefix: int, nodes: list[int], repeats: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (prefix + 1,), generator=g).tolist()
    _, cache = causal_feed(target, ids[:-1], None, 0)
    device = next(target.parameters()).device

    def sync() -> None:                       # a GPU runs asynchronously: time the work, not its launch
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(fn) -> float:
        times = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
            keep_path(cache, prefix - 1, [])      # back to the prefix: drop the root and any tree
        return statistics.median(times)

    for n in [0] + list(nodes):                # warm-up: a shape's first passes run cold (allocations, kernels)
        warm = DraftTree(tuple(ids[:n]), tuple(ROOT if i % 4 == 0 else i - 1 for i in range(n)))
        for _ in range(3):
            tree_forward(target, warm, ids[-1], cache, prefix) if n else causal_feed(target, ids[-1:], cache, prefix)
            keep_path(cache, prefix - 1, [])

    def served(tree: DraftTree) -> None:         # the engine's pass: the output layer on the rows a rule reads
        _, h, _ = tree_forward_hidden(target, tree, ids[-1], cache, prefix, logits=False)
        with torch.no_grad():
            target.get_output_embeddings()(h[inner_rows(tree) + [1 + tree.chain_from([])[-1]]]).float()

    one = timed(lambda: causal_feed(target, ids[-1:], cache, prefix))
    rows = [{"nodes": 0, "ms": one * 1e3, "ratio": 1.0, "served_ms": one * 1e3, "served_ratio": 1.0}]
    progress(f"one-token target step at a {prefix}-token cache: {one * 1e3:.2f} ms")
    for n in nodes:
        # chains of 4 under the root: the shape matters little, the query count does
        tree = DraftTree(tuple(torch.randint(0, vocab, (n,), generator=g).tolist()),
                         tuple(ROOT if i % 4 == 0 else i - 1 for i in range(n)))
        t = timed(lambda: tree_forward(target, tree, ids[-1], cache, prefix))
        s = timed(lambda: served(tree))
        rows.append({"nodes": n, "ms": t * 1e3, "ratio": t / one, "served_ms": s * 1e3, "served_ratio": s / one})
        progress(f"tree of {n:>2} nodes: {t * 1e3:.2f} ms = {t / one:.2f}x a one-token step; as served "
                 f"(output rows the rule reads) {s * 1e3:.2f} ms = {s / one:.2f}x")
    return rows


def target_greedy(target, prompt: list[int], n: int, eos: int | None) -> list[int]:
    logits, cache = causal_feed(target, prompt, None, 0)
    out = []
    length = len(prompt)
    while len(out) < n:
        tok = int(logits[-1].argmax())
        out.append(tok)
        if tok == eos:
            break
        logits, cache = causal_feed(target, [tok], cache, length)
        length += 1
    return out


def end_to_end(target, draft, draft_map, prompts: dict[str, list[list[int]]], branchings, max_tokens: int,
               eos: int | None) -> dict:
    totals = {"target": {"tokens": 0, "s": 0.0}}
    for b in branchings:
        totals[str(b)] = {"branching": list(b), "tree_nodes": tree_nodes(b), "tokens": 0, "s": 0.0, "steps": 0,
                          "accepted": 0, "nodes": 0, "mismatches": 0}
    done = 0
    count = sum(len(v) for v in prompts.values())
    t_start = time.time()
    for cat, plist in prompts.items():
        for prompt in plist:
            t0 = time.perf_counter()
            ref = target_greedy(target, prompt, max_tokens, eos)
            totals["target"]["s"] += time.perf_counter() - t0
            totals["target"]["tokens"] += len(ref)
            for b in branchings:
                t0 = time.perf_counter()
                out, stats = tree_generate(target, draft, prompt, max_tokens, b, eos_id=eos, draft_map=draft_map)
                row = totals[str(b)]
                row["s"] += time.perf_counter() - t0
                row["tokens"] += len(out)
                row["steps"] += stats.steps
                row["accepted"] += stats.accepted
                row["nodes"] += stats.nodes
                row["mismatches"] += int(out != ref)
            done += 1
            rate = done / (time.time() - t_start)
            progress(f"{done}/{count} prompts ({cat}), {rate * 60:.1f} prompts/min")
    base = totals["target"]["tokens"] / totals["target"]["s"]
    for key, row in totals.items():
        row["tokens_per_s"] = row["tokens"] / row["s"]
        row["ratio"] = row["tokens_per_s"] / base
        if key != "target":
            row["tokens_per_pass"] = (row["accepted"] + row["steps"]) / row["steps"]
            row["nodes_per_pass"] = row["nodes"] / row["steps"]
    return totals


def served_draft(draft_path: Path, target, tok, target_path):
    """The draft as the engine serves it (its output layer cut to the version's vocabulary rows) and the map of
    its logits back to the full vocabulary: (model, logits map)."""
    from serving.engine import Engine
    from serving.models import LoadedModel
    from serving.runner import full_vocab_logits

    loaded = Engine._load_draft(draft_path, LoadedModel(target, tok, target_path), "cpu",
                                next(target.parameters()).dtype)
    return loaded.model, lambda x: full_vocab_logits(x, loaded, len(tok))


def tiny_models(vocab: int = 259):
    from transformers import LlamaConfig, LlamaForCausalLM

    def make(seed, layers):
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
        return LlamaForCausalLM(cfg).eval()

    return make(0, 2), make(0, 1), vocab


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="target model folder (default: the served default)")
    ap.add_argument("--draft", type=Path, default=ROOT_DIR / "data" / "bootstrap-draft")
    ap.add_argument("--out", type=Path, default=ROOT_DIR / "docs" / "results" / "tree")
    ap.add_argument("--tiny", action="store_true", help="random tiny models: a smoke run in seconds")
    ap.add_argument("--prefix", type=int, default=200, help="cached tokens before the tree (cost part)")
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 4, 8, 16, 24, 32])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--branching", type=parse_branching, nargs="+",
                    default=[(1, 1, 1, 1), (2, 1, 1), (2, 2, 1), (3, 2, 1, 1), (4, 2, 2)])
    ap.add_argument("--prompts", type=int, default=2, help="prompts per traffic category")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                    help="model dtype (auto: what serving picks on this machine); T=0 equality holds in fp32")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (cuda: fp16 unless --dtype says otherwise)")
    ap.add_argument("--cost-only", action="store_true", help="only part (a), the verification cost")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)

    if args.tiny:
        target, draft, vocab = tiny_models()
        draft_map = None
        g = torch.Generator().manual_seed(1)
        prompts = {"random": [torch.randint(0, vocab, (12,), generator=g).tolist() for _ in range(args.prompts)]}
        eos = None
        setting = "tiny random Llama models (smoke run)"
    else:
        from scripts.traffic_prompts import prompt_ids
        from serving.models import (ensure_default_target, load_causal_lm, load_tokenizer,
                                    resolve_model_path)
        target_path = resolve_model_path(args.target) if args.target else ensure_default_target()
        if not (args.draft / "config.json").is_file():
            ap.error(f"--draft {args.draft} is not a model folder (build one with `draftsmith bootstrap`)")
        tok = load_tokenizer(target_path)
        target = load_causal_lm(target_path, device=args.device,
                                dtype=None if args.dtype == "auto" else getattr(torch, args.dtype))
        vocab = len(tok)
        if not args.cost_only:
            if args.device != "cpu":
                ap.error("the end-to-end part runs on the CPU; pass --cost-only with --device")
            draft, draft_map = served_draft(args.draft, target, tok, target_path)
            prompts = prompt_ids(tok, n=args.prompts)
        eos = tok.eos_token_id
        where = (torch.cuda.get_device_name(args.device) if args.device.startswith("cuda")
                 else f"{args.threads} threads")
        setting = f"target {target_path.name}, draft {args.draft}, {next(target.parameters()).dtype}, {where}"
    progress(setting)
    cost = verify_cost(target, vocab, args.prefix, args.nodes, args.repeats)
    e2e = {} if args.cost_only else end_to_end(target, draft, draft_map or (lambda x: x), prompts, args.branching,
                                               args.max_tokens, eos)
    if args.cost_only:
        prompts = {}
    result = {"setting": setting, "prefix": args.prefix, "verify_cost": cost, "end_to_end": e2e,
              "max_tokens": args.max_tokens, "prompts_per_category": args.prompts,
              "categories": list(prompts), "date": time.strftime("%Y-%m-%d")}
    (args.out / "results.json").write_text(json.dumps(result, indent=1))

    lines = [f"# Tree verification ({result['date']})", "", setting, "",
             f"## Verification cost at a {args.prefix}-token cache (median of {args.repeats})", "",
             "| tree nodes | pass ms, every output row | x one-token step | as served ms | x one-token step |",
             "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['nodes'] or '1-token step'} | {r['ms']:.2f} | {r['ratio']:.2f} | {r['served_ms']:.2f} | "
              f"{r['served_ratio']:.2f} |" for r in cost]
    if e2e:
        lines += ["", f"## End to end, T=0, {args.max_tokens} new tokens, {sum(len(v) for v in prompts.values())} "
                  f"prompts ({', '.join(prompts)})", "",
                  "| decoder | nodes / pass | tokens / pass | tokens/s | x target | outputs != greedy |",
                  "|---|---:|---:|---:|---:|---:|"]
    for key, row in e2e.items():
        if key == "target":
            lines.append(f"| target only | - | 1.00 | {row['tokens_per_s']:.1f} | 1.00 | - |")
        else:
            lines.append(f"| tree {key} ({row['tree_nodes']} nodes) | {row['nodes_per_pass']:.1f} | "
                         f"{row['tokens_per_pass']:.2f} | {row['tokens_per_s']:.1f} | {row['ratio']:.2f} | "
                         f"{row['mismatches']} |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(cost, e2e, args.out / "tree.png")
    return 0


def plot(cost, e2e, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot([r["nodes"] for r in cost[1:]], [r["ratio"] for r in cost[1:]], "o-", label="every output row")
    a.plot([r["nodes"] for r in cost[1:]], [r["served_ratio"] for r in cost[1:]], "s-",
           label="as served (rows the rule reads)")
    a.axhline(1.3, color="grey", ls="--", label="issue target 1.3x")
    a.set_xlabel("tree nodes verified in one pass")
    a.set_ylabel("target pass / one-token step")
    a.legend()
    keys = [k for k in e2e if k != "target"]
    b.bar(range(len(keys)), [e2e[k]["ratio"] for k in keys])
    b.axhline(1.0, color="grey", ls="--")
    b.set_xticks(range(len(keys)), [k.replace(" ", "") for k in keys], rotation=30)
    b.set_ylabel("tokens/s vs target-only (T=0)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
