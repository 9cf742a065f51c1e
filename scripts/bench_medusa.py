"""Draft kinds against each other on this machine (issue 19, steps 1 and 4): Medusa heads, the EAGLE-style
head and the standalone draft, each verified as a tree.

    .venv/bin/python -m training.heads --out data/medusa-heads          # heads from the bootstrap's teacher data
    .venv/bin/python -m training.heads --kind eagle --out data/eagle-head
    .venv/bin/python scripts/bench_medusa.py --heads data/medusa-heads --eagle data/eagle-head \
        --draft data/bootstrap-draft --out docs/results/medusa
    .venv/bin/python scripts/bench_medusa.py --tiny --out /tmp/medusa-smoke        # seconds, random models

End to end at T=0, single sequence: plain target greedy decoding (the baseline), `medusa_generate` (heads
read the hidden state the previous verification pass left; one target pass per step verifies a tree) for
each --branching, the EAGLE-style head (`eagle_generate`, serving/decoding/eagle.py) for each --eagle-branching,
and the standalone draft with tree verification (`tree_generate`) for each --draft-branching; prompt by prompt interleaved in one run, on the traffic prompts of
scripts/traffic_prompts.py (written for benchmarks, never trained on), --prompts per category. Reported per
decoder and category: tokens/s, ratio to target-only, tokens per target pass (accepted + 1), and outputs
that differ from target greedy (0 in fp32; bf16 ties can differ). The heads' held-out agreement per head
(from their training) is copied into the report.

Writes results.json, results.md and medusa.png into --out.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT_DIR))

from scripts.bench_tree import parse_branching, served_draft, target_greedy, tiny_models, tree_nodes  # noqa: E402
from serving.decoding.eagle import EagleHead, eagle_generate  # noqa: E402
from serving.decoding.medusa import HeadsConfig, MedusaHeads, medusa_generate, read_heads_meta  # noqa: E402
from serving.decoding.tree import tree_generate  # noqa: E402


def progress(msg: str) -> None:
    print(f"[medusa {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _row(kind: str, branching) -> dict:
    return {"kind": kind, "branching": list(branching), "tree_nodes": tree_nodes(branching), "tokens": 0,
            "s": 0.0, "steps": 0, "accepted": 0, "mismatches": 0, "by_category": {}}


def run(target, heads, draft, draft_map, prompts: dict[str, list[list[int]]], branchings, draft_branchings,
        max_tokens: int, eos: int | None, eagle=None, eagle_branchings=()) -> dict:
    rows = {"target": {"kind": "target", "tokens": 0, "s": 0.0, "by_category": {}}}
    for b in branchings:
        rows[f"medusa {b}"] = _row("medusa", b)
    if eagle is not None:
        for b in eagle_branchings:
            rows[f"eagle {b}"] = _row("eagle", b)
    if draft is not None:
        for b in draft_branchings:
            rows[f"draft {b}"] = _row("draft", b)
    count = sum(len(v) for v in prompts.values())
    done, t_start = 0, time.time()

    def add(key, cat, out, s, stats=None, ref=None):
        row = rows[key]
        c = row["by_category"].setdefault(cat, {"tokens": 0, "s": 0.0, "steps": 0, "accepted": 0})
        for r in (row, c):
            r["tokens"] += len(out)
            r["s"] += s
            if stats is not None:
                r["steps"] += stats.steps
                r["accepted"] += stats.accepted
        if ref is not None:
            row["mismatches"] += int(out != ref)

    for cat, plist in prompts.items():
        for prompt in plist:
            t0 = time.perf_counter()
            ref = target_greedy(target, prompt, max_tokens, eos)
            add("target", cat, ref, time.perf_counter() - t0)
            for b in branchings:
                t0 = time.perf_counter()
                out, stats = medusa_generate(target, heads, prompt, max_tokens, b, eos_id=eos)
                add(f"medusa {b}", cat, out, time.perf_counter() - t0, stats, ref)
            if eagle is not None:
                for b in eagle_branchings:
                    t0 = time.perf_counter()
                    out, stats = eagle_generate(target, eagle, prompt, max_tokens, b, eos_id=eos)
                    add(f"eagle {b}", cat, out, time.perf_counter() - t0, stats, ref)
            if draft is not None:
                for b in draft_branchings:
                    t0 = time.perf_counter()
                    out, stats = tree_generate(target, draft, prompt, max_tokens, b, eos_id=eos, draft_map=draft_map)
                    add(f"draft {b}", cat, out, time.perf_counter() - t0, stats, ref)
            done += 1
            progress(f"{done}/{count} prompts ({cat}), {done / (time.time() - t_start) * 60:.1f} prompts/min")
    base = rows["target"]
    for key, row in rows.items():
        row["tokens_per_s"] = row["tokens"] / row["s"]
        row["ratio"] = row["tokens_per_s"] / (base["tokens"] / base["s"])
        if key != "target":
            row["tokens_per_pass"] = (row["accepted"] + row["steps"]) / row["steps"]
        for cat, c in row["by_category"].items():
            b = base["by_category"][cat]
            c["ratio"] = (c["tokens"] / c["s"]) / (b["tokens"] / b["s"])
            if key != "target":
                c["tokens_per_pass"] = (c["accepted"] + c["steps"]) / c["steps"]
    return rows


def geomean(xs) -> float:
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def report(result: dict) -> str:
    rows, cats = result["rows"], result["categories"]
    lines = [f"# Draft kinds: Medusa heads, EAGLE-style head, standalone draft ({result['date']})", "",
             result["setting"], "",
             f"End to end, T=0, {result['max_tokens']} new tokens, {result['prompts_per_category']} traffic "
             f"prompts per category ({', '.join(cats)}); single sequence; ratios to target-only in the same run.", "",
             "| decoder | tree nodes | tokens / pass | tokens/s | x target | category geomean | "
             "outputs != greedy |", "|---|---:|---:|---:|---:|---:|---:|"]
    for key, row in rows.items():
        if key == "target":
            lines.append(f"| target only | - | 1.00 | {row['tokens_per_s']:.1f} | 1.00 | 1.00 | - |")
            continue
        gm = geomean(c["ratio"] for c in row["by_category"].values())
        lines.append(f"| {key} | {row['tree_nodes']} | {row['tokens_per_pass']:.2f} | {row['tokens_per_s']:.1f} | "
                     f"{row['ratio']:.2f} | {gm:.2f} | {row['mismatches']} |")
    lines += ["", "Per category, x target-only (tokens per pass):", "",
              "| decoder | " + " | ".join(cats) + " |", "|---|" + "---:|" * len(cats)]
    for key, row in rows.items():
        if key == "target":
            continue
        cells = [f"{row['by_category'][c]['ratio']:.2f} ({row['by_category'][c]['tokens_per_pass']:.2f})" for c in cats]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    meta = result.get("heads_meta") or {}
    if meta:
        lines += ["", f"Heads: {meta.get('num_heads')} heads x {meta.get('num_layers')} blocks, use_token="
                  f"{meta.get('use_token')}, vocabulary {len(meta.get('output_token_ids', []))}; trained "
                  f"{meta.get('steps')} steps / {meta.get('epochs')} epochs in {meta.get('seconds')} s (hidden-state "
                  f"pass {meta.get('hidden_state_seconds')} s) on {meta.get('training_rows')} rows.",
                  f"Held-out top-1 agreement per head (teacher data held-out split): "
                  f"{meta.get('heldout_head_agreement')}; all of heads 1..k right: {meta.get('heldout_chain_acceptance')}.",
                  f"By category (per head): {meta.get('heldout_head_agreement_by_source')}"]
    em = result.get("eagle_meta") or {}
    if em:
        lines += ["", f"EAGLE head: one decoder layer, trained {em.get('steps')} steps / {em.get('epochs')} epochs "
                  f"(best epoch {em.get('best_epoch')}) in {em.get('seconds')} s on {em.get('training_sequences')} "
                  f"sequences; held-out first-token agreement (teacher-forced) {em.get('heldout_agreement')}, by "
                  f"category {em.get('heldout_agreement_by_source')}."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {k: v for k, v in result["rows"].items() if k != "target"}
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4))
    colors = [{"medusa": "tab:orange", "eagle": "tab:green"}.get(r["kind"], "tab:blue") for r in rows.values()]
    ax.bar(range(len(rows)), [r["ratio"] for r in rows.values()], color=colors)
    ax.axhline(1.0, color="grey", ls="--")
    ax.set_xticks(range(len(rows)), [k.replace(" ", "\n", 1) for k in rows], fontsize=8)
    ax.set_ylabel("tokens/s vs target-only (T=0)")
    ax.set_title("Medusa heads (orange), EAGLE head (green), standalone draft tree (blue)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="target model folder (default: the served default)")
    ap.add_argument("--heads", type=Path, default=ROOT_DIR / "data" / "medusa-heads")
    ap.add_argument("--draft", type=Path, default=None, help="standalone draft to compare with (optional)")
    ap.add_argument("--eagle", type=Path, default=None, help="EAGLE head folder to compare with (optional)")
    ap.add_argument("--eagle-branching", type=parse_branching, nargs="+", default=[(1, 1, 1), (2, 1, 1), (2, 1, 1, 1)])
    ap.add_argument("--out", type=Path, default=ROOT_DIR / "docs" / "results" / "medusa")
    ap.add_argument("--tiny", action="store_true", help="random tiny models: a smoke run in seconds")
    ap.add_argument("--branching", type=parse_branching, nargs="+", default=[(1, 1, 1), (2, 1, 1), (3, 2, 1), (4, 2, 2)])
    ap.add_argument("--draft-branching", type=parse_branching, nargs="+", default=[(2, 1, 1)])
    ap.add_argument("--prompts", type=int, default=2, help="prompts per traffic category")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="target dtype (auto: what serving picks on this machine)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    heads_meta = {}
    if args.tiny:
        target, draft, vocab = tiny_models()
        torch.manual_seed(0)
        heads = MedusaHeads.for_target(target, HeadsConfig(target.config.hidden_size, 4, 1, True), list(range(vocab)))
        eagle = EagleHead.for_target(target, list(range(vocab))).eval()
        eagle_meta = {}
        draft_map = lambda x: x                                            # noqa: E731
        g = torch.Generator().manual_seed(1)
        prompts = {"random": [torch.randint(0, vocab, (12,), generator=g).tolist() for _ in range(args.prompts)]}
        eos = None
        setting = "tiny random Llama models and untrained heads (smoke run)"
    else:
        from scripts.traffic_prompts import prompt_ids
        from serving.models import ensure_default_target, load_causal_lm, load_tokenizer, resolve_model_path

        if not (args.heads / "medusa_heads.json").is_file():
            ap.error(f"--heads {args.heads} is not a heads folder (build one with `python -m training.heads`)")
        target_path = resolve_model_path(args.target) if args.target else ensure_default_target()
        tok = load_tokenizer(target_path)
        target = load_causal_lm(target_path, dtype=None if args.dtype == "auto" else getattr(torch, args.dtype))
        heads = MedusaHeads.load(args.heads, target)
        eagle, eagle_meta = None, {}
        if args.eagle is not None:
            eagle = EagleHead.load(args.eagle, target)
            eagle_meta = {k: v for k, v in json.loads((args.eagle / "eagle_head.json").read_text()).items()
                          if k not in ("output_token_ids", "layer_config")}
        heads_meta = {k: v for k, v in read_heads_meta(args.heads).items() if k != "output_token_ids"}
        heads_meta["output_token_ids"] = heads.output_token_ids
        draft = draft_map = None
        if args.draft is not None:
            if not (args.draft / "config.json").is_file():
                ap.error(f"--draft {args.draft} is not a model folder (build one with `draftsmith bootstrap`)")
            draft, draft_map = served_draft(args.draft, target, tok, target_path)
        prompts = prompt_ids(tok, n=args.prompts)
        eos = tok.eos_token_id
        setting = (f"target {target_path.name} ({next(target.parameters()).dtype}), heads {args.heads}, EAGLE "
                   f"head {args.eagle}, draft {args.draft}, {args.threads} threads")
    progress(setting)
    rows = run(target, heads, draft, draft_map, prompts, args.branching, args.draft_branching, args.max_tokens, eos,
               eagle, args.eagle_branching)
    result = {"setting": setting, "rows": rows, "categories": list(prompts), "max_tokens": args.max_tokens,
              "prompts_per_category": args.prompts, "date": time.strftime("%Y-%m-%d"), "heads_meta": heads_meta,
              "eagle_meta": eagle_meta}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(
        {**result, "heads_meta": {k: v for k, v in heads_meta.items() if k != "output_token_ids"}}, indent=1))
    text = report(result)
    (args.out / "results.md").write_text(text)
    print(text)
    plot(result, args.out / "medusa.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
