import time, torch
from serving.engine import Engine
from serving.config import SamplingParams, SpecParams
from training.prompts import chat_prompt_ids
torch.set_num_threads(2)
eng = Engine.from_paths(None, "data/bootstrap-draft-2", draft_version="2", device="cpu")
P = ["Why does the sky look blue during the day and red at sunset? Explain the physics.",
     "Write a Python function that merges two sorted lists into one sorted list.",
     "What is the role of mitochondria in a cell?",
     "Explain how a hash table handles collisions, with a short code example."]
sp = SamplingParams(temperature=0.0, max_tokens=64)
for m in ("target", "mjsd"): eng.generate_all(chat_prompt_ids(eng.tokenizer, P[0]), SamplingParams(max_tokens=8), SpecParams(mode=m))
tot = {"target": [0, 0, 0], "mjsd": [0, 0, 0]}
for rnd in range(3):
    for i, p in enumerate(P):
        ids = chat_prompt_ids(eng.tokenizer, p)
        order = ("target", "mjsd") if (rnd + i) % 2 == 0 else ("mjsd", "target")
        for m in order:
            t = time.perf_counter(); o = eng.generate_all(ids, sp, SpecParams(mode=m)); dt = time.perf_counter() - t
            st = o.stats
            tot[m][0] += dt; tot[m][1] += len(o.token_ids); tot[m][2] += st.target_time_s
            print(rnd, i, m, round(dt, 2), len(o.token_ids), "target_s", round(st.target_time_s, 2), "draft_s", round(st.draft_time_s, 2), "zero", getattr(st, "zero_draft_steps", ""), flush=True)
for m, (s, n, ts) in tot.items(): print(m, f"{n/s:.2f} tok/s, target forward time {ts:.1f} s of {s:.1f} s")
print("default vs target:", round((tot['mjsd'][1]/tot['mjsd'][0]) / (tot['target'][1]/tot['target'][0]), 3))
