"""What a distillation job on the serving machine costs serving, and what `--job-nice` buys back (issue 15).

    .venv/bin/python scripts/bench_job_contention.py [--target DIR] [--seconds 25] [--serve-threads 2 1]
        [--nice 0 10 19 idle] [--out docs/results/job-contention]

For each serving thread count: the target alone, greedy, one token per forward with its KV cache (a plain
decode step, what the service runs between drafts), for `--seconds`; then the same beside a 1-thread
training process (`OMP_NUM_THREADS=1`, as `draftsmith distill` gives a 1-CPU Ray job) at each nice value, or
`idle`: Linux's SCHED_IDLE policy (`draftsmith distill --job-nice idle`), which runs the trainer only on a core
nothing else wants and lets a waking serving thread preempt it at once.
The trainer repeats the forward and backward pass of an MLP of the draft's width (576 -> 1536 -> 576 over
2048 rows, fp32): synthetic, so it measures the CPU it gets, not a job's data reading. Prints a markdown
table (serving tok/s, its ratio to serving alone, trainer iterations/s and its ratio to the trainer alone)
and writes it with the raw figures to --out (job-contention.md / .json).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TRAINER = """
import os, sys, time, torch
torch.set_num_threads(1)
nice, seconds = sys.argv[1], float(sys.argv[2])
if nice == "idle":
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
elif int(nice):
    os.nice(int(nice))
x = torch.randn(2048, 576)
w1 = torch.randn(576, 1536, requires_grad=True)
w2 = torch.randn(1536, 576, requires_grad=True)
t0, n = time.time(), 0
while time.time() - t0 < seconds:
    (torch.relu(x @ w1) @ w2).square().mean().backward()
    n += 1
print(n / (time.time() - t0), flush=True)
"""


def _nice(raw: str) -> str:
    if raw != "idle" and not (raw.isdigit() and 0 <= int(raw) <= 19):
        raise argparse.ArgumentTypeError(f"a nice value is 0..19 or 'idle', got {raw!r}")
    return raw


def trainer(nice: str, seconds: float) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", TRAINER, str(nice), str(seconds)], env=env,
                            stdout=subprocess.PIPE, text=True)


def decode_rate(model, seconds: float) -> float:
    import torch

    t0, toks = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        ids, past = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]), None
        with torch.no_grad():
            for _ in range(64):
                out = model(input_ids=ids, past_key_values=past, use_cache=True)
                past, ids = out.past_key_values, out.logits[:, -1:].argmax(-1)
                toks += 1
    return toks / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="target model folder (default: the served default)")
    ap.add_argument("--seconds", type=float, default=25.0, help="length of each measurement")
    ap.add_argument("--serve-threads", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--nice", type=_nice, nargs="+", default=["0", "10", "19", "idle"],
                    help="the trainer's priorities: nice values 0..19, or 'idle' (SCHED_IDLE)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "job-contention")
    args = ap.parse_args(argv)
    if args.seconds <= 0 or any(t < 1 for t in args.serve_threads):
        ap.error("--seconds must be > 0 and --serve-threads >= 1")

    import torch

    from serving.models import default_dtype, ensure_default_target, load_causal_lm, resolve_model_path

    path = resolve_model_path(args.target) if args.target else ensure_default_target()
    dtype = default_dtype("cpu")
    model = load_causal_lm(path, "cpu", dtype)
    p = trainer("0", args.seconds)
    alone_trainer = float(p.communicate()[0])
    print(f"[contention] trainer alone: {alone_trainer:.2f} it/s", flush=True)
    rows = []
    for threads in args.serve_threads:
        torch.set_num_threads(threads)
        decode_rate(model, 3.0)                                           # warm-up
        alone = decode_rate(model, args.seconds)
        rows.append({"serve_threads": threads, "trainer_nice": None, "serve_tok_s": alone, "trainer_it_s": None})
        print(f"[contention] serving on {threads} threads alone: {alone:.1f} tok/s", flush=True)
        for nice in args.nice:
            p = trainer(nice, args.seconds + 1.0)
            time.sleep(0.5)
            rate = decode_rate(model, args.seconds)
            it = float(p.communicate()[0])
            rows.append({"serve_threads": threads, "trainer_nice": nice, "serve_tok_s": rate, "trainer_it_s": it})
            print(f"[contention] serving on {threads} threads beside a trainer at nice {nice}: {rate:.1f} tok/s "
                  f"({rate / alone:.2f}x), trainer {it:.2f} it/s ({it / alone_trainer:.2f}x)", flush=True)
    best = max(r["serve_tok_s"] for r in rows if r["trainer_nice"] is None)
    lines = [f"target={path.name} dtype={dtype} cpu threads={os.cpu_count()} seconds={args.seconds:g} "
             f"trainer alone {alone_trainer:.2f} it/s", "",
             "| serving threads | trainer | serving tok/s | vs serving alone (same threads) | vs best serving alone "
             "| trainer it/s | vs trainer alone |", "|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        base = next(x["serve_tok_s"] for x in rows if x["serve_threads"] == r["serve_threads"]
                    and x["trainer_nice"] is None)
        who = ("none" if r["trainer_nice"] is None else "1 thread, SCHED_IDLE" if r["trainer_nice"] == "idle"
               else f"1 thread, nice {r['trainer_nice']}")
        it = "-" if r["trainer_it_s"] is None else f"{r['trainer_it_s']:.2f}"
        itr = "-" if r["trainer_it_s"] is None else f"{r['trainer_it_s'] / alone_trainer:.2f}"
        lines.append(f"| {r['serve_threads']} | {who} | {r['serve_tok_s']:.1f} | {r['serve_tok_s'] / base:.2f} | "
                     f"{r['serve_tok_s'] / best:.2f} | {it} | {itr} |")
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "job-contention.md").write_text(table + "\n")
    (args.out / "job-contention.json").write_text(json.dumps(
        {"target": str(path), "dtype": str(dtype), "seconds": args.seconds, "trainer_alone_it_s": alone_trainer,
         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
