"""Torch threads per target pass on this machine: what a pass over N new tokens costs on 1 thread, on 2, and
on 2 threads borrowed for that pass alone between 1-thread passes (what the served replica does when
`ServiceSettings.wide_threads` is on, serving/scheduler.py).

    .venv/bin/python scripts/bench_threads.py --out docs/results/threads
    .venv/bin/python scripts/bench_threads.py --tiny --out /tmp/threads-smoke        # seconds, a random model

Why: a replica on a 2-core host decodes on one torch thread and leaves the other core to the Serve proxy
(deploy/app.py), since a one-token step is no faster on two. A verification pass over a draft's k + 1 tokens or
a tree's nodes is compute-bound, though, and the adaptive controller prices drafting by what those passes cost:
priced at one thread, drafting outside the easiest traffic stops paying.

The target holds a --prefix-token cache; each pass feeds N causal tokens after it and is rolled back. Per N:
the median of --repeats passes at 1 thread ("1 thread"), at --wide threads ("wide"), and at --wide threads
set just before the pass and 1 thread set just after it, alternating with a one-token pass on 1 thread
("switched"; its one-token neighbour is timed too, to catch a slower step after the switch). Writes
results.json, results.md and threads.png into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT_DIR))

from scripts.bench_tree import causal_feed, progress, tiny_models  # noqa: E402
from serving.decoding.tree import keep_path  # noqa: E402


def measure(target, vocab: int, prefix: int, widths: list[int], repeats: int, wide: int) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (prefix + max(widths),), generator=g).tolist()
    torch.set_num_threads(1)
    _, cache = causal_feed(target, ids[:prefix], None, 0)

    def one_pass(n: int, threads: int | None = None) -> float:
        if threads is not None:
            torch.set_num_threads(threads)
        t0 = time.perf_counter()
        with torch.inference_mode():
            causal_feed(target, ids[prefix:prefix + n], cache, prefix)
        t = time.perf_counter() - t0
        if threads is not None:
            torch.set_num_threads(1)
        keep_path(cache, prefix - 1, [])
        return t

    rows = []
    for n in widths:
        for threads in (1, wide):                  # warm-up: first passes of a shape run cold
            torch.set_num_threads(threads)
            for _ in range(3):
                one_pass(n)
        torch.set_num_threads(1)
        single = statistics.median(one_pass(n) for _ in range(repeats))
        torch.set_num_threads(wide)
        multi = statistics.median(one_pass(n) for _ in range(repeats))
        torch.set_num_threads(1)
        switched, after = [], []
        for _ in range(repeats):
            switched.append(one_pass(n, threads=wide))
            after.append(one_pass(1))
        row = {"tokens": n, "one_thread_ms": single * 1e3, "wide_ms": multi * 1e3,
               "switched_ms": statistics.median(switched) * 1e3,
               "next_one_token_ms": statistics.median(after) * 1e3}
        rows.append(row)
        progress(f"{n:>2} tokens: 1 thread {row['one_thread_ms']:.1f} ms, {wide} threads {row['wide_ms']:.1f} ms, "
                 f"switched {row['switched_ms']:.1f} ms (next one-token pass {row['next_one_token_ms']:.1f} ms)")
    base = rows[0]["one_thread_ms"] if rows and rows[0]["tokens"] == 1 else None
    for row in rows:
        for k in ("one_thread", "wide", "switched"):
            row[f"{k}_ratio"] = row[f"{k}_ms"] / base if base else None
    return {"rows": rows, "one_token_one_thread_ms": base}


def plot(result: dict, wide: int, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    xs = [r["tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for key, label in (("one_thread_ms", "1 thread"), ("wide_ms", f"{wide} threads"),
                       ("switched_ms", f"{wide} threads for this pass only")):
        ax.plot(xs, [r[key] for r in rows], marker="o", label=label)
    ax.set_xlabel("tokens in the target pass")
    ax.set_ylabel("ms (median)")
    ax.set_title("Target pass cost by torch threads")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="target model folder (default: the served default)")
    ap.add_argument("--out", type=Path, default=ROOT_DIR / "docs" / "results" / "threads")
    ap.add_argument("--tiny", action="store_true", help="a random tiny model: a smoke run in seconds")
    ap.add_argument("--prefix", type=int, default=200, help="cached tokens before each pass")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--wide", type=int, default=2, help="threads of the wide passes")
    args = ap.parse_args(argv)
    if any(w < 1 for w in args.widths) or args.repeats < 1 or args.wide < 1:
        ap.error("--widths, --repeats and --wide must be positive")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        target, _, vocab = tiny_models()
        setting = "tiny random Llama model (smoke run)"
    else:
        from serving.models import ensure_default_target, load_causal_lm, load_tokenizer, resolve_model_path
        path = resolve_model_path(args.target) if args.target else ensure_default_target()
        target = load_causal_lm(path, device="cpu", dtype=None)
        vocab = len(load_tokenizer(path))
        setting = f"target {path.name}, {next(target.parameters()).dtype}, CPU"
    progress(setting)
    box: dict = {}
    # measured in a fresh thread, as the replica's scheduler thread decodes (serving/models.py
    # release_openmp_threads: OpenMP pools are per thread). The loading thread's pool is given back first, as the
    # engine does after a load: left alive, the process holds more OpenMP threads than cores, idle workers sleep
    # at once, and every 2-thread pass in the fresh thread pays a wake-up (before this, 2 threads measured no
    # faster than 1 on an fp32 host where served requests ran 25% faster on 2)
    from serving.models import release_openmp_threads
    release_openmp_threads()
    worker = threading.Thread(target=lambda: box.update(measure(target, vocab, args.prefix, sorted(set(args.widths)),
                                                                args.repeats, args.wide)))
    worker.start()
    worker.join()
    if "rows" not in box:
        raise SystemExit("the measurement failed (see the traceback above)")
    result = {"setting": setting, "prefix": args.prefix, "repeats": args.repeats, "wide": args.wide,
              "cpu_count": os.cpu_count(), **box}
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    lines = [f"{setting}; a {args.prefix}-token cache, median of {args.repeats} passes; ratios to a one-token "
             "pass on 1 thread", "",
             f"| tokens | 1 thread ms | ratio | {args.wide} threads ms | ratio | switched ms | ratio | next 1-token ms |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in box["rows"]:
        lines.append(f"| {r['tokens']} | {r['one_thread_ms']:.1f} | {r['one_thread_ratio'] or 0:.2f} | "
                     f"{r['wide_ms']:.1f} | {r['wide_ratio'] or 0:.2f} | {r['switched_ms']:.1f} | "
                     f"{r['switched_ratio'] or 0:.2f} | {r['next_one_token_ms']:.1f} |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    plot(box, args.wide, args.out / "threads.png")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
