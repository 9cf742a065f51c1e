import cProfile, pstats, sys, time, os
import torch
from serving.config import SamplingParams, SpecParams
from serving.engine import Engine
from serving import scheduler as S
from training.prompts import chat_prompt_ids, load_prompts
eng = Engine.from_paths(None, None, device="cuda")
ps = load_prompts("gsm8k", "train", 20)
def go(sp, n=3, prof=None):
    t0 = time.perf_counter(); tok = 0
    for i in range(n):
        r = eng.generate_all(chat_prompt_ids(eng.tokenizer, ps[i]), sp, SpecParams(mode="target")); tok += len(r.token_ids)
    return 1000 * (time.perf_counter() - t0) / tok
go(SamplingParams(temperature=0, max_tokens=16), 2)
for name, sp in [("T0", SamplingParams(temperature=0, max_tokens=64)), ("T.7seed", SamplingParams(temperature=0.7, max_tokens=64, seed=1)),
                 ("T.7", SamplingParams(temperature=0.7, max_tokens=64)), ("T.7k20", SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=64))]:
    print(name, "%.1f ms/token" % go(sp), flush=True)
pr = cProfile.Profile(); orig = S.BatchScheduler._round
def _round(self):
    pr.enable()
    try: return orig(self)
    finally: pr.disable()
S.BatchScheduler._round = _round
go(SamplingParams(temperature=0.7, max_tokens=64), 2)
pstats.Stats(pr).sort_stats("tottime").print_stats(22)
