"""Decoding-rules benchmark (issue 7): the MJSD paper's Table 2 for every rule, its Table 3 (MJSD beams),
its Figure 4 (tau sweep), and the expected speed-up formula next to the measured one.

    .venv/bin/python scripts/bench_rules.py --draft data/drafts/bootstrap [--prompts 10 --max-tokens 128]
    .venv/bin/python scripts/bench_rules.py --draft DIR --device cuda            # J/token from NVML

One process, batch 1, the same held-out prompts and per-prompt seeds for every run (ratios are same-run
ratios). Helpers (run_engine_mode, summarise, perplexity, to_markdown, plot) are scripts/bench_decode.py's.

- Table 2 (every --modes entry; "target" first, the baseline): tokens/s, speed-up over target-only,
  mean accepted length (accepted draft tokens per verification step), output perplexity under the
  target (exp of the mean NLL of the generated tokens under the unwarped target), J/token (null unless
  NVML reads a GPU).
- Table 3: MJSD with --beams-sweep beams (paper: 2, 4, 6, 8); Figure 4: MJSD over --taus (0..1), speed-up
  and perplexity against tau (PNG). Runs whose settings equal Table 2's MJSD row reuse that row.
- Expected speed-up of speculative sampling (its expected improvement factor in Leviathan et al. 2023,
  "Fast Inference from Transformers via Speculative Decoding"):
      S(alpha, gamma, c) = (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1))
  alpha = accepted / (accepted + rejections) over its steps (each step examines draft tokens until the
  first rejection, so this is the per-token acceptance estimate); c = draft / target time of one cached
  one-token forward, measured here. Also shown with the measured verification cost v = target time of
  gamma + 1 tokens / one token in place of the 1 (the paper's formula assumes v = 1).

Warm-up (untimed): 8 tokens per configuration on CPU; on CUDA every configuration over every prompt once,
because there the first forward with a new shape is slow (a cold tiny-model run measured 10x slower).
Writes rules_<set>_T<T>_<device>.{md,json} and .table2/.table3/.fig4 PNGs into --out; prints the tables.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_decode import plot, run_engine_mode, run_hf_assisted, summarise, to_markdown  # noqa: E402
from serving.config import MODE_KNOBS, MODES, SamplingParams, SpecParams  # noqa: E402
from serving.engine import Engine  # noqa: E402
from training.prompts import chat_prompt_ids, load_prompts  # noqa: E402

DEFAULT_MODES = ("target", "speculative", "mjsd", "spectr", "bild", "typical", "mentored", "ngram", "staged")
# MJSD paper, section 5.1 (averages over its Table 2): MJSD vs greedy and vs speculative, perplexity vs BiLD.
PAPER = {"mjsd_over_target": 2.21, "mjsd_over_speculative": 1.49, "mjsd_perplexity_vs_bild": -0.212}


def expected_speedup(alpha: float, gamma: int, c: float, verify_cost: float = 1.0) -> float:
    """(1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + verify_cost)); alpha -> 1 gives (gamma + 1) / (...)."""
    tokens = gamma + 1 if alpha >= 1.0 else (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)
    return tokens / (gamma * c + verify_cost)


def acceptance_alpha(row: dict) -> float | None:
    """Per-token acceptance from a run: accepted / (accepted + steps that ended in a rejection)."""
    per_position = row.get("accepted_per_position") or []
    if not row["steps"] or not per_position:
        return None
    rejections = row["steps"] - per_position[-1]          # steps that did not accept all gamma tokens
    examined = row["accepted"] + rejections
    return row["accepted"] / examined if examined else None


def forward_ms(model, prompt: list[int], new_tokens: int = 1, reps: int = 20) -> float:
    """Median ms of one cached forward over `new_tokens` tokens after `prompt` (the cache is cropped back
    to the prompt after each; prefill excluded)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    step = torch.tensor([prompt[-new_tokens:]], device=device)
    times = []
    with torch.no_grad():
        cache = model(torch.tensor([prompt], device=device), past_key_values=DynamicCache(), use_cache=True,
                      logits_to_keep=1).past_key_values
        for _ in range(reps + 2):
            sync()
            t0 = time.perf_counter()
            model(step, past_key_values=cache, use_cache=True, logits_to_keep=new_tokens)
            sync()
            times.append(time.perf_counter() - t0)
            cache.crop(-new_tokens)                          # a negative count: tokens to drop
    times = sorted(times[2:])                              # the first two are warm-up
    return 1000 * times[len(times) // 2]


def speedup_check(engine, prompt, spec_row: dict, measured: float, gamma: int) -> dict:
    """Formula vs measurement for speculative sampling (module docstring)."""
    target_ms = forward_ms(engine.target.model, prompt)
    draft_ms = forward_ms(engine.draft.model, prompt)
    verify_ms = forward_ms(engine.target.model, prompt, new_tokens=gamma + 1)
    c, v = draft_ms / target_ms, verify_ms / target_ms
    alpha = acceptance_alpha(spec_row)
    out = dict(gamma=gamma, alpha=None if alpha is None else round(alpha, 4), c=round(c, 4),
               verify_cost=round(v, 3), target_ms=round(target_ms, 3), draft_ms=round(draft_ms, 3),
               verify_ms=round(verify_ms, 3), measured_speedup=round(measured, 3),
               expected_speedup=None, expected_speedup_with_verify_cost=None)
    if alpha is not None:
        out["expected_speedup"] = round(expected_speedup(alpha, gamma, c), 3)
        out["expected_speedup_with_verify_cost"] = round(expected_speedup(alpha, gamma, c, v), 3)
    return out


def plot_tau(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    taus = [r["tau"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(taus, [r["speedup"] for r in rows], "o-", color="tab:blue", label="speed-up")
    ax.set_xlabel("acceptance threshold tau")
    ax.set_ylabel("speed-up over target-only", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(taus, [r["perplexity"] for r in rows], "s--", color="tab:red", label="perplexity")
    ax2.set_ylabel("output perplexity (target)", color="tab:red")
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_numbers(ap: argparse.ArgumentParser, text: str, name: str, kind=float) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--{name} takes comma-separated {kind.__name__}s, got {text!r}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="target model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--draft", required=True, help="draft model folder (same tokenizer)")
    ap.add_argument("--prompt-set", default="gsm8k", help="prompt source (training/prompts.py), held-out split")
    ap.add_argument("--prompts", type=int, default=10, help="number of prompts")
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt (paper: 128)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--beams", type=int, default=8)
    ap.add_argument("--tau", type=float, default=0.1)
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES),
                    help=f"Table 2 runs, 'target' first; any of {', '.join(MODES)}, hf_assisted")
    ap.add_argument("--knobs", default="{}",
                    help='per-mode knobs as JSON, e.g. \'{"bild": {"fallback_threshold": 0.6}}\' (config.MODE_KNOBS)')
    ap.add_argument("--beams-sweep", default="2,4,6,8", help="Table 3 beam counts ('' skips the table)")
    ap.add_argument("--taus", default="0,0.1,0.3,0.5,0.7,0.9,1", help="Figure 4 thresholds ('' skips it)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=[None, "bfloat16", "float16", "float32"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--warmup", choices=["short", "full"], default=None,
                    help="untimed runs first: 'short' = 8 tokens of one prompt per mode (CPU default); 'full' = "
                         "every mode over every prompt (CUDA default: first calls with new shapes are slow there)")
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or modes[0] != "target":
        ap.error("--modes must start with 'target' (the baseline every speed-up is measured against)")
    unknown = [m for m in modes if m not in MODES and m != "hf_assisted"]
    if unknown:
        ap.error(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}, hf_assisted")
    try:
        knobs = json.loads(args.knobs)
        if not isinstance(knobs, dict) or set(knobs) - set(MODE_KNOBS):
            raise ValueError(f"modes with knobs are {', '.join(MODE_KNOBS)}")
        specs = {m: SpecParams(mode=m, gamma=args.gamma, beams=args.beams, tau=args.tau, extra=knobs.get(m, {}))
                 for m in MODES}
    except ValueError as exc:
        ap.error(f"--knobs must be a JSON object mode -> {{knob: value}}: {exc}")
    beam_counts = parse_numbers(ap, args.beams_sweep, "beams-sweep", int)
    taus = parse_numbers(ap, args.taus, "taus")
    if args.prompts < 1 or args.max_tokens < 1:
        ap.error("--prompts and --max-tokens must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype) if args.dtype else None

    engine = Engine.from_paths(args.target, args.draft, device=args.device, dtype=dtype)
    prompts = [chat_prompt_ids(engine.tokenizer, t) for t in load_prompts(args.prompt_set, "heldout", args.prompts)]
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              max_tokens=args.max_tokens)
    mjsd = lambda beams, tau: SpecParams(mode="mjsd", gamma=args.gamma, beams=beams, tau=tau)
    sweeps = [mjsd(b, args.tau) for b in beam_counts] + [mjsd(args.beams, t) for t in taus]
    warmup = args.warmup or ("full" if args.device.startswith("cuda") else "short")
    t0 = time.time()
    unique = {json.dumps(sp.to_dict()): sp for sp in [specs[m] for m in modes if m != "hf_assisted"] + sweeps}
    for spec in unique.values():                                   # first calls, lazy imports, new shapes
        if warmup == "short":
            engine.generate_all(prompts[0], SamplingParams(max_tokens=8, seed=0), spec, log_mode="none")
        else:
            run_engine_mode(engine, prompts, sampling, spec, spec.mode)
    print(f"[bench] {warmup} warm-up: {time.time() - t0:.0f} s", flush=True)

    def timed(label: str, spec: SpecParams | None) -> dict:
        t0 = time.time()
        row = (run_hf_assisted(engine, prompts, sampling, args.gamma, label) if spec is None
               else run_engine_mode(engine, prompts, sampling, spec, label))
        print(f"[bench] {label:14s} {row['tokens']:5d} tokens in {row['wall']:.1f} s = "
              f"{row['tokens'] / row['wall']:.1f} tok/s ({time.time() - t0:.0f} s)", flush=True)
        return row

    runs = {m: timed(m, None if m == "hf_assisted" else specs[m]) for m in modes}
    base_tps = runs["target"]["tokens"] / runs["target"]["wall"]
    table2 = summarise(list(runs.values()), prompts, engine.target.model, base_tps)

    def mjsd_row(beams: int, tau: float) -> dict:
        if "mjsd" in runs and beams == args.beams and tau == args.tau:
            return runs["mjsd"]
        return timed(f"mjsd b={beams} tau={tau:g}", mjsd(beams, tau))

    table3 = summarise([mjsd_row(b, args.tau) for b in beam_counts], prompts, engine.target.model, base_tps) \
        if beam_counts else []
    for row, beams in zip(table3, beam_counts):
        row["mode"], row["beams"] = f"mjsd beams={beams}", beams
    tau_rows = summarise([mjsd_row(args.beams, t) for t in taus], prompts, engine.target.model, base_tps) \
        if taus else []
    for row, tau in zip(tau_rows, taus):
        row["mode"], row["tau"] = f"mjsd tau={tau:g}", tau

    by_mode = {r["mode"]: r for r in table2}
    check = speedup_check(engine, prompts[0], runs["speculative"], by_mode["speculative"]["speedup"], args.gamma) \
        if "speculative" in runs else None
    versus = {}
    if "mjsd" in by_mode:
        versus["mjsd_over_target"] = by_mode["mjsd"]["speedup"]
        if "speculative" in by_mode:
            versus["mjsd_over_speculative"] = round(by_mode["mjsd"]["speedup"] / by_mode["speculative"]["speedup"], 3)
        if "bild" in by_mode:
            ratio = by_mode["mjsd"]["perplexity"] / by_mode["bild"]["perplexity"]
            versus["mjsd_perplexity_vs_bild"] = round(ratio - 1, 3)

    setup = (f"target={engine.target_name} draft={args.draft} device={args.device} "
             f"dtype={next(engine.target.model.parameters()).dtype} threads={torch.get_num_threads()} "
             f"prompts={args.prompt_set}-heldout x{len(prompts)} max_tokens={args.max_tokens} T={args.temperature} "
             f"top_k={args.top_k} top_p={args.top_p} gamma={args.gamma} beams={args.beams} tau={args.tau} "
             f"knobs={json.dumps({m: specs[m].extra for m in modes if m in specs and specs[m].extra})}")
    sections = [setup, "", "Table 2 (every rule)", "", to_markdown(table2)]
    if table3:
        sections += ["", "Table 3 (MJSD, number of beams)", "", to_markdown(table3)]
    if tau_rows:
        sections += ["", "Figure 4 (MJSD, acceptance threshold tau)", "", to_markdown(tau_rows)]
    if check:
        sections += ["", "Expected speed-up of speculative sampling (formula) vs measured", "", to_markdown([check])]
    if versus:
        sections += ["", "MJSD against the paper (ours / paper)", "",
                     to_markdown([{k: f"{v} / {PAPER[k]}" for k, v in versus.items()}])]
    md = "\n".join(sections)
    print(md)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"rules_{args.prompt_set}_T{args.temperature:g}_{args.device.replace(':', '')}"
    (out / f"{stem}.md").write_text(md + "\n")
    (out / f"{stem}.json").write_text(json.dumps(dict(
        setup=setup, table2=table2, table3=table3, tau_sweep=tau_rows, expected_speedup=check,
        mjsd_vs_paper=dict(ours=versus, paper=PAPER)), indent=1))
    plot(table2, out / f"{stem}.table2.png", setup[:140])
    if table3:
        plot(table3, out / f"{stem}.table3.png", "MJSD: number of beams")
    if tau_rows:
        plot_tau(tau_rows, out / f"{stem}.fig4.png",
                 f"MJSD vs tau: {Path(str(engine.target_name)).name} + draft {Path(args.draft).name}, {args.device}\n"
                 f"gamma={args.gamma} beams={args.beams} T={args.temperature} x{len(prompts)} prompts")
    print(f"[bench] wrote {out / stem}.{{md,json}} and PNGs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
