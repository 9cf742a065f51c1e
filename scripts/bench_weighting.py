"""One distillation-job lever alone (issue 15): the same job on the same buffer window under several settings,
from the same parent draft. Made for acceptance weighting (`--strengths`); `--arm` compares any job settings
(LoRA rank and target modules, steps, rate), `--chain K` small frequent jobs against one large one.

    .venv/bin/python scripts/bench_weighting.py --redis-dir data/bench-online/redis --draft data/bootstrap-draft \
        [--strengths 0 1 | --arm lora_r=8 --arm lora_r=64,lora_alpha=32 ...] [--chain 1 3] [--seeds 0]
        [--max-records 10000] [--set steps=150 ...] [--prefix draftsmith:buf] [--out docs/results/weighting]

`--redis-dir` is an embedded Redis folder holding a served replay buffer (scripts/bench_online.py leaves
one in its data dir); it is copied first, so the original is not touched. Each strength runs one job
(`python -m deploy.distill_job`, its own process, no MLflow run) with its own consumer group from the
stream's start: every arm trains on the same first `--max-records` training records and is scored on the
same newest held-out records (the job's own "before" / "after" offline acceptance, training/distill.py).
Prints and writes (weighting.md / .json) per arm: held-out offline acceptance before -> after, E[L],
the job's seconds, and the weighting pass's per-source miss rates and weights.

`--arm SPEC` (repeatable) replaces the strengths: each SPEC is one arm, comma-separated KEY=VALUE job
settings on top of `--set`. `--chain K` (one or more values) runs each arm as K jobs in a row over the same
`--max-records` split in K consecutive windows, each job's parent the previous candidate merged
(deploy.artifacts.merge_candidate), as a scheduler with a K-times shorter interval would; the row reports
the first parent's "before" and the last candidate's "after" on the same held-out records, and the total
job seconds.
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


def parse_arm(spec: str, ap: argparse.ArgumentParser) -> dict:
    from training.job import _parse_value

    out = {}
    for item in spec.split(","):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            ap.error(f"--arm takes KEY=VALUE[,KEY=VALUE...], got {spec!r}")
        out[key.strip()] = _parse_value(value.strip())
    return out


def run_arm(label: str, over: dict, seed: int, k: int, args, extra: dict, url: str, work: Path) -> dict:
    """One arm: k jobs in a row over the first `max_records` training records (k = 1: one job), each from
    the previous candidate merged; the first job's "before" and the last one's "after"."""
    from deploy.artifacts import merge_candidate
    from training.job import ack_candidate_records

    group = f"weighting-{uuid.uuid4().hex[:8]}"
    tag = uuid.uuid4().hex[:6]
    parent, metas = args.draft.resolve(), []
    for i in range(k):
        cfg = {"base_draft_path": str(parent), "parent_version": "1", "redis_url": url,
               "buffer_prefix": args.prefix, "group": group, "since_id": "0",
               "max_records": args.max_records // k, "out_dir": str(work / f"cand-{tag}-{i}"), "mlflow": False,
               "ack": "registered", "seed": seed, **extra, **over}
        meta = run_job(cfg, work)
        metas.append(meta)
        if k > 1:
            ack_candidate_records(cfg["out_dir"], redis_url=url)      # the next job reads the next window
            print(f"    job {i + 1}/{k}: {meta['metrics']['offline_acceptance_before']:.4f} -> "
                  f"{meta['metrics']['offline_acceptance_after']:.4f}", flush=True)
        if i + 1 < k:
            nxt = work / f"draft-{tag}-{i}"
            nxt.mkdir()
            merge_candidate(parent, Path(cfg["out_dir"]), nxt)
            parent = nxt
    first, last = metas[0]["metrics"], metas[-1]["metrics"]
    return {"arm": label, "settings": over, "jobs": k, "seed": seed, "strength": over.get("acceptance_weight", 0.0),
            "before": first["offline_acceptance_before"], "after": last["offline_acceptance_after"],
            "eal_before": first["expected_accepted_length_before"], "eal_after": last["expected_accepted_length_after"],
            "train_steps": sum(m["metrics"]["train_steps"] for m in metas),
            "train_records": sum(m["data_window"]["steps"] for m in metas), "heldout_records": last["heldout_records"],
            "job_seconds": sum(m["metrics"]["job_seconds"] for m in metas), "weighting": metas[-1].get("weighting"),
            "per_job": [{"before": m["metrics"]["offline_acceptance_before"],
                         "after": m["metrics"]["offline_acceptance_after"], "records": m["data_window"]["steps"],
                         "seconds": m["metrics"]["job_seconds"]} for m in metas]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--redis-dir", type=Path, required=True, help="an embedded Redis folder with a served buffer")
    ap.add_argument("--draft", type=Path, required=True, help="the parent draft folder")
    ap.add_argument("--strengths", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--arm", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                    help="one arm's job settings (repeatable; replaces --strengths)")
    ap.add_argument("--chain", type=int, nargs="+", default=[1],
                    help="jobs in a row per arm over the same records (1: one job; 3: three on thirds)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="training seeds: one run per arm and seed")
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
    if any(k < 1 for k in args.chain):
        ap.error("--chain takes job counts >= 1")

    from buffer.embedded import from_snapshot
    from training.job import _parse_value

    extra = {}
    for item in args.set:
        key, eq, value = item.partition("=")
        if not eq or not key:
            ap.error(f"--set takes KEY=VALUE, got {item!r}")
        extra[key.strip()] = _parse_value(value.strip())

    arms = ([(spec, parse_arm(spec, ap)) for spec in args.arm] if args.arm
            else [(f"acceptance_weight={s:g}", {"acceptance_weight": s}) for s in args.strengths])
    work = Path(tempfile.mkdtemp(prefix="bench-weighting-"))
    server = from_snapshot(args.redis_dir, work)
    url = server.start()
    rows = []
    try:
        for seed in args.seeds:
            for label, over in arms:
                for k in args.chain:
                    print(f"[weighting] {label}, seed {seed}, {k} job(s)", flush=True)
                    rows.append(run_arm(label, over, seed, k, args, extra, url, work))
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    lines = [f"buffer={args.redis_dir} draft={args.draft} max_records={args.max_records} settings={extra or 'defaults'}", "",
             "| arm | jobs | seed | train records | held-out records | offline acceptance before -> after | gain "
             "| E[L] before -> after | job s | weights (min-max) |", "|---|---:|---:|---:|---:|---|---:|---|---:|---|"]
    for r in rows:
        w = r["weighting"]
        ws = "-" if not w else f"{w['weight_min']:.2f}-{w['weight_max']:.2f}"
        lines.append(f"| {r['arm']} | {r['jobs']} | {r['seed']} | {r['train_records']} | {r['heldout_records']} | "
                     f"{r['before']:.4f} -> {r['after']:.4f} | {r['after'] - r['before']:+.4f} | {r['eal_before']:.3f} -> "
                     f"{r['eal_after']:.3f} | {r['job_seconds']:.0f} | {ws} |")
    for label, _ in arms:
        for k in args.chain:
            gains = [r["after"] - r["before"] for r in rows if r["arm"] == label and r["jobs"] == k]
            lines.append(f"| {label} | {k} | mean of {len(gains)} | | | | {sum(gains) / len(gains):+.4f} | | | |")
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "weighting.md").write_text(table + "\n")
    (args.out / "weighting.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                         "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
