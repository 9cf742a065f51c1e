"""Do Medusa heads (or an EAGLE head) learn online from served traffic? (issue 19, step 3)

    .venv/bin/python scripts/bench_heads_online.py --heads data/medusa-heads --out docs/results/heads-online
    .venv/bin/python scripts/bench_heads_online.py --kind eagle --heads data/eagle-head --out docs/results/eagle-online
    .venv/bin/python scripts/bench_heads_online.py --tiny [--kind eagle] --out /tmp/heads-online-smoke   # seconds

Everything real except HTTP (the engine runs in-process, as a replica's does): a real Redis buffer (REDIS_URL,
else the embedded server), a real MLflow store (SQLite in a fresh --work folder), the real heads job, gate and
promotion (deploy/heads.py `run_heads_cycle`).

1. The bootstrap heads (--heads) are registered as version 1 of the --kind heads registry and promoted.
2. Before: --eval prompts of a category the bootstrap never saw (scripts/online_traffic.py, default `sql`,
   seed 999: prompts not served in step 3) are decoded with mode --kind and with the target alone, back to back
   per prompt (the order alternating),
   T=0, --max-tokens each; acceptance (accepted / proposed draft tokens) and tokens/s.
3. Traffic: (with --earlier-requests N, first N prompts of the --earlier category, seed 1, as earlier traffic
   the buffer holds; the job replays them with --replay-ratio) --requests prompts of the category (seed 0) are served with mode --kind at T=0 into the
   buffer as requests `<category>-<i>` (about 10% of request ids are held out, the split every job and the gate
   use: for `sql`, 3 of the first 16 and 16 of the first 120).
4. One heads cycle: job from the champion heads on the buffer (--budget s of training), candidate registered,
   gated on its own held-out sample, promoted when it passes.
5. After: the promoted champion (or, when the gate rejected it, the candidate, reported as such) decodes the
   same eval prompts as in step 2.

Writes summary.json, summary.md, heads_online.png (acceptance and speed-up before / after) and job.log into
--out; `--replot` redraws the PNG from an existing summary.json.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

ROOT_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT_DIR))


LABEL = {"medusa": "Medusa heads", "eagle": "EAGLE head"}
TREE = {"medusa": "tree (2,1,1)", "eagle": "the EAGLE head's default tree"}


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _decode(engine, ids, mode: str, max_tokens: int, request_id=None, source: str = ""):
    from serving.config import SamplingParams, SpecParams

    t0 = time.perf_counter()
    res = engine.generate_all(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                              SpecParams(mode=mode, gamma=3) if mode != "target" else SpecParams(mode="target"),
                              request_id=request_id, source=source, log_mode="full" if request_id else "none")
    return res, time.perf_counter() - t0


def _figures(runs) -> dict:
    tokens = sum(len(r.token_ids) for r, _ in runs)
    seconds = sum(s for _, s in runs)
    acc = sum(r.stats.accepted_tokens for r, _ in runs)
    drafted = sum(r.stats.draft_tokens for r, _ in runs)
    return {"prompts": len(runs), "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 2) if seconds else None,
            "acceptance": round(acc / drafted, 4) if drafted else None, "accepted": acc, "drafted": drafted}


def decode_set(engine, prompts, mode: str, max_tokens: int, *, request_tag: str | None = None, source: str = "") -> dict:
    """Decode every prompt with `mode` (served into the buffer as `<request_tag>-<i>` when a tag is given);
    with a tag, also `training_steps`: the steps (buffer records) of the requests that are not held out."""
    from training.data import is_heldout
    from training.heads_job import DEFAULTS

    runs = [_decode(engine, ids, mode, max_tokens, f"{request_tag}-{i}" if request_tag else None, source)
            for i, ids in enumerate(prompts)]
    out = _figures(runs)
    if request_tag:
        out["training_steps"] = sum(r.stats.steps for i, (r, _) in enumerate(runs)
                                    if not is_heldout(f"{request_tag}-{i}", DEFAULTS["heldout_fraction"]))
    return out


def decode_pairs(engine, prompts, mode: str, max_tokens: int) -> dict:
    """Each prompt with `mode` and with the target alone, back to back (the order alternating by prompt),
    so a change of the machine's speed during the phase hits both sides of the ratio alike."""
    runs = {mode: [], "target": []}
    for i, ids in enumerate(prompts):
        for m in ((mode, "target") if i % 2 == 0 else ("target", mode)):
            runs[m].append(_decode(engine, ids, m, max_tokens))
    return {m: _figures(r) for m, r in runs.items()}


