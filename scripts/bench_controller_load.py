"""Does the adaptive controller keep its plan when the machine's load changes under it? (issue 15)

    .venv/bin/python scripts/bench_controller_load.py --out docs/results/controller-load [--load-shares 0 0.9]
    .venv/bin/python scripts/bench_controller_load.py --tiny --out /tmp/controller-load   # seconds, for CI

On a machine that serves and distills, a distillation job starts and stops beside serving every few minutes.
Every step time the controller measures then changes, but it measures only the draft depths it chooses, so
with per-size running means the depths it seldom chooses keep their old cost and look cheap or dear against
the rest (serving/controller.py LOAD_SHARE). This benchmark replays that in one process, as a replica runs:
one engine (the served default: the Medusa heads' adaptive tree, T=0; --threads torch threads, 1 as a replica
beside a 1-CPU job on 2 cores) decodes the same prompts three times: idle, beside --trainers busy training
processes (1 thread each, nice 0: the synthetic trainer of scripts/bench_job_contention.py), and idle again.
The engine, its cost model and its acceptance priors carry over from phase to phase, as a replica's do. Each
--load-shares value gets an engine of its own; the values alternate, --repeats times.

Per phase and load share: tokens/s, ms per step, drafted / accepted tokens per step, the share of steps that
drafted nothing, and the cost model's load factor and relative costs at the phase's end. At T=0 every run
emits the same tokens (the tree rule is lossless), so tokens/s compares the plans alone. Writes
controller-load.md / .json / .png into --out.
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

from scripts.bench_job_contention import TRAINER  # noqa: E402
from scripts.eval_versions import prompts_for  # noqa: E402

PHASES = ("idle", "loaded", "idle again")


def log(msg: str) -> None:
    print(f"[controller-load {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="target model folder (default: the served default)")
    ap.add_argument("--heads", type=Path, default=ROOT / "data" / "medusa-heads",
                    help="Medusa heads folder (default data/medusa-heads, where `draftsmith bootstrap` leaves them)")
    ap.add_argument("--load-shares", type=float, nargs="+", default=None,
                    help="LOAD_SHARE values to compare (default: 0, per-size means alone, and the module's default)")
    ap.add_argument("--depth-probes", nargs="+", choices=("on", "off"), default=["on"],
                    help="re-time stale deeper sizes (serving/controller.py RequestController._depth_probe): 'on' "
                         "(the default), 'off', or both to compare (each an engine of its own per load share)")
    ap.add_argument("--calibrate-loaded", action="store_true",
                    help="calibrate each engine beside the busy trainers, as a replica that measured its costs while "
                         "the machine was still starting up (the nineteenth session's run 4), then serve the phases")
    ap.add_argument("--categories", default="known,sql", help="prompt categories (scripts/online_traffic.py)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per category per phase")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the engine (1: a replica on 2 cores)")
    ap.add_argument("--trainers", type=int, default=2, help="busy 1-thread training processes in the loaded phase")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--tiny", action="store_true", help="tiny random models and heads: a smoke run in seconds")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "controller-load")
    args = ap.parse_args(argv)
    if min(args.prompts, args.max_tokens, args.threads, args.repeats) < 1 or args.trainers < 0:
        ap.error("--prompts, --max-tokens, --threads and --repeats must be >= 1, --trainers >= 0")
    if args.load_shares is not None and any(not 0.0 <= s < 1.0 for s in args.load_shares):
        ap.error("--load-shares values must be in [0, 1)")
    return args


def tiny_setup(work: Path) -> tuple[str, Path]:
    """A tiny target and random heads for the smoke run."""
    import torch

    from serving.decoding.medusa import HeadsConfig, MedusaHeads
    from serving.engine import Engine
    from tests import tiny_models

    target, _ = tiny_models.save_pair(work / "models", draft_layers=1)
    model = Engine.from_paths(str(target), None, dtype=torch.float32).target.model
    torch.manual_seed(0)
    heads = MedusaHeads.for_target(model, HeadsConfig(model.config.hidden_size, 3, 1, True), list(range(259)))
    return str(target), heads.save(work / "heads", built_by="bench_controller_load --tiny")


def prompts(engine, categories: list[str], n: int, seed: int, max_tokens: int) -> list[list[int]]:
    return [ids for c in categories
            for ids in prompts_for(engine.tokenizer, c, n, seed, engine.max_context, max_tokens)]


def start_trainers(n: int, seconds: float) -> list[subprocess.Popen]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return [subprocess.Popen([sys.executable, "-c", TRAINER, "0", str(seconds)], env=env, stdout=subprocess.DEVNULL)
            for _ in range(n)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


def run_phase(engine, spec, sampling, ps: list[list[int]]) -> dict:
    t0 = time.perf_counter()
    steps = drafted = accepted = zero = tokens = 0
    for ids in ps:
        res = engine.generate_all(ids, sampling, spec)
        st = res.stats
        steps, drafted, accepted = steps + st.steps, drafted + st.draft_tokens, accepted + st.accepted_tokens
        zero += st.zero_draft_steps
        tokens += len(res.token_ids)
    seconds = time.perf_counter() - t0
    snap = engine.costs.snapshot()
    base = snap["target_s"].get(1) or 1.0
    return {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": tokens / seconds,
            "ms_per_step": 1000 * seconds / steps, "drafted_per_step": drafted / steps,
            "accepted_per_step": accepted / steps, "zero_draft_share": zero / steps, "steps": steps,
            "load": snap.get("load", 1.0),
            "relative_target_s": {str(n): round(t / base, 3) for n, t in sorted(snap["target_s"].items()) if n <= 9}}


def main(argv=None) -> int:
    args = parse_args(argv)
    import tempfile

    import torch

    import serving.controller as controller
    from serving.config import AUTO_MODE, SamplingParams, SpecParams, served_knobs, served_mode
    from serving.engine import Engine

    shares = args.load_shares if args.load_shares is not None else [0.0, controller.LOAD_SHARE]
    arms = [(share, probes) for share in shares for probes in args.depth_probes]
    min_gap = controller.DEPTH_PROBE_MIN_GAP
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="controller-load-"))
    if args.tiny:
        target, heads = tiny_setup(work)
        categories = ["sql", "json"]                   # the known prompts exceed the tiny models' context
    else:
        target, heads = args.target, args.heads
        if not (Path(heads) / "medusa_heads.json").is_file():
            raise SystemExit(f"no Medusa heads folder at {heads}: run `draftsmith bootstrap` or pass --heads")
        categories = [c.strip() for c in args.categories.split(",") if c.strip()]
    mode = served_mode(AUTO_MODE, has_draft=False, has_heads=True, has_eagle=False)
    spec = SpecParams(mode=mode, gamma=4, extra=served_knobs(mode))
    sampling = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    rows = []
    for rep in range(args.repeats):
        for share, probes in (arms if rep % 2 == 0 else list(reversed(arms))):
            controller.LOAD_SHARE = share
            controller.DEPTH_PROBE_MIN_GAP = min_gap if probes == "on" else 10 ** 9
            engine = Engine.from_paths(target, None, heads=str(heads))
            trainers = start_trainers(args.trainers, 3600) if args.calibrate_loaded else []
            try:
                if trainers:
                    time.sleep(1.0)
                engine.calibrate()                                     # no profile dir: measured afresh
            finally:
                stop(trainers)
            ps = prompts(engine, categories, args.prompts, args.seed, args.max_tokens)
            run_phase(engine, spec, sampling, ps[:1])                  # warm-up: the first request's shapes
            for phase in PHASES:
                trainers = start_trainers(args.trainers, 3600) if phase == "loaded" else []
                try:
                    if trainers:
                        time.sleep(1.0)
                    r = run_phase(engine, spec, sampling, ps)
                finally:
                    stop(trainers)
                rows.append({"repeat": rep, "load_share": share, "depth_probes": probes, "phase": phase, **r})
                log(f"repeat {rep} load share {share:g} depth probes {probes} {phase}: {r['tokens_per_s']:.2f} tok/s, "
                    f"{r['ms_per_step']:.0f} ms/step, drafted {r['drafted_per_step']:.2f} / accepted "
                    f"{r['accepted_per_step']:.2f} per step, {r['zero_draft_share']:.0%} plain steps, load {r['load']:.2f}")
    controller.LOAD_SHARE, controller.DEPTH_PROBE_MIN_GAP = shares[-1], min_gap
    write(args, rows, arms, categories)
    return 0


def write(args, rows: list[dict], arms: list[tuple], categories: list[str]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    setting = {"threads": args.threads, "trainers": args.trainers, "prompts_per_category": args.prompts,
               "categories": categories, "max_tokens": args.max_tokens, "temperature": 0.0, "repeats": args.repeats,
               "mode": "served default (medusa, adaptive)", "tiny": args.tiny, "cpu_count": os.cpu_count(),
               "calibrated": "beside the trainers" if args.calibrate_loaded else "idle"}
    (args.out / "controller-load.json").write_text(json.dumps({"setting": setting, "rows": rows}, indent=1))

    def mean(arm, phase, key):
        vs = [r[key] for r in rows if (r["load_share"], r.get("depth_probes", "on")) == arm and r["phase"] == phase]
        return sum(vs) / len(vs)

    def label(arm):
        return f"share {arm[0]:g}, depth probes {arm[1]}"

    lines = [f"Served default (Medusa heads, adaptive tree), T=0, {args.prompts} prompts x {len(categories)} categories "
             f"({', '.join(categories)}) x {args.max_tokens} tokens per phase; engine on {args.threads} thread(s); "
             f"loaded = beside {args.trainers} busy 1-thread trainers; calibrated {setting['calibrated']}; mean of "
             f"{args.repeats} repeat(s).", "",
             "| load share, depth probes | phase | tokens/s | ms per step | drafted per step | accepted per step | plain steps | "
             "load factor at end |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for arm in arms:
        for phase in PHASES:
            lines.append(f"| {label(arm)} | {phase} | {mean(arm, phase, 'tokens_per_s'):.2f} | "
                         f"{mean(arm, phase, 'ms_per_step'):.0f} | {mean(arm, phase, 'drafted_per_step'):.2f} | "
                         f"{mean(arm, phase, 'accepted_per_step'):.2f} | {mean(arm, phase, 'zero_draft_share'):.0%} | "
                         f"{mean(arm, phase, 'load'):.2f} |")
    table = "\n".join(lines)
    print(table)
    (args.out / "controller-load.md").write_text(table + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        xs = [j + i * width for j in range(len(PHASES))]
        axes[0].bar(xs, [mean(arm, p, "tokens_per_s") for p in PHASES], width, label=label(arm))
        axes[1].bar(xs, [mean(arm, p, "drafted_per_step") for p in PHASES], width, label=label(arm))
    for ax, title in zip(axes, ("tokens/s", "drafted tokens per step")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(PHASES))], PHASES)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.suptitle("The adaptive controller through a load change (T=0, served default)")
    fig.tight_layout()
    fig.savefig(args.out / "controller-load.png", dpi=110)


if __name__ == "__main__":
    sys.exit(main())
