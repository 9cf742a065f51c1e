import time, torch, asyncio, sys
from serving.service import Service, ServiceSettings
from serving.config import SamplingParams, SpecParams
from training.prompts import chat_prompt_ids, load_prompts
pt = int(sys.argv[1])
s = Service(ServiceSettings(draft="data/bootstrap-draft-2", buffer=False, torch_threads=1, prefill_threads=pt, device="cpu"))
eng = s.engine
print("scheduler prefill_threads", eng.scheduler.prefill_threads, "main threads", torch.get_num_threads())
prompts = load_prompts("gsm8k", "train", 40)
spec = SpecParams(mode="mjsd")
for _ in range(2): eng.generate_all(chat_prompt_ids(eng.tokenizer, prompts[-1]), SamplingParams(max_tokens=4), spec)
tt = []
for k in range(8):
    ids = chat_prompt_ids(eng.tokenizer, prompts[k])
    t0 = time.perf_counter()
    for out in eng.generate(ids, SamplingParams(temperature=0.7, max_tokens=2, seed=k), spec):
        if out.token_ids:
            tt.append(time.perf_counter() - t0); break
tt.sort(); print(pt, "TTFT median", round(tt[4], 3))
s.close()