def plot(result: dict, path: Path) -> None:
    """Two panels, before / after the heads job: acceptance and speed-up over target-only."""
    kind = result["setting"].get("kind", "medusa")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["v1 (bootstrap)", f"v{result['after']['version']} (after one job)"]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for ax, key, title in ((axes[0], "acceptance", "acceptance (accepted / proposed)"),
                           (axes[1], "speedup", "speed-up over target-only")):
        raw = [result[p][kind]["acceptance"] if key == "acceptance" else result[p]["speedup"]
               for p in ("before", "after")]
        vals = [0.0 if v is None else v for v in raw]      # acceptance is None where the controller drafted nothing
        bars = ax.bar(labels, vals, color=["#999999", "#3a7dc9"])
        ax.bar_label(bars, labels=["none drafted" if v is None else f"{v:.2f}" for v in raw])
        ax.set_ylim(0, max(max(vals) * 1.15, 0.1))
        ax.set_title(title, fontsize=10)
        if key == "speedup":
            ax.axhline(1.0, color="black", lw=0.8, ls="--")
    st = result["setting"]
    fig.suptitle(f"{LABEL[kind]}, {st['category']} traffic: one heads job on {st['requests']} served requests "
                 f"(T={st['temperature']}, {st['max_tokens']} tokens)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=tuple(LABEL), default="medusa", help="which heads (default medusa)")
    ap.add_argument("--heads", type=Path, default=None,
                    help="bootstrap heads folder (python -m training.heads [--kind eagle])")
    ap.add_argument("--target", default=None, help="target folder (default: the served default)")
    ap.add_argument("--category", default="sql", help="scripts/online_traffic.py category (default sql)")
    ap.add_argument("--requests", type=int, default=120, help="served requests in step 3")
    ap.add_argument("--eval", type=int, default=12, help="eval prompts before / after")
    ap.add_argument("--earlier", default="known", help="a category like the bootstrap's traffic, measured before "
                    "and after for forgetting (default known)")
    ap.add_argument("--earlier-eval", type=int, default=6, help="its eval prompts (0: skip)")
    ap.add_argument("--earlier-requests", type=int, default=0,
                    help="serve this many --earlier prompts (seed 1) into the buffer before the new traffic, as a "
                         "replica that served them earlier would hold them; the job's window is then the new "
                         "traffic's training steps (default 0)")
    ap.add_argument("--replay-ratio", type=float, default=None,
                    help="the heads job's replay share of older steps (training/heads_job.py; default the job's)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--budget", type=float, default=120.0, help="heads job training seconds")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="tiny random models (a smoke run of the script)")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (MLflow store; default a temp dir)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--replot", action="store_true", help="only redraw heads_online.png from --out/summary.json")
    args = ap.parse_args(argv)
    if args.replot:
        plot(json.loads((args.out / "summary.json").read_text()), args.out / "heads_online.png")
        return 0
    torch.set_num_threads(args.threads)

    from buffer.redis_store import BufferConfig, ReplayBufferWriter, resolve_redis_url
    from deploy.gate import GatePolicy
    from deploy.heads import HeadsEvidence, heads_smoke_check, run_heads_cycle
    from deploy.registry import heads_registry
    from scripts.online_traffic import PromptStream
    from serving.engine import Engine
    from serving.models import default_dtype, resolve_model_path

    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="heads-online-"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    if args.tiny:
        from serving.decoding.medusa import HeadsConfig, MedusaHeads
        from tests import tiny_models as tm

        target_path, _ = tm.save_pair(work / "pair")
        dtype = torch.float32
        from serving.decoding.eagle import EagleHead

        tmodel = Engine.from_paths(str(target_path), None, dtype=dtype).target.model
        heads_dir = (MedusaHeads.for_target(tmodel, HeadsConfig(tmodel.config.hidden_size, 3, 1, True),
                                            list(range(259))) if args.kind == "medusa" else
                     EagleHead.for_target(tmodel, list(range(259)))).save(work / "heads")
        target = str(target_path)
        args.requests, args.eval, args.max_tokens, args.budget = min(args.requests, 16), min(args.eval, 4), 16, 5.0
        args.earlier_eval = min(args.earlier_eval, 2)
        args.earlier_requests = min(args.earlier_requests, 4)
    else:
        target = str(resolve_model_path(args.target))
        dtype = default_dtype("cpu")
        heads_dir = args.heads
        if heads_dir is None or not heads_dir.is_dir():
            print(f"error: --heads must be a {LABEL[args.kind]} folder (python -m training.heads"
                  f"{' --kind eagle --out data/eagle-head' if args.kind == 'eagle' else ' --out data/medusa-heads'})",
                  file=sys.stderr)
            return 2
    redis_url = resolve_redis_url(None)
    prefix = f"draftsmith:bench-heads:{uuid.uuid4().hex[:8]}"
    writer = ReplayBufferWriter(redis_url, BufferConfig(prefix=prefix, flush_interval_s=0.01))
    engine = Engine.from_paths(target, None, dtype=dtype, sink=writer)
    kind = args.kind
    load = engine.load_eagle if kind == "eagle" else engine.load_heads
    reg = heads_registry(target, kind, tracking_uri=f"sqlite:///{work / 'mlflow.db'}", cache_root=work / "cache",
                         candidates_root=work / "candidates")
    v1 = reg.register_heads(heads_dir)
    reg.promote(v1, reason="bootstrap heads")
    load(reg.materialize(v1, verify=True), version=f"{kind}-v{v1}")

    def prompts(seed: int, n: int, category: str | None = None) -> list[list[int]]:
        stream = PromptStream(category or args.category, seed=seed)
        out = []
        for _ in range(50 * n):                   # prompts that leave no room for the answer are skipped
            if len(out) == n:
                break
            ids = [int(t) for t in engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": stream.next()}], add_generation_prompt=True, tokenize=True,
                return_dict=False)]
            if len(ids) + args.max_tokens <= engine.max_context:
                out.append(ids)
        return out

    eval_prompts, traffic = prompts(999, args.eval), prompts(0, args.requests)
    earlier = prompts(999, args.earlier_eval, args.earlier) if args.earlier_eval else []
    result = {"setting": {"category": args.category, "earlier": args.earlier, "earlier_eval": len(earlier), "temperature": 0, "max_tokens": args.max_tokens,
                          "requests": args.requests, "eval_prompts": args.eval, "budget_s": args.budget,
                          "threads": args.threads, "dtype": str(dtype), "target": target, "heads": str(heads_dir),
                          "tiny": args.tiny, "kind": kind, "earlier_requests": args.earlier_requests,
                          "replay_ratio": args.replay_ratio,
                          "acceptance": f"accepted / proposed draft tokens, mode {kind}, {TREE[kind]}, gamma 3"}}
    progress(f"before: {args.eval} eval prompts, mode {kind} and target-only")
    result["before"] = decode_pairs(engine, eval_prompts, kind, args.max_tokens)
    if earlier:
        result["before"]["earlier"] = decode_pairs(engine, earlier, kind, args.max_tokens)
    progress(f"before: {result['before']}")
    if args.earlier_requests:
        t0 = time.time()
        older = decode_set(engine, prompts(1, args.earlier_requests, args.earlier), kind, args.max_tokens,
                           request_tag=args.earlier, source=args.earlier)
        result["earlier_traffic"] = {**older, "wall_s": round(time.time() - t0, 1)}
        progress(f"served {args.earlier_requests} earlier ({args.earlier}) requests into the buffer: {older}")
    t0 = time.time()
    served = decode_set(engine, traffic, kind, args.max_tokens, request_tag=args.category, source=args.category)
    writer.flush(30)
    result["traffic"] = {**served, "wall_s": round(time.time() - t0, 1)}
    progress(f"served {args.requests} requests into the buffer: {result['traffic']}")
    lines: list[str] = []

    def log_line(msg: str) -> None:
        lines.append(msg)
        progress(msg)

    job = {"redis_url": redis_url, "buffer_prefix": prefix, "budget_s": args.budget,
           "out_dir": str(work / "candidates" / "heads-job")}
    if args.tiny:
        job.update(min_train_rows=16, min_heldout_rows=4)
    if args.replay_ratio is not None:
        job["replay_ratio"] = args.replay_ratio
    if args.earlier_requests:
        # the job's window: the new traffic's training steps only, as after a shift in a long-running service
        # (whose buffer holds far more than a window); the earlier requests are then older, for replay alone
        job["max_records"] = max(1, served["training_steps"])
    t1 = time.time()
    version, verdict = run_heads_cycle(
        reg, target, job, policy=GatePolicy(min_requests=3 if args.tiny else 8, category_min_requests=10),
        evidence=HeadsEvidence(target, redis_url=redis_url, buffer_prefix=prefix, kind=kind),
        smoke_check=heads_smoke_check(target, max_tokens=8 if args.tiny else 24, kind=kind), progress=log_line)
    info = reg.get(version)
    result["job"] = {"version": version, "seconds": round(time.time() - t1, 1), "accepted": verdict.accepted,
                     "promoted": verdict.promoted, "reason": verdict.reason,
                     "gate_candidate_acceptance": verdict.candidate_acceptance,
                     "gate_champion_acceptance": verdict.champion_acceptance, "gate_requests": verdict.requests,
                     "job_metrics": {k: v for k, v in info.metrics.items() if not k.startswith("gate_")}}
    after_version = reg.champion() if verdict.promoted else version
    load(reg.materialize(after_version, verify=True), version=f"{kind}-v{after_version}")
    progress(f"after: heads version {after_version} ({'promoted' if verdict.promoted else 'NOT promoted'})")
    result["after"] = {"version": after_version, "promoted": verdict.promoted,
                       **decode_pairs(engine, eval_prompts, kind, args.max_tokens)}
    if earlier:
        result["after"]["earlier"] = decode_pairs(engine, earlier, kind, args.max_tokens)
    for k in ("before", "after"):
        r = result[k]
        r["speedup"] = round(r[kind]["tokens_per_s"] / r["target"]["tokens_per_s"], 3)
        if "earlier" in r:
            e = r["earlier"]
            e["speedup"] = round(e[kind]["tokens_per_s"] / e["target"]["tokens_per_s"], 3)
    writer.close()
    (args.out / "summary.json").write_text(json.dumps(result, indent=1, default=str))
    (args.out / "job.log").write_text("\n".join(lines) + "\n")
    plot(result, args.out / "heads_online.png")
    b, a = result["before"], result["after"]
    md = [f"# {LABEL[kind]} learning online: {args.category} traffic", "",
          f"T=0, {args.max_tokens} tokens, {args.eval} eval prompts (seed 999) never served; {args.requests} served "
          f"requests (seed 0) in the buffer"
          + (f" after {args.earlier_requests} earlier {args.earlier} requests (seed 1)" if args.earlier_requests else "")
          + f"; heads job {args.budget:g} s of training"
          + (f", replay ratio {args.replay_ratio:g}" if args.replay_ratio is not None else "")
          + f"; {args.threads} threads, {dtype}.",
          f"Acceptance = accepted / proposed draft tokens (mode {kind}, {TREE[kind]}, gamma 3). Speed-up = {kind} "
          "tokens/s / target-only tokens/s on the same prompts in the same phase.", "",
          f"| heads | acceptance | {kind} tokens/s | target tokens/s | speed-up |", "|---|---:|---:|---:|---:|",
          f"| v{v1} (bootstrap) | {b[kind]['acceptance']} | {b[kind]['tokens_per_s']} | "
          f"{b['target']['tokens_per_s']} | {b['speedup']}x |",
          f"| v{after_version} ({'promoted' if verdict.promoted else 'candidate, not promoted'}) | "
          f"{a[kind]['acceptance']} | {a[kind]['tokens_per_s']} | {a['target']['tokens_per_s']} | "
          f"{a['speedup']}x |", "",
          *([f"Earlier traffic ({args.earlier}, {len(earlier)} prompts, same phases): acceptance "
             f"{b['earlier'][kind]['acceptance']} -> {a['earlier'][kind]['acceptance']}, speed-up "
             f"{b['earlier']['speedup']}x -> {a['earlier']['speedup']}x.", ""] if earlier else []),
          f"Gate: {'accepted' if verdict.accepted else 'rejected'}: {verdict.reason}", "",
          f"Job (held-out, {'teacher-forced first-token agreement' if kind == 'eagle' else 'greedy chain accepted / proposed'}): "
          f"{info.metrics.get('offline_acceptance_before')} -> "
          f"{info.metrics.get('offline_acceptance_after')}; {int(info.metrics.get('training_rows', 0))} training rows "
          f"({int(info.metrics.get('replay_requests', 0))} replayed older requests); "
          f"cycle {result['job']['seconds']} s."]
    (args.out / "summary.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
