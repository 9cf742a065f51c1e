"""Decoding benchmark: target-only, speculative sampling, MJSD and Hugging Face assisted generation,
side by side over the same prompts, batch 1, one process (so ratios are same-run ratios).

    .venv/bin/python scripts/bench_decode.py --draft PATH [--prompts gsm8k --n 10 --max-tokens 96]

Reports tokens/s, ratio to target-only, mean accepted length (draft tokens accepted per step),
acceptance rate, output perplexity under the target (the MJSD paper's quality metric: exp of the
mean negative log-likelihood of the generated tokens under the *unwarped* target), the share of
wall time spent outside model forwards (Python overhead), and J/token when NVML sees a GPU.
Writes a markdown table, a JSON file and a PNG bar chart into --out.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving.config import SamplingParams, SpecParams  # noqa: E402
from serving.engine import Engine  # noqa: E402
from training.prompts import chat_prompt_ids, load_prompts  # noqa: E402


def perplexity(model, prompt: list[int], output: list[int]) -> tuple[float, int]:
    """Sum of NLL of `output` under `model` given `prompt`, and the token count."""
    if not output:
        return 0.0, 0
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + output], device=device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1: -1].float()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(output, device=device), reduction="sum")
    return float(nll), len(output)


def run_engine_mode(engine, prompts, sampling, spec, label):
    agg = dict(label=label, tokens=0, wall=0.0, draft=0.0, target=0.0, steps=0, draft_tokens=0,
               accepted=0, nll=0.0, nll_tokens=0, energy=0.0, energy_known=True, outputs=[],
               accepted_per_position=[0] * (spec.gamma if spec.mode != "target" else 0))
    for i, prompt in enumerate(prompts):
        s = SamplingParams(**{**sampling.__dict__, "seed": 1000 + i})
        t0 = time.perf_counter()
        res = engine.generate_all(prompt, s, spec, log_mode="none")
        agg["wall"] += time.perf_counter() - t0
        st = res.stats
        agg["tokens"] += len(res.token_ids)
        agg["draft"] += st.draft_time_s
        agg["target"] += st.target_time_s
        agg["steps"] += st.steps
        agg["draft_tokens"] += st.draft_tokens
        agg["accepted"] += st.accepted_tokens
        agg["accepted_per_position"] = [a + b for a, b in zip(agg["accepted_per_position"], st.accepted_per_position)]
        if st.energy_j is None:
            agg["energy_known"] = False
        else:
            agg["energy"] += st.energy_j
        agg["outputs"].append(res.token_ids)
    return agg


def run_hf_assisted(engine, prompts, sampling, gamma, label):
    """transformers' generate(assistant_model=...) on the same pair, same warps, same prompts."""
    tm, dm = engine.target.model, engine.draft.model
    # HF needs the draft's full output layer: reload it plainly if the engine cut it.
    if engine.draft.output_token_ids is not None:
        from serving.models import load_causal_lm

        dm = load_causal_lm(engine.draft.path, engine.device, next(tm.parameters()).dtype)
    dm.generation_config.num_assistant_tokens = gamma
    dm.generation_config.num_assistant_tokens_schedule = "constant"
    dm.generation_config.assistant_confidence_threshold = 0.0
    agg = dict(label=label, tokens=0, wall=0.0, draft=0.0, target=0.0, steps=0, draft_tokens=0,
               accepted=0, nll=0.0, nll_tokens=0, energy=0.0, energy_known=False, outputs=[])
    greedy = sampling.temperature == 0
    for i, prompt in enumerate(prompts):
        torch.manual_seed(1000 + i)
        kw = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=sampling.temperature,
                                                       top_k=sampling.top_k or None, top_p=sampling.top_p)
        ids = torch.tensor([prompt], device=next(tm.parameters()).device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = tm.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=dm,
                              max_new_tokens=sampling.max_tokens, eos_token_id=sorted(engine.eos_token_ids),
                              pad_token_id=engine.tokenizer.pad_token_id or 0, **kw)
        agg["wall"] += time.perf_counter() - t0
        toks = out[0, len(prompt):].tolist()
        agg["tokens"] += len(toks)
        agg["outputs"].append(toks)
    return agg


def token_acceptance(r) -> float | None:
    """Per-token acceptance (Leviathan et al.'s alpha): accepted draft tokens over draft tokens the
    target actually judged (position i is judged only when positions 1..i-1 were accepted). The
    `acceptance_rate` column (vLLM's) divides by every proposed token instead, so at gamma 4 it is
    about (alpha + ... + alpha^4) / 4."""
    app = r.get("accepted_per_position") or []
    if not r.get("steps") or not app:
        return None
    judged = r["steps"] + sum(app[:-1])
    return round(sum(app) / judged, 3) if judged else None


