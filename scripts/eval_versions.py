"""Registered draft versions side by side on the same prompts, at a fixed draft shape: did a version learn the
new traffic, and did it forget the old? (issue 15)

    .venv/bin/python scripts/eval_versions.py --data data/bench-online --versions 1,champion \
        --categories known,sql,json --prompts 6 --out docs/results/online/version-eval.json

Live acceptance mixes what a version knows with what the adaptive controller chose to draft (a controller that
drafts deeper lowers accepted / proposed at the same quality) and with the machine's load. This script takes
both out: every version decodes the same held-out prompts of each category (scripts/online_traffic.py, --seed,
which the online run's clients do not use) at T=0 with the adaptive controller off, the heads' tree (mode
medusa) or the draft's chain (--mode for the draft kind) at a fixed --gamma, in one process, one version after
another. The figure that compares versions is accepted tokens per verification step (the tokens a step gains);
accepted / proposed is reported beside it.

Versions are read from the registry of --data (the heads registry with --kind medusa, the draft registry with
--kind draft), materialised as a replica would, and named by number or alias (`champion`, `previous`).
Prints a table and writes JSON to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.online_traffic import CATEGORIES, PromptStream  # noqa: E402


def log(msg: str) -> None:
    print(f"[eval {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True, help="the data dir whose registry holds the versions")
    ap.add_argument("--kind", choices=("medusa", "draft"), default="medusa")
    ap.add_argument("--versions", default="1,champion",
                    help="comma-separated version numbers or aliases (default 1,champion)")
    ap.add_argument("--categories", default="known,sql,json")
    ap.add_argument("--prompts", type=int, default=6, help="prompts per category")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=3, help="tree depth (medusa) or chain length (draft)")
    ap.add_argument("--mode", default=None, help="decoding mode (default: medusa for heads, speculative for a draft)")
    ap.add_argument("--seed", type=int, default=999)
    ap.add_argument("--target", default=None, help="target model folder (default: the served default)")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    args.categories = [c.strip() for c in args.categories.split(",") if c.strip()]
    bad = [c for c in args.categories if c not in CATEGORIES]
    if bad or not args.categories:
        ap.error(f"--categories: unknown {bad}; choose from {', '.join(CATEGORIES)}")
    args.versions = [v.strip() for v in args.versions.split(",") if v.strip()]
    if not args.versions:
        ap.error("--versions: name at least one version")
    if args.prompts < 1 or args.max_tokens < 1 or args.gamma < 1:
        ap.error("--prompts, --max-tokens and --gamma must be >= 1")
    if not args.data.is_dir():
        ap.error(f"--data {args.data} is not a folder")
    return args


def resolve(reg, name: str) -> str:
    """A version number, or an alias the registry knows."""
    if name.isdigit():
        return name
    v = reg.alias(name)
    if v is None:
        raise SystemExit(f"no version with alias {name!r} in the {reg.name} registry of {os.environ['DRAFTSMITH_DATA']}")
    return str(v)


def prompts_for(tokenizer, category: str, n: int, seed: int, max_context: int, max_tokens: int) -> list[list[int]]:
    """Chat-templated token ids of the first `n` prompts of `category`'s seeded stream that leave room for
    `max_tokens` of answer within `max_context` (also scripts/bench_controller_load.py)."""
    from training.prompts import chat_prompt_ids

    stream = PromptStream(category, seed=seed)
    out: list[list[int]] = []
    for _ in range(50 * n):                        # prompts that leave no room for the answer are skipped
        if len(out) == n:
            break
        ids = chat_prompt_ids(tokenizer, stream.next())
        if len(ids) + max_tokens <= max_context:
            out.append(ids)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["DRAFTSMITH_DATA"] = str(args.data.resolve())
    os.environ.pop("MLFLOW_TRACKING_URI", None)          # the data dir's own store
    from deploy.registry import Registry, heads_registry
    from serving.config import SamplingParams, SpecParams
    from serving.engine import Engine

    target = args.target
    reg = heads_registry(target, "medusa") if args.kind == "medusa" else Registry(target)
    versions = [(name, resolve(reg, name)) for name in args.versions]
    mode = args.mode or ("medusa" if args.kind == "medusa" else "speculative")
    engine = None
    results = []
    for name, v in versions:
        path = reg.materialize(v, verify=True)
        label = f"v{v}" + (f" ({name})" if not name.isdigit() else "")
        if engine is None:
            engine = Engine.from_paths(target, None if args.kind == "medusa" else str(path))
            # each version's own proposals: a suffix store would replay the earlier versions' answers to
            # these very prompts (serving/decoding/suffix.py)
            engine.suffix_store = None
            sets = {c: prompts_for(engine.tokenizer, c, args.prompts, args.seed, engine.max_context, args.max_tokens)
                    for c in args.categories}
        if args.kind == "medusa":
            engine.load_heads(path, version=f"medusa-v{v}")
        else:
            engine.swap_draft(path, str(v))
        for c in args.categories:
            t0 = time.perf_counter()
            steps = drafted = accepted = tokens = 0
            for ids in sets[c]:
                res = engine.generate_all(ids, SamplingParams(temperature=0.0, max_tokens=args.max_tokens),
                                          SpecParams(mode=mode, gamma=args.gamma, adaptive=False))
                steps += res.stats.steps
                drafted += res.stats.draft_tokens
                accepted += res.stats.accepted_tokens
                tokens += len(res.token_ids)
            row = {"version": v, "label": label, "category": c, "prompts": len(sets[c]), "steps": steps,
                   "tokens": tokens, "accepted_per_step": accepted / steps if steps else None,
                   "acceptance": accepted / drafted if drafted else None,
                   "tokens_per_step": tokens / steps if steps else None,
                   "seconds": round(time.perf_counter() - t0, 2)}
            results.append(row)
            log(f"{label} {c}: {row['accepted_per_step']:.3f} accepted per step, acceptance {row['acceptance']:.3f} "
                f"({len(sets[c])} prompts, {steps} steps, {row['seconds']:.0f} s)")
    setting = {"kind": args.kind, "mode": mode, "gamma": args.gamma, "temperature": 0.0, "adaptive": False,
               "max_tokens": args.max_tokens, "prompts": args.prompts, "seed": args.seed, "target": target or "default"}
    print(f"\n| version | category | accepted per step | accepted / proposed | tokens per step |\n|---|---|---:|---:|---:|")
    for r in results:
        print(f"| {r['label']} | {r['category']} | {r['accepted_per_step']:.3f} | {r['acceptance']:.3f} | "
              f"{r['tokens_per_step']:.3f} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"setting": setting, "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
