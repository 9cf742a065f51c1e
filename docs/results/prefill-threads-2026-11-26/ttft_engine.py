import time, torch
from serving.engine import Engine
from serving.config import SamplingParams, SpecParams
from training.prompts import chat_prompt_ids, load_prompts
torch.set_num_threads(1)
eng = Engine.from_paths(None, "data/bootstrap-draft-2", draft_version="2", device="cpu")
prompts = load_prompts("gsm8k", "train", 40)
spec = SpecParams(mode="mjsd")
for _ in range(2): eng.generate_all(chat_prompt_ids(eng.tokenizer, prompts[-1]), SamplingParams(max_tokens=4), spec)
for rnd in range(2):
  for pt in (1, 2):
    eng.scheduler.prefill_threads = pt
    tt = []; pre = []
    for k in range(8):
        ids = chat_prompt_ids(eng.tokenizer, prompts[k + 10 * rnd])
        t0 = time.perf_counter()
        for out in eng.generate(ids, SamplingParams(temperature=0.7, max_tokens=2, seed=k), spec):
            if out.token_ids:
                tt.append(time.perf_counter() - t0); break
    tt.sort()
    print(f"prefill threads {pt}: TTFT median {tt[len(tt)//2]:.3f} s, mean {sum(tt)/len(tt):.3f} (prompt ~{len(ids)} tok)", flush=True)
