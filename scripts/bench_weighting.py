"""Acceptance weighting, one lever alone (issue 15): the same distillation job on the same buffer window at
several `acceptance_weight` strengths, from the same parent draft.

    .venv/bin/python scripts/bench_weighting.py --redis-dir data/bench-online/redis --draft data/bootstrap-draft \
        [--strengths 0 1] [--seeds 0] [--max-records 10000] [--set steps=150 ...] [--prefix draftsmith:buf] [--out docs/results/weighting]

`--redis-dir` is an embedded Redis folder holding a served replay buffer (scripts/bench_online.py leaves
one in its data dir); it is copied first, so the original is not touched. Each strength runs one job
(`python -m deploy.distill_job`, its own process, no MLflow run) with its own consumer group from the
stream's start: every arm trains on the same first `--max-records` training records and is scored on the
same newest held-out records (the job's own "before" / "after" offline acceptance, training/distill.py).
Prints and writes (weighting.md / .json) per strength: held-out offline acceptance before -> after, E[L],
the job's seconds, and the weighting pass's per-source miss rates and weights.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def run_job(cfg: dict, work: Path) -> dict:
    path = work / f"cfg-{uuid.uuid4().hex[:6]}.json"
    path.write_text(json.dumps(cfg))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
           "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "deploy.distill_job", "--base-draft-path", cfg["base_draft_path"],
                           "--config", str(path)], cwd=ROOT, env=env, text=True, capture_output=True)
    for line in proc.stdout.splitlines():
        if line.startswith("[distill]") and "/50 " not in line:
            print("   ", line, flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"job failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    meta = json.loads((Path(cfg["out_dir"]) / "candidate.json").read_text())
    meta["wall_s"] = time.time() - t0
    return meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--redis-dir", type=Path, required=True, help="an embedded Redis folder with a served buffer")
    ap.add_argument("--draft", type=Path, required=True, help="the parent draft folder")
    ap.add_argument("--strengths", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="training seeds: one job per strength and seed")
    ap.add_argument("--max-records", type=int, default=10_000)
    ap.add_argument("--prefix", default="draftsmith:buf")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="another job setting for every arm (training.job keys, e.g. steps=150, lr=2e-3)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "weighting")
    args = ap.parse_args(argv)
    if not (args.redis_dir / "dump.rdb").is_file():
        ap.error(f"{args.redis_dir} holds no dump.rdb: pass the embedded Redis folder of a served buffer")
    if not (args.draft / "config.json").is_file():
        ap.error(f"{args.draft} is not a model folder (no config.json)")
    if any(not (0 <= s <= 1) for s in args.strengths):
        ap.error("--strengths must be in [0, 1]")

    from buffer.embedded import EmbeddedRedis
    from training.job import _parse_value

    extra = {}
    for item in args.set:
        key, eq, value = item.partition("=")
        if not eq or not key:
            ap.error(f"--set takes KEY=VALUE, got {item!r}")
        extra[key.strip()] = _parse_value(value.strip())

    work = Path(tempfile.mkdtemp(prefix="bench-weighting-"))
    rdir = work / "redis"
    rdir.mkdir()
    shutil.copy2(args.redis_dir / "dump.rdb", rdir / "dump.rdb")
    server = EmbeddedRedis(rdir, persist=True, maxmemory="4gb")      # persist: loads the copied snapshot
    url = server.start()
    rows = []
    try:
        for s, seed in [(s, seed) for seed in args.seeds for s in args.strengths]:
            print(f"[weighting] acceptance_weight {s:g}, seed {seed}", flush=True)
            cfg = {"base_draft_path": str(args.draft.resolve()), "parent_version": "1", "redis_url": url,
                   "buffer_prefix": args.prefix, "group": f"weighting-{uuid.uuid4().hex[:8]}", "since_id": "0",
                   "max_records": args.max_records, "out_dir": str(work / f"cand-{s:g}-{seed}"), "mlflow": False,
                   "acceptance_weight": s, "ack": "registered", "seed": seed, **extra}
            meta = run_job(cfg, work)
            m = meta["metrics"]
            rows.append({"strength": s, "seed": seed, "before": m["offline_acceptance_before"],
                         "after": m["offline_acceptance_after"], "eal_before": m["expected_accepted_length_before"],
                         "eal_after": m["expected_accepted_length_after"], "train_steps": m["train_steps"],
                         "train_records": meta["data_window"]["steps"], "heldout_records": m["heldout_records"],
                         "job_seconds": m["job_seconds"], "weighting": meta.get("weighting")})
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    lines = [f"buffer={args.redis_dir} draft={args.draft} max_records={args.max_records} settings={extra or 'defaults'}", "",
             "| acceptance_weight | seed | train records | held-out records | offline acceptance before -> after | gain "
             "| E[L] before -> after | job s | weights (min-max) |", "|---:|---:|---:|---:|---|---:|---|---:|---|"]
    for r in rows:
        w = r["weighting"]
        ws = "-" if not w else f"{w['weight_min']:.2f}-{w['weight_max']:.2f}"
        lines.append(f"| {r['strength']:g} | {r['seed']} | {r['train_records']} | {r['heldout_records']} | {r['before']:.4f} -> "
                     f"{r['after']:.4f} | {r['after'] - r['before']:+.4f} | {r['eal_before']:.3f} -> "
                     f"{r['eal_after']:.3f} | {r['job_seconds']:.0f} | {ws} |")
    for st in args.strengths:
        gains = [r["after"] - r["before"] for r in rows if r["strength"] == st]
        lines.append(f"| {st:g} | mean of {len(gains)} | | | | {sum(gains) / len(gains):+.4f} | | | |")
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "weighting.md").write_text(table + "\n")
    (args.out / "weighting.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                         "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