def summarise(rows, prompts, target_model, base_tokens_per_s: float | None = None):
    """One table row per run; speed-up against `base_tokens_per_s` (default: the first row's tokens/s)."""
    base = base_tokens_per_s or rows[0]["tokens"] / rows[0]["wall"]
    table = []
    for r in rows:
        r["nll"], r["nll_tokens"] = 0.0, 0
        for prompt, out in zip(prompts, r["outputs"]):
            nll, n = perplexity(target_model, prompt, out)
            r["nll"] += nll
            r["nll_tokens"] += n
        tps = r["tokens"] / r["wall"]
        model_time = r["draft"] + r["target"]
        table.append(dict(
            mode=r["label"], tokens=r["tokens"], tokens_per_s=round(tps, 2), speedup=round(tps / base, 3),
            mean_accepted_length=round(r["accepted"] / r["steps"], 3) if r["steps"] else None,
            acceptance_rate=round(r["accepted"] / r["draft_tokens"], 3) if r["draft_tokens"] else None,
            token_acceptance=token_acceptance(r),
            perplexity=round(math.exp(r["nll"] / max(1, r["nll_tokens"])), 3),
            overhead_share=round(1 - model_time / r["wall"], 3) if model_time else None,
            j_per_token=round(r["energy"] / r["tokens"], 4) if r["energy_known"] and r["tokens"] else None,
        ))
    return table


def to_markdown(table) -> str:
    cols = list(table[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in table:
        lines.append("| " + " | ".join("-" if row[c] is None else str(row[c]) for c in cols) + " |")
    return "\n".join(lines)


def plot(table, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r["mode"] for r in table]
    ax.bar(names, [r["speedup"] for r in table], color="tab:blue")
    ax.axhline(1.0, color="grey", lw=1, ls="--")
    ax.set_ylabel("speed-up over target-only")
    ax.set_title(title, fontsize=9)
    for i, r in enumerate(table):
        ax.text(i, r["speedup"], f'{r["tokens_per_s"]:.1f} tok/s', ha="center", va="bottom", fontsize=8)
    plt.xticks(rotation=15, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="target model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--draft", required=True, help="draft model folder (same tokenizer)")
    ap.add_argument("--prompts", default="gsm8k", help="prompt source (training/prompts.py), held-out split")
    ap.add_argument("--n", type=int, default=10, help="number of prompts")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--beams", type=int, default=8)
    ap.add_argument("--tau", type=float, default=0.1)
    ap.add_argument("--modes", default="target,speculative,mjsd,hf_assisted")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=[None, "bfloat16", "float16", "float32"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    engine = Engine.from_paths(args.target, args.draft, device=args.device, dtype=dtype)
    prompts = [chat_prompt_ids(engine.tokenizer, t) for t in load_prompts(args.prompts, "heldout", args.n)]
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              max_tokens=args.max_tokens)
    # warm-up (first-call allocations, lazy imports)
    engine.generate_all(prompts[0], SamplingParams(max_tokens=8, seed=0), SpecParams(mode="speculative"), log_mode="none")
    rows = []
    for mode in args.modes.split(","):
        t0 = time.time()
        if mode == "hf_assisted":
            rows.append(run_hf_assisted(engine, prompts, sampling, args.gamma, "hf_assisted"))
        else:
            spec = SpecParams(mode=mode, gamma=args.gamma, beams=args.beams, tau=args.tau)
            rows.append(run_engine_mode(engine, prompts, sampling, spec, mode))
        r = rows[-1]
        print(f"[bench] {mode:12s} {r['tokens']:5d} tokens in {r['wall']:.1f} s = {r['tokens'] / r['wall']:.1f} tok/s "
              f"({time.time() - t0:.0f} s)", flush=True)
    table = summarise(rows, prompts, engine.target.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    setup = (f"target={engine.target_name} draft={args.draft} device={args.device} "
             f"dtype={next(engine.target.model.parameters()).dtype} threads={torch.get_num_threads()} "
             f"prompts={args.prompts}-heldout x{len(prompts)} max_tokens={args.max_tokens} T={args.temperature} "
             f"top_k={args.top_k} top_p={args.top_p} gamma={args.gamma} beams={args.beams} tau={args.tau}")
    md = to_markdown(table)
    print(setup)
    print(md)
    stem = f"decode_{args.prompts}_T{args.temperature}_{args.device}"
    (out / f"{stem}.md").write_text(setup + "\n\n" + md + "\n")
    (out / f"{stem}.json").write_text(json.dumps({"setup": setup, "rows": table}, indent=1))
    plot(table, out / f"{stem}.png", setup[:140])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
