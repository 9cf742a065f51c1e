"""Decoding benchmark: target-only, speculative sampling, MJSD and Hugging Face assisted generation,
side by side over the same prompts, batch 1, one process (so ratios are same-run ratios).

    .venv/bin/python scripts/bench_decode.py --draft PATH [--prompts gsm8k --n 10 --max-tokens 96]

A draft whose `draftsmith.json` lists `output_token_ids` computes only those output rows in our engine,
while HF assisted generation needs the draft's full output layer. So that the table separates the
vocabulary cut from the engine, `--full-vocab` (default on) adds the row "speculative (full-vocab
draft)": our engine with the SAME draft weights over the full vocabulary (a second Engine on a view of
the draft folder without the cut), next to "speculative" (the cut as served) and "HF assisted
(full-vocab draft)". Every row gets one untimed warm-up generation first, HF included. The rows run
prompt by prompt, back to back, the first row rotating (a machine whose speed drifts during the run slows
every row alike; run row by row, an H200's target-only row came out 2x slower than the zero-draft MJSD
row after it, docs/benchmarks.md "On a GPU"). A second draft
kind joins with `--medusa-heads PATH --modes ...,medusa` (Medusa heads on the target's hidden state,
serving/decoding/medusa.py), and the EAGLE-style head with `--eagle-head PATH --modes ...,eagle`
(serving/decoding/eagle.py); `medusa+typical` (or `tree+typical`, `eagle+typical`) runs it with typical
acceptance on the tree.

Reports tokens/s, ratio to target-only, mean accepted length (draft tokens accepted per step),
acceptance rate, output perplexity under the target (the MJSD paper's quality metric: exp of the
mean negative log-likelihood of the generated tokens under the *unwarped* target), the share of
wall time spent outside model forwards (Python overhead), and J/token when NVML sees a GPU.
Writes a markdown table, a JSON file and a PNG bar chart into --out.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving.config import MODES, SamplingParams, SpecParams  # noqa: E402
from serving.engine import Engine  # noqa: E402
from serving.models import read_output_token_ids  # noqa: E402
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


def add_row_fairness_flags(ap: argparse.ArgumentParser) -> None:
    """The flags that keep same-run rows comparable (this script and scripts/bench_traffic.py)."""
    ap.add_argument("--keep-prefix-cache", action="store_true",
                    help="let a row reuse the prompt's KV from an earlier row (the engine's prefix cache); by "
                         "default it is emptied before every timed row, so the rows that batch (which read it) and "
                         "the tree modes (which run alone and always prefill) pay the same prefill")
    ap.add_argument("--warm-each", action=argparse.BooleanOptionalAction, default=None,
                    help="decode each prompt once, untimed, before its timed rows (default: on a GPU, where the "
                         "first generation through new sequence lengths ran 2-3x slower than the rest on an H200 "
                         "and so penalised whichever row came first, docs/benchmarks.md \"On a GPU\")")


KEEP_PREFIX_CACHE = False   # set from --keep-prefix-cache


def engine_agg(label: str, spec) -> dict:
    return dict(label=label, tokens=0, wall=0.0, draft=0.0, target=0.0, steps=0, draft_tokens=0,
                accepted=0, nll=0.0, nll_tokens=0, energy=0.0, energy_known=True, outputs=[],
                accepted_per_position=[0] * (spec.gamma if spec.mode != "target" else 0))


def engine_prompt(engine, agg: dict, i: int, prompt, sampling, spec) -> None:
    """Prompt `i` through the engine with `spec`, added to `agg` (seed 1000 + i, as every row uses)."""
    s = SamplingParams(**{**sampling.__dict__, "seed": 1000 + i})
    if not KEEP_PREFIX_CACHE:      # every row prefills its prompt (--keep-prefix-cache)
        engine.scheduler.prefix_cache.clear()
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


def run_engine_mode(engine, prompts, sampling, spec, label):
    """Every prompt with one mode, in order (scripts/bench_rules.py); bench_decode's own rows interleave."""
    agg = engine_agg(label, spec)
    for i, prompt in enumerate(prompts):
        engine_prompt(engine, agg, i, prompt, sampling, spec)
    return agg


def full_vocab_view(draft_path: Path, into: Path) -> Path | None:
    """A folder under `into` that is the draft folder `draft_path` without its vocabulary cut: a symlink
    to every entry but `draftsmith.json`, which is rewritten without `output_token_ids` (its other keys
    kept). Same weights, same tokenizer; the engine then computes the draft's full output layer.
    None when the draft has no cut (its own folder already is the full-vocab draft)."""
    draft_path = Path(draft_path).resolve()
    if read_output_token_ids(draft_path) is None:
        return None
    view = Path(into) / f"{draft_path.name}-full-vocab"
    view.mkdir(parents=True)
    for entry in draft_path.iterdir():
        if entry.name != "draftsmith.json":
            os.symlink(entry, view / entry.name)
    meta = json.loads((draft_path / "draftsmith.json").read_text())
    meta.pop("output_token_ids", None)
    (view / "draftsmith.json").write_text(json.dumps(meta))
    assert read_output_token_ids(view) is None
    return view


