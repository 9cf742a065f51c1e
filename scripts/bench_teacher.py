"""Teacher-data throughput of the bootstrap: the target's greedy answers (+ top-20 log-probs) per second.

    .venv/bin/python scripts/bench_teacher.py [--target DIR] [--prompts 256] [--chunk 64]
        [--max-new-tokens 128] [--out docs/results/teacher]

Configurations: attention `sdpa` (transformers' default, PyTorch's CPU SDPA kernel) or `grouped`
(training/teacher.py's grouped-query attention), at batch 32 or 64, with the default dynamic KV cache
or a static one. The prompts (GSM8K train split, chat template, sorted by length as the bootstrap does)
are cut into chunks of --chunk, and every configuration runs on each chunk before the next chunk
starts, so a slow spell of this shared VM hits all of them alike. Reported: answer tokens/s
(tokens up to and including EOS; padding rows after EOS are not counted) summed over chunks.
Writes bench_teacher.json and bench_teacher.png to --out and prints a markdown table.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONFIGS = [("sdpa", 32, "dynamic"), ("grouped", 32, "dynamic"), ("grouped", 64, "dynamic"),
           ("grouped", 64, "static")]


def answer_tokens(sequences, width: int, eos: int) -> int:
    n = 0
    for row in sequences[:, width:].tolist():
        n += row.index(eos) + 1 if eos in row else len(row)
    return n


def run_config(model, tok, prompts, attention: str, batch: int, cache: str, max_new: int) -> tuple[int, float]:
    import torch

    from training.teacher import attention_implementation, left_pad, topk_logprobs

    eos = tok.eos_token_id
    tokens, seconds = 0, 0.0
    for b in range(0, len(prompts), batch):
        part = prompts[b: b + batch]
        ids, mask = left_pad(part, eos)
        width = ids.shape[1]
        ctx = attention_implementation(model) if attention == "grouped" else contextlib.nullcontext()
        kw = {"cache_implementation": "static"} if cache == "static" else {}
        t0 = time.perf_counter()
        with torch.no_grad(), ctx:
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True, pad_token_id=eos,
                                 eos_token_id=eos, **kw)
            # what the teacher does with the scores, so the comparison includes it
            topk_logprobs(out.scores, 20)
        seconds += time.perf_counter() - t0
        tokens += answer_tokens(out.sequences, width, eos)
    return tokens, seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None, help="target model folder (default: the SmolLM2 target)")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=64, help="prompts per chunk (a multiple of every batch size)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "teacher")
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.chunk < 64 or args.chunk % 64:
        ap.error("--prompts must be >= 1 and --chunk a positive multiple of 64")
    import torch

    from serving.models import ensure_default_target, load_causal_lm, load_tokenizer, resolve_model_path
    from training.prompts import chat_prompt_ids, load_prompts

    path = resolve_model_path(args.target) if args.target else ensure_default_target()
    tok = load_tokenizer(path)
    model = load_causal_lm(path, "cpu")     # the serving dtype (serving.models.default_dtype)
    prompts = sorted((chat_prompt_ids(tok, t) for t in load_prompts("gsm8k", "train", args.prompts)), key=len)
    totals = {c: [0, 0.0] for c in CONFIGS}
    t_start = time.time()
    for c0 in range(0, len(prompts), args.chunk):
        chunk = prompts[c0: c0 + args.chunk]
        for cfg in CONFIGS:
            n, s = run_config(model, tok, chunk, *cfg, args.max_new_tokens)
            totals[cfg][0] += n
            totals[cfg][1] += s
            print(f"[teacher-bench] prompts {c0 + len(chunk)}/{len(prompts)} {cfg}: {n / s:.0f} tok/s "
                  f"({time.time() - t_start:.0f} s elapsed)", flush=True)
    base = totals[CONFIGS[0]][0] / totals[CONFIGS[0]][1]
    rows = [dict(attention=a, batch=b, cache=c, answer_tokens=n, seconds=round(s, 1),
                 tokens_per_s=round(n / s, 1), vs_sdpa_32=round(n / s / base, 3))
            for (a, b, c), (n, s) in totals.items()]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_teacher.json").write_text(json.dumps({"prompts": len(prompts), "rows": rows}, indent=1))
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in cols) + " |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    ax.barh([f"{r['attention']} b{r['batch']} {r['cache']}" for r in rows], [r["tokens_per_s"] for r in rows])
    ax.set_xlabel("teacher answer tokens/s (CPU)")
    ax.set_title(f"bootstrap teacher data, {len(prompts)} GSM8K prompts")
    fig.tight_layout()
    fig.savefig(args.out / "bench_teacher.png", dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
