import gc, time, sys, os
sys.path.insert(0, ".")
import ray, ray.serve, mlflow, fastapi
from serving.service import Service, ServiceSettings
from serving.config import SamplingParams, SpecParams
from serving.engine import Engine
svc = Service(ServiceSettings(gc_freeze=False))   # what a replica builds beside its engine
eng = Engine.from_paths(None, "data/bootstrap-draft", device="cpu", heads="data/medusa-heads")
if os.environ.get("FREEZE"):
    gc.collect(); gc.freeze()
stats = {0: [], 1: [], 2: []}; t = {}
def cb(phase, info):
    if phase == "start": t["s"] = time.perf_counter()
    else: stats[info["generation"]].append((time.perf_counter() - t["s"]) * 1e3)
gc.callbacks.append(cb)
prompts = ["Write a SQL query that counts orders per customer.", "Explain photosynthesis briefly.", "def fib(n):", "List three uses of JSON."] * 4
t0 = time.time(); toks = 0
for p in prompts:
    ids = eng.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False)
    r = eng.generate_all(ids, SamplingParams(max_tokens=64, temperature=0.0), SpecParams())
    toks += len(r.token_ids)
print("freeze" if os.environ.get("FREEZE") else "no freeze", f"{toks} tokens in {time.time() - t0:.0f} s")
for g, v in stats.items():
    print(" gen", g, len(v), "collections, max %.1f ms, total %.0f ms" % (max(v, default=0), sum(v)))