def warm_up(engine, prompt) -> None:
    """One untimed generation (first-call allocations, lazy imports, kernel selection)."""
    engine.generate_all(prompt, SamplingParams(max_tokens=8, seed=0), SpecParams(mode="speculative"), log_mode="none")


def hf_assisted_runner(engine, prompts, sampling, gamma, label):
    """transformers' generate(assistant_model=...) on the same pair, same warps, same prompts, after one
    untimed warm-up generation (as the engine rows get): (its row, a function that runs prompt i into
    it). HF needs the draft's full output layer, so it uses the engine's draft as is when uncut, else
    reloads the draft folder plainly."""
    tm, dm = engine.target.model, engine.draft.model
    if engine.draft.output_token_ids is not None:
        from serving.models import load_causal_lm

        dm = load_causal_lm(engine.draft.path, engine.device, next(tm.parameters()).dtype)
    dm.generation_config.num_assistant_tokens = gamma
    dm.generation_config.num_assistant_tokens_schedule = "constant"
    dm.generation_config.assistant_confidence_threshold = 0.0
    agg = dict(label=label, tokens=0, wall=0.0, draft=0.0, target=0.0, steps=0, draft_tokens=0,
               accepted=0, nll=0.0, nll_tokens=0, energy=0.0, energy_known=False, outputs=[])
    greedy = sampling.temperature == 0
    kw = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=sampling.temperature,
                                                   top_k=sampling.top_k or None, top_p=sampling.top_p)
    device = next(tm.parameters()).device

    def generate(prompt, max_new_tokens):
        ids = torch.tensor([prompt], device=device)
        with torch.no_grad():
            out = tm.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=dm,
                              max_new_tokens=max_new_tokens, eos_token_id=sorted(engine.eos_token_ids),
                              pad_token_id=engine.tokenizer.pad_token_id or 0, **kw)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out

    torch.manual_seed(0)
    generate(prompts[0], 8)                       # warm-up, untimed (as main() does for the engine)

    def one(i: int, prompt) -> None:
        torch.manual_seed(1000 + i)
        t0 = time.perf_counter()
        out = generate(prompt, sampling.max_tokens)
        agg["wall"] += time.perf_counter() - t0
        toks = out[0, len(prompt):].tolist()
        agg["tokens"] += len(toks)
        agg["outputs"].append(toks)

    return agg, one


