"""How many rows of the target's output layer the heads' tree steps compute, with `verdict_on_demand` (the
rows a tree rule reads: the root's, the nodes' with children, one leaf) against every row of the pass (what
the engine computed before), on GSM8K held-out prompts and the traffic prompts, mode medusa as served (its
default tree knobs, the adaptive controller), T=0 and T=1; and what one output row costs on this host.

    .venv/bin/python docs/results/on-demand-rows-2026-12-01/rows.py > docs/results/on-demand-rows-2026-12-01/rows.txt
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from training.prompts import chat_prompt_ids, load_prompts  # noqa: E402
from scripts.traffic_prompts import prompt_ids  # noqa: E402
from serving.config import SamplingParams, SpecParams  # noqa: E402
from serving.engine import Engine  # noqa: E402
import serving.engine  # noqa: E402
import serving.scheduler  # noqa: E402

torch.set_num_threads(2)
engine = Engine.from_paths(None, str(ROOT / "data" / "bootstrap-draft"), device="cpu",
                           heads=str(ROOT / "data" / "medusa-heads"))
engine.suffix_learn = False
head = engine.target.model.get_output_embeddings()
counted = {"rows": 0, "all": 0, "steps": 0}


def counting(tree, hidden, logits_of, verdict, generator=None):
    """verdict_on_demand, counting the rows it computes against the pass's rows (1 + nodes)."""
    def counted_logits(h):
        counted["rows"] += h.shape[0]
        return logits_of(h)
    counted["all"] += len(tree) + 1
    counted["steps"] += 1
    return on_demand(tree, hidden, counted_logits, verdict, generator)


on_demand = serving.scheduler.verdict_on_demand
serving.scheduler.verdict_on_demand = serving.engine.verdict_on_demand = counting
gsm = [chat_prompt_ids(engine.tokenizer, t) for t in load_prompts("gsm8k", "heldout", 6)]
mix = [p for ps in prompt_ids(engine.tokenizer, n=1).values() for p in ps]
print(f"target {engine.target_name}, {next(engine.target.model.parameters()).dtype}, 2 threads; "
      f"{len(gsm)} GSM8K held-out prompts, {len(mix)} traffic prompts; 64 new tokens each")
for name, prompts in (("gsm8k", gsm), ("traffic", mix)):
    for temp in (0.0, 1.0):
        counted.update(rows=0, all=0, steps=0)
        tokens = 0
        for i, p in enumerate(prompts):
            engine.scheduler.prefix_cache.clear()
            res = engine.generate_all(p, SamplingParams(temperature=temp, max_tokens=64, seed=1000 + i),
                                      SpecParams(mode="medusa"), log_mode="none")
            tokens += len(res.token_ids)
        print(f"{name} T={temp:g}: {tokens} tokens in {counted['steps']} tree steps; output rows computed "
              f"{counted['rows']} of {counted['all']} ({counted['rows'] / counted['all']:.1%}), "
              f"{counted['rows'] / counted['steps']:.2f} against {counted['all'] / counted['steps']:.2f} per step")

h = torch.randn(33, head.weight.shape[1], dtype=head.weight.dtype)
for n in (1, 8, 33):
    ts = []
    for _ in range(30):
        t0 = time.perf_counter()
        with torch.no_grad():
            head(h[:n])
        ts.append(time.perf_counter() - t0)
    print(f"output layer on {n:>2} rows: {statistics.median(ts) * 1e3:.2f} ms (median of 30)")