def run_hf_assisted(engine, prompts, sampling, gamma, label):
    """`hf_assisted_runner` over every prompt in order (scripts/bench_rules.py)."""
    agg, one = hf_assisted_runner(engine, prompts, sampling, gamma, label)
    for i, prompt in enumerate(prompts):
        one(i, prompt)
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

    fig, ax = plt.subplots(figsize=(max(7.0, 1.5 * len(table)), 3.5))
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
    ap.add_argument("--medusa-heads", default=None,
                    help="Medusa heads folder (python -m training.heads): adds the draft kind as mode 'medusa'")
    ap.add_argument("--eagle-head", default=None,
                    help="EAGLE-style head folder (python -m training.heads --kind eagle): adds the kind as mode 'eagle'")
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
    ap.add_argument("--full-vocab", action=argparse.BooleanOptionalAction, default=True,
                    help="with 'speculative' in --modes and a draft with a vocabulary cut, also run our engine on "
                         "the same draft over its full vocabulary (row 'speculative (full-vocab draft)')")
    ap.add_argument("--suffix-seed", default=None,
                    help="teacher data whose answers seed the engine's suffix store, as a replica's is (default: "
                         "the bootstrap's <data>/bootstrap/teacher.safetensors where it exists; 'none': an empty "
                         "store); the store never learns the run's own answers (each prompt runs once per row)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=[None, "bfloat16", "float16", "float32"])
    ap.add_argument("--threads", type=int, default=None)
    add_row_fairness_flags(ap)
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    global KEEP_PREFIX_CACHE
    KEEP_PREFIX_CACHE = args.keep_prefix_cache
    unknown = [m for m in args.modes.split(",") if m != "hf_assisted" and m.partition("+")[0] not in MODES]
    if unknown:
        ap.error(f"unknown mode(s) {', '.join(unknown)} in --modes; choose from {', '.join(MODES)}, hf_assisted "
                 "(the served default drafts with the heads: mode medusa, adaptive)")
    if any(m.startswith("medusa") for m in args.modes.split(",")) and not args.medusa_heads:
        ap.error("mode 'medusa' needs --medusa-heads PATH (heads from `python -m training.heads`)")
    if any(m.strip().startswith("eagle") for m in args.modes.split(",")) and not args.eagle_head:
        ap.error("an `eagle` row needs --eagle-head PATH (a head from `python -m training.heads --kind eagle`)")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    with contextlib.ExitStack() as stack:
        return _run(args, dtype, stack)


def _run(args, dtype, stack: contextlib.ExitStack) -> int:
    from serving.decoding.suffix import resolve_seed

    modes = args.modes.split(",")
    engine = Engine.from_paths(args.target, args.draft, device=args.device, dtype=dtype, heads=args.medusa_heads,
                                eagle=args.eagle_head)
    seed = resolve_seed(args.suffix_seed)
    seeded = engine.seed_suffix_store(seed) if seed else 0
    engine.suffix_learn = False       # (the runs pass log_mode "none", which learns nothing either)
    prompts = [chat_prompt_ids(engine.tokenizer, t) for t in load_prompts(args.prompts, "heldout", args.n)]
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              max_tokens=args.max_tokens)
    cut = engine.draft.output_token_ids
    draft_vocab = f"{len(cut)}/{engine.vocab_size} output rows" if cut is not None else "full vocabulary"
    full_engine = None        # the same draft without its vocabulary cut
    if args.full_vocab and "speculative" in modes:
        view = full_vocab_view(engine.draft.path, Path(stack.enter_context(tempfile.TemporaryDirectory())))
        if view is None:
            print("[bench] the draft has no vocabulary cut: 'speculative' already is the full-vocab row", flush=True)
        else:
            full_engine = Engine.from_paths(args.target, str(view), device=args.device, dtype=dtype)
    warm_up(engine, prompts[0])
    if full_engine is not None:
        warm_up(full_engine, prompts[0])
    runs = []                 # (label, its row, a function that runs prompt i into it)
    for mode in modes:
        if mode == "hf_assisted":
            # HF always runs the full output layer: the full-vocab engine's draft when there is one.
            label = "HF assisted (full-vocab draft)"
            runs.append((label, *hf_assisted_runner(full_engine or engine, prompts, sampling, args.gamma, label)))
            continue
        base, _, rule = mode.partition("+")            # e.g. medusa+typical: the tree with typical acceptance
        spec = SpecParams(mode=base, gamma=args.gamma, beams=args.beams, tau=args.tau,
                          extra={"rule": rule} if rule else {})
        engines = [(mode, engine)]
        if mode == "speculative" and full_engine is not None:
            engines.append(("speculative (full-vocab draft)", full_engine))
        for label, eng in engines:
            agg = engine_agg(label, spec)
            runs.append((label, agg, lambda i, p, eng=eng, agg=agg, spec=spec: engine_prompt(eng, agg, i, p,
                                                                                             sampling, spec)))
    # Prompt by prompt, every row back to back, the starting row rotating: a change of the machine's speed
    # during the run (a CPU host's drift, a GPU's first minute) hits every row alike, not the first one.
    t0 = time.time()
    warm_each = args.warm_each if args.warm_each is not None else str(args.device).startswith("cuda")
    for i, prompt in enumerate(prompts):
        if warm_each:        # the prompt's sequence lengths once, untimed (see --warm-each)
            engine.generate_all(prompt, SamplingParams(**{**sampling.__dict__, "seed": 1000 + i}),
                                SpecParams(mode="target"), log_mode="none")
        k = i % len(runs)
        for _, _, one in runs[k:] + runs[:k]:
            one(i, prompt)
        print(f"[bench] prompt {i + 1}/{len(prompts)}: " + ", ".join(
            f"{label} {agg['tokens'] / agg['wall']:.1f}" for label, agg, _ in runs if agg["wall"])
            + f" tok/s ({time.time() - t0:.0f} s)", flush=True)
    rows = [agg for _, agg, _ in runs]
    table = summarise(rows, prompts, engine.target.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    setup = (f"target={engine.target_name} draft={args.draft} device={args.device} "
             f"dtype={next(engine.target.model.parameters()).dtype} threads={torch.get_num_threads()} "
             f"prompts={args.prompts}-heldout x{len(prompts)} max_tokens={args.max_tokens} T={args.temperature} "
             f"top_k={args.top_k} top_p={args.top_p} gamma={args.gamma} beams={args.beams} tau={args.tau} "
             f"draft_vocab={draft_vocab} suffix_seed={seed or 'none'} ({seeded} answers)")
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
